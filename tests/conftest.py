import torch

# Tiny models: one thread is faster than two (no sync cost) and steady on shared cores.
torch.set_num_threads(1)
