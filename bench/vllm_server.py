"""vLLM's OpenAI server with TENSORBEND_MAX_MEMORY inside a memory cgroup smaller than the
checkpoint: its greedy completions against resident vLLM's, its counters and memory.

Usage (root, for the cgroup; after bench.vllm_offload built the inflated model and its store):
    python -m bench.vllm_server --max-memory 886MB --cap 3206MB \\
        --json docs/results/bench/vllm_server.json

The server (`python -m vllm.entrypoints.openai.api_server`, what `vllm serve` runs) starts in
a fresh cgroup of `--cap` bytes (page cache included), serves the held-out prompts as
concurrent completion requests (temperature 0), writes its counters and is stopped; the same
prompts then run through resident vLLM (every expert in memory, no cgroup) for the reference
text.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"

_CLIENT = textwrap.dedent("""
    import json, subprocess, sys, time
    from openai import OpenAI, APIConnectionError
    cmd, prompts, out, max_tokens = json.loads(sys.argv[1])
    server = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr)
    try:
        client = OpenAI(base_url="http://127.0.0.1:%s/v1" % cmd[cmd.index("--port") + 1],
                        api_key="none", max_retries=0)
        for _ in range(600):
            assert server.poll() is None, "the server exited"
            try:
                model = client.models.list().data[0].id
                break
            except APIConnectionError:
                time.sleep(0.5)
        r = client.completions.create(model=model, prompt=prompts, max_tokens=max_tokens,
                                      temperature=0)
        texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
        time.sleep(1.5)  # (the counters file: written every 0.5 s)
    finally:
        server.terminate()
        server.wait(120)
    json.dump(texts, open(out, "w"))
""")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--factor", type=int, default=184)
    ap.add_argument("--max-memory", default="886MB", help="TENSORBEND_MAX_MEMORY")
    ap.add_argument("--cap", default="3206MB", help="the server's memory cgroup")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--workdir", type=Path, default=Path("runs/bench/serve"))
    ap.add_argument("--json", type=Path, default=Path("docs/results/bench/vllm_server.json"))
    args = ap.parse_args(argv)
    from bench import memory_cap
    from bench.serve_memory import _test_prompts
    from bench.vllm_offload import KV_GIB, _vllm
    from tensorbend.atomic import write_generated
    from tensorbend.memory import parse_bytes

    ckpt = args.workdir / f"qwen3moe-tiny-x{args.factor}"
    prompts_file = _test_prompts(args.workdir / "vllm-prompts.jsonl", args.prompts)
    prompts = [json.loads(x)["text"] for x in prompts_file.read_text().splitlines()]
    counters = args.workdir / "vllm-server-counters"
    cmd = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
           "--dtype", "float32", "--port", str(_free_port()), "--host", "127.0.0.1",
           "--max-model-len", "1024", "--enforce-eager", "--no-enable-prefix-caching"]  # fmt: skip
    env = {**os.environ, "TENSORBEND_MAX_MEMORY": args.max_memory, "TENSORBEND_IO": "direct",
           "TENSORBEND_STORE_DIR": str(args.workdir / "store-vllm"),
           "TENSORBEND_COUNTERS": str(counters), "TENSORBEND_FLUSH_S": "0.5",
           "VLLM_CPU_KVCACHE_SPACE": KV_GIB, "PYTHONPATH": str(ROOT)}  # fmt: skip
    out = args.workdir / "vllm-server-texts.json"
    cap = parse_bytes(args.cap, "--cap")
    run = memory_cap.run_capped(
        [str(VLLM_PY), "-c", _CLIENT,
         json.dumps([cmd, prompts, str(out), args.max_new_tokens])], cap, env=env
    )  # fmt: skip
    if run.returncode != 0:
        raise SystemExit(f"the capped server run failed ({run.oom_kills} OOM kills):\n"
                         f"{run.stderr[-4000:]}")  # fmt: skip
    texts = json.loads(out.read_text())
    ref = _vllm(ckpt, prompts_file, args.max_new_tokens, len(prompts), {}, None)
    c = [json.loads(p.read_text()) for p in sorted(counters.glob("counters-rank*.json"))][0]
    result = {
        "bench": "vllm_server",
        "command": "python -m bench.vllm_server " + " ".join(sys.argv[1:]),
        "checkpoint_bytes": sum(p.stat().st_size for p in ckpt.glob("*.safetensors")),
        "cap_bytes": cap,
        "cap_max_usage_bytes": run.max_usage_bytes,
        "oom_kills": run.oom_kills,
        "server_peak_rss_bytes": c["peak_rss_bytes"],
        "same_text_as_resident_vllm": texts == ref["text"],
        "texts": texts,
        "offload_totals": c["offload"]["totals"],
        "cache_slots": c["offload"]["cache_slots"],
        "tokens": c["tokens"],
    }
    write_generated(args.json, json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "texts"}, indent=1))
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    raise SystemExit(main())
