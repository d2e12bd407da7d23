import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
# Tiny models: one thread is faster than two (no sync cost) and steady on shared cores.
torch.set_num_threads(1)
