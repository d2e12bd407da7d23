"""A child process for the vLLM offload tests: one `vllm.LLM`, greedy completions, JSON out.

Usage: python tests/vllm_child.py MODEL OUT.json [--tp N] [--dtype D]   (TENSORBEND_* in the environment
decide whether the plugin offloads: each configuration needs its own process, since vLLM loads
its plugins once per process)
"""

import json
import os
import sys

PROMPTS = [
    "And God said, Let there be light",
    "The quick brown fox",
    "def fibonacci(n):",
    "In the beginning was the Word, and the Word was with God",
]

if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from tensorbend.engines.vllm_offload import routed_layers
    from tensorbend.zoo import resolve_model

    model, out = sys.argv[1], sys.argv[2]
    tp = int(sys.argv[sys.argv.index("--tp") + 1]) if "--tp" in sys.argv else 1
    dtype = sys.argv[sys.argv.index("--dtype") + 1] if "--dtype" in sys.argv else "float32"
    llm = LLM(
        model=str(resolve_model(model)),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=512,
        seed=0,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
    )
    sp = SamplingParams(temperature=0, max_tokens=16, logprobs=1)
    batched = llm.generate(PROMPTS, sp, use_tqdm=False)
    alone = [llm.generate([p], sp, use_tqdm=False)[0] for p in PROMPTS]

    def tokens(o):
        return list(o.outputs[0].token_ids)

    def logprobs(o):
        out = o.outputs[0]
        return [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]

    result = {
        "batched": [tokens(o) for o in batched],
        "alone": [tokens(o) for o in alone],
        "logprobs": [logprobs(o) for o in batched],
        "text": [o.outputs[0].text for o in batched],
    }
    if tp == 1:

        def inspect(m):
            off = getattr(m, "tensorbend_offload", None)
            layers = routed_layers(m)
            return {
                "param_bytes": sum(p.nbytes for p in m.parameters()),  # (each once)
                "pool_rows": [tuple(x.w13_weight.shape)[0] for x in layers],
                "shared_pool": len({x.w13_weight.data_ptr() for x in layers}) == 1,
                "counters": None if off is None else off.counters(),
            }

        result |= llm.apply_model(inspect)[0]
    with open(out, "w") as f:
        json.dump(result, f)
