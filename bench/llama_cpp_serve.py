"""llama.cpp served as its users serve it: one warm process per row, every prompt in turn, the
GGUF memory-mapped, in the row's memory cgroup; prefill and decode timed and read apart.

Usage:
    python -m bench.llama_cpp_serve install            # llama-cpp-python built from the sdist
    python -m bench.llama_cpp_serve quantize IN.gguf OUT.gguf Q4_0   # llama.cpp's own quantizer
    python -m bench.llama_cpp_serve serve MODEL.gguf --prompts P.jsonl --max-new-tokens 32
    row = warm_row(gguf, ctx, prefill=False)           # bench.serve_rows.EXTERNAL's signature
    files = ggufs(ckpt_dir, ["f32", "bf16", "Q8_0"])   # kind -> (GGUF, its repacking runs here)

The process is llama-cpp-python (the Python binding PyPI ships of the same vendored llama.cpp
bench/llama_cpp.py builds from: `pip install` compiles it with `-DGGML_NATIVE=ON`), the way a
Python user runs llama.cpp: `Llama(model_path, n_threads, use_mmap=True)` once, then each prompt
greedily (`generate`, top-k 1, no repetition penalty), its KV cache reset between prompts.
Before the row the GGUF's pages are dropped once (as tensorbend's rows start with an empty
cache); within the row they stay cached as mmap keeps them, under the cgroup's cap. Per prompt:
time to first token (prefill and the first sample) and the disk bytes read until then, then the
decode steps' seconds and the disk bytes read during them (/proc/self/io `read_bytes`: the
storage reads the process caused, mmap faults and their readahead included), so bytes per
decode token count decode only, as tensorbend's rows do. Text: the greedy continuation, compared
by the bench with tensorbend's at the same precision (`same_text`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench import llama_cpp, memory_cap
from tensorbend.errors import TensorbendError

QUANTS = ("Q4_0", "Q4_K_M", "Q8_0")
KINDS = ("f32", "bf16", *QUANTS)
"""The GGUF precisions a serving bench can run: the converter's f32 and bf16, llama-quantize's."""
BYTES_PER_WEIGHT = {"f32": 4.0, "bf16": 2.0, "Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_K_M": None}
"""Bytes a weight takes in each kind (Q8_0: 32 int8 + an fp16 scale per block of 32; Q4_0: 32
nibbles + an fp16 scale; Q4_K_M mixes kinds per tensor)."""


def install() -> None:
    """Build and install llama-cpp-python from the sdist bench/llama_cpp.py downloads."""
    try:
        import llama_cpp as binding  # noqa: F401

        return
    except ImportError:
        pass
    root = llama_cpp.default_root()
    sdist = root / f"llama_cpp_python-{llama_cpp.VERSION}.tar.gz"
    if not sdist.is_file():
        llama_cpp.build(root)
    env = {"CMAKE_ARGS": "-DGGML_NATIVE=ON -DLLAMA_CURL=OFF", "PATH": _path()}
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", str(sdist)],
        env=env,
        capture_output=True,
        text=True,
    )
    if p.returncode != 0:
        raise TensorbendError(f"pip install {sdist} failed:\n{p.stderr[-3000:]}")
    print(
        f"llama-cpp-python {llama_cpp.VERSION} installed in {time.perf_counter() - t0:.0f} s",
        file=sys.stderr,
    )


def ggufs(ckpt: Path, kinds) -> dict[str, tuple[Path, bool]]:
    """The checkpoint as GGUFs of `kinds` (f32 and bf16 by the converter, the quantized kinds
    by llama-quantize from the converter's own-precision file), each beside `ckpt` and reused,
    with whether llama.cpp's weight repacking (its default) runs it here (`repack_runs`; where
    it does not, the row runs `--no-repack`, said in its name: `row_name`)."""
    if not kinds:
        return {}
    install()
    own = llama_cpp.convert(ckpt, ckpt.with_name(f"{ckpt.name}-{llama_cpp.precision(ckpt)}.gguf"))
    out = {}
    for kind in kinds:
        path = ckpt.with_name(f"{ckpt.name}-{kind}.gguf")  # (the file's last "-" part: its kind)
        if path == own:
            pass
        elif kind in QUANTS:
            path = quantize(own, path, kind)
        else:
            path = llama_cpp.convert(ckpt, path, kind)
        out[kind] = (path, repack_runs(path))
    return out


def row_name(kind: str, repack: bool, cap: str = "") -> str:
    """A llama.cpp row's name in the serving benches' tables.

    >>> row_name("Q4_0", False, "same cap")
    'llama.cpp Q4_0 (mmap, warm, --no-repack; same cap)'
    """
    flags = "" if repack else ", --no-repack"
    return f"llama.cpp {kind} (mmap, warm{flags}{'; ' + cap if cap else ''})"


def quantize(src: Path, out: Path, kind: str) -> Path:
    """`src` (an f32/bf16 GGUF) quantized by llama.cpp's own `llama-quantize` to `kind`
    (Q4_0: 4.5 bits a weight, a fp16 scale per 32; Q4_K_M; Q8_0); reused when `out` exists."""
    if out.is_file():
        return out
    tools = llama_cpp.find() or llama_cpp.build()
    exe = tools.source / "build" / "bin" / "llama-quantize"
    if not exe.is_file():
        subprocess.run(
            ["ninja", "-C", str(tools.source / "build"), "llama-quantize"],
            check=True,
            capture_output=True,
        )
    tmp = out.with_suffix(".part")
    p = subprocess.run([str(exe), str(src), str(tmp), kind], capture_output=True, text=True)
    if p.returncode != 0:
        raise TensorbendError(f"llama-quantize {src} {kind} failed:\n{p.stderr[-2000:]}")
    tmp.rename(out)
    return out


def serve(
    gguf: Path, prompts: list[str], max_new_tokens: int, threads: int = 2, repack: bool = True
) -> dict:
    """Every prompt in one process (see top): per prompt its timings, bytes and text. repack:
    llama.cpp's weight repacking (its default; `--no-repack` of its binaries), set through
    `llama_model_params.use_extra_bufts`, which the binding does not expose."""
    import llama_cpp.llama_cpp as api
    from llama_cpp import Llama

    defaults = api.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = repack
        return p

    api.llama_model_default_params = params

    t0, io0 = time.perf_counter(), _read_bytes()
    llm = Llama(
        model_path=str(gguf),
        n_ctx=2048,
        n_threads=threads,
        n_threads_batch=threads,
        use_mmap=True,
        verbose=False,
        seed=0,
    )
    load = {"load_s": time.perf_counter() - t0, "load_disk_bytes": _read_bytes() - io0}
    out = []
    for text in prompts:
        ids = llm.tokenize(text.encode())
        llm.reset()
        t0, io0 = time.perf_counter(), _read_bytes()
        gen = llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)
        toks = [next(gen)]
        t1, io1 = time.perf_counter(), _read_bytes()
        while len(toks) < max_new_tokens and toks[-1] != llm.token_eos():
            toks.append(next(gen))
        t2, io2 = time.perf_counter(), _read_bytes()
        gen.close()
        out.append(
            {
                "prompt_tokens": len(ids),
                "ttft_s": t1 - t0,
                "prefill_disk_bytes": io1 - io0,
                "decode_steps": len(toks) - 1,
                "decode_s": t2 - t1,
                "decode_disk_bytes": io2 - io1,
                "text": llm.detokenize(toks).decode(errors="replace"),
            }
        )
    return {**load, "prompts": out}


def import_rss() -> int:
    """The peak RSS of a process that imports what `serve` runs on (the binding, this module):
    llama.cpp's own baseline, as `serving.IMPORT_BASELINE` is tensorbend's."""
    code = (
        "import bench.llama_cpp_serve, llama_cpp.llama_cpp\n"
        "print([int(x.split()[1]) * 1024 for x in open('/proc/self/status')"
        " if x.startswith('VmHWM')][0])"
    )
    return int(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
    )


def repack_runs(gguf: Path, threads: int = 2) -> bool:
    """Whether llama.cpp runs `gguf` with its weight repacking on this machine: a 2-token
    probe. (On this project's VM it does not for Q4_0 and Q4_K_M: the repacked kernels die on
    SIGSEGV / SIGILL, although the CPU advertises the AMX and AVX-512 they use.)"""
    texts = json.dumps(["And God said"])
    cmd = [sys.executable, "-m", "bench.llama_cpp_serve", "serve", str(gguf), "--threads"]
    cmd += [str(threads), "--max-new-tokens", "2", "--texts", texts]
    return subprocess.run(cmd, capture_output=True, text=True).returncode == 0


def warm_row(gguf: Path, ctx: dict, prefill: bool, threads: int = 2, repack: bool = True) -> dict:
    """One run of a serving bench's llama.cpp row (bench.serve_rows.EXTERNAL's contract): a warm
    process for the row's decode prompts (or its one long prefill prompt, 1 new token), the
    GGUF's pages dropped first, in the bench's memory cap."""
    key = "prefill_prompt" if prefill else "prompts"
    texts = [json.loads(x)["text"] for x in Path(ctx[key]).read_text().splitlines() if x]
    n = 1 if prefill else ctx["max_new_tokens"]
    llama_cpp._evict(gguf)
    cmd = [
        sys.executable,
        "-m",
        "bench.llama_cpp_serve",
        "serve",
        str(gguf),
        "--threads",
        str(threads),
        "--max-new-tokens",
        str(n),
        "--texts",
        json.dumps(texts),
    ]
    cmd += [] if repack else ["--no-repack"]
    cap = ctx.get("memory_cap_bytes")
    if cap is None:
        p, peak, kills = subprocess.run(cmd, capture_output=True, text=True), None, 0
    else:
        p = memory_cap.run_capped(cmd, cap)
        peak, kills = p.max_usage_bytes, p.oom_kills
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} failed ({kills} OOM kills):\n{p.stderr[-2000:]}")
    res = json.loads(p.stdout)
    ps = res["prompts"]
    steps = sum(x["decode_steps"] for x in ps)
    return {
        "engine": "llama.cpp",
        "decode_tok_s": steps / sum(x["decode_s"] for x in ps) if steps else None,
        "decode_tokens": steps,
        "bytes_read_per_token": sum(x["decode_disk_bytes"] for x in ps) / max(steps, 1),
        "disk_read_bytes_per_token": sum(x["decode_disk_bytes"] for x in ps) / max(steps, 1),
        "demand_hit_rate": None,
        "stall_s_per_token": None,
        "predict_s_per_token": None,
        "stall_share": None,
        "cache_slots": None,
        "peak_rss_bytes": res.get("peak_rss_bytes", 0),
        "cap_max_usage_bytes": peak,
        "oom_kills": kills,
        "prefill_s": sum(x["ttft_s"] for x in ps),
        "prefill_tokens": sum(x["prompt_tokens"] for x in ps),
        "load_s": res["load_s"],
        "text": "".join(t + x["text"] + "\n" for t, x in zip(texts, ps, strict=True)),
        "expert_stored_bytes": None,
        "expert_bytes": None,
        "expert_dtype": gguf.stem.rsplit("-", 1)[-1],
        "slot_dtype": None,
        "threads": threads,
        "repack": repack,
    }


# ------------------------------------------------------------ helpers


def _read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _path() -> str:
    import os

    return os.environ.get("PATH", "/usr/bin:/bin")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install")
    q = sub.add_parser("quantize")
    q.add_argument("src", type=Path)
    q.add_argument("out", type=Path)
    q.add_argument("kind", choices=QUANTS)
    s = sub.add_parser("serve")
    s.add_argument("gguf", type=Path)
    s.add_argument("--prompts", type=Path, help="JSONL of {text}")
    s.add_argument("--texts", default=None, help="a JSON list of prompt texts instead")
    s.add_argument("--max-new-tokens", type=int, default=32)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--no-repack", action="store_true", help="llama.cpp's --no-repack")
    args = ap.parse_args(argv)
    if args.cmd == "install":
        install()
    elif args.cmd == "quantize":
        print(quantize(args.src, args.out, args.kind))
    else:
        texts = (
            json.loads(args.texts)
            if args.texts
            else [json.loads(x)["text"] for x in args.prompts.read_text().splitlines() if x]
        )
        res = serve(args.gguf, texts, args.max_new_tokens, args.threads, not args.no_repack)
        import resource

        res["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
