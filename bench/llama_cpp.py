"""llama.cpp as a serving peer: built from the sources PyPI's `llama-cpp-python` sdist vendors,
run on a GGUF written from the same checkpoint, in the same memory cgroup as tensorbend's rows.

Usage:
    python -m bench.llama_cpp build                       # runs/llama.cpp/ (or $TENSORBEND_LLAMA_CPP)
    python -m bench.llama_cpp convert CKPT_DIR OUT.gguf   # the checkpoint's own precision
    python -m bench.llama_cpp run OUT.gguf --prompt "And God said" --max-new-tokens 24 \
        --cap 1GB                                         # one capped, cold run: JSON on stdout

    >>> tools = build()                                          # doctest: +SKIP
    >>> gguf = convert(Path("runs/ckpt-x184"), Path("runs/x184.gguf"))  # doctest: +SKIP
    >>> r = run(gguf, "And God said", 24, cap_bytes=1 << 30)    # doctest: +SKIP
    >>> r["decode_tok_s"], r["disk_read_bytes_per_token"], r["text"]  # doctest: +SKIP

`build` downloads the sdist with pip (kept in the cache folder), configures
`cmake -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON` and builds
`llama-completion` (the timed binary: greedy text on stdout, its perf summary on stderr) and
`llama-bench`; a finished build is reused. `convert` runs the vendored `convert_hf_to_gguf.py`
in a subprocess whose `get_vocab_base_pre` falls back to "gpt-2" when the converter does not
recognise the pre-tokenizer by its hash, which is right only for byte-level BPE tokenizers with
GPT-2's regex (every zoo tokenizer; checked before converting). `run` is one
`llama-completion` (temperature 0, seed 0, mmap on as its users run it, `--no-warmup`) under
`bench.memory_cap` (a cgroup of `cap_bytes`, the page cache its faults fill included).

Cold start: tensorbend's rows read with `--io direct` (never from the page cache), and a page
another cgroup put in the cache is not charged to this one, so a warm file would let llama.cpp
hold more of the model than the cap. Each run therefore first evicts the GGUF's pages
(`posix_fadvise(DONTNEED)` on that one file; the shared machine's other caches are left alone).
Bytes read: `/usr/bin/time`'s `%I` (the child's `ru_inblock`, 512-byte blocks: the kernel's
per-task read accounting, `read_bytes` of /proc/PID/io), which counts the reads a task submits,
so the readahead its mmap page faults trigger is included.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import memory_cap
from tensorbend.errors import TensorbendError

VERSION = "0.3.36"
ENV = "TENSORBEND_LLAMA_CPP"
TARGETS = ("llama-completion", "llama-bench")
CMAKE = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON"]


@dataclass(frozen=True)
class Tools:
    """A finished build: the vendored llama.cpp sources and its binaries."""

    source: Path
    completion: Path
    bench: Path


def default_root() -> Path:
    return Path(os.environ.get(ENV) or "runs/llama.cpp")


def find(root: Path | None = None) -> Tools | None:
    """The build under `root` (default `$TENSORBEND_LLAMA_CPP` or runs/llama.cpp), if finished."""
    source = _source(root)
    tools = Tools(source, *(source / "build" / "bin" / t for t in TARGETS))
    return tools if tools.completion.is_file() and tools.bench.is_file() else None


def build(root: Path | None = None) -> Tools:
    """Download the sdist (once) and build the binaries (once); prints the build time."""
    root = Path(root or default_root())
    if tools := find(root):
        return tools
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        _check([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                f"llama-cpp-python=={VERSION}", "-d", str(root)])  # fmt: skip
    source = _source(root)
    if not source.is_dir():
        _check(["tar", "xzf", str(sdist), "-C", str(root)])
    t0 = time.perf_counter()
    _check(["cmake", "-S", str(source), "-B", str(source / "build"), *CMAKE])
    _check(["ninja", "-C", str(source / "build"), *TARGETS])
    print(f"llama.cpp {VERSION}: {', '.join(TARGETS)} built in {time.perf_counter() - t0:.0f} s "
          f"on {os.cpu_count()} cores", file=sys.stderr)  # fmt: skip
    tools = find(root)
    assert tools is not None, f"ninja succeeded but {TARGETS} are not under {source}/build/bin"
    return tools


def convert(checkpoint: Path, out: Path, outtype: str | None = None,
            tools: Tools | None = None) -> Path:  # fmt: skip
    """Write `checkpoint` (an HF directory) as a GGUF at `out`, in `outtype` (default: the
    checkpoint's own precision, f32 or bf16); reused when `out` exists."""
    checkpoint, out = Path(checkpoint), Path(out)
    if out.is_file():
        return out
    source = tools.source if tools else _source()
    if not (source / "convert_hf_to_gguf.py").is_file():
        raise TensorbendError(f"llama.cpp: expected its converter under {source}, found none; "
                              f"run `make llama-cpp` (python -m bench.llama_cpp build)")  # fmt: skip
    outtype = outtype or precision(checkpoint)
    _check_byte_level(checkpoint)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    _check([sys.executable, "-c", _CONVERT, str(source), str(checkpoint),
            "--outfile", str(tmp), "--outtype", outtype])  # fmt: skip
    tmp.rename(out)
    return out


def run(gguf: Path, prompt: str | Path, max_new_tokens: int, cap_bytes: int | None = None,
        threads: int = 2, mmap: bool = True, cold: bool = True,
        tools: Tools | None = None) -> dict:  # fmt: skip
    """One greedy `llama-completion` of `prompt` (text, or a Path to a text file), in a memory
    cgroup of `cap_bytes` when given. Returns its timings, disk bytes, peak memory and text."""
    tools, gguf = tools or _need(), Path(gguf)
    if cold:
        _evict(gguf)
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = Path(prompt) if isinstance(prompt, Path) else Path(tmp) / "prompt.txt"
        if not isinstance(prompt, Path):
            prompt_file.write_text(prompt)
        usage = Path(tmp) / "usage"
        cmd = command(tools, gguf, prompt_file, max_new_tokens, threads, mmap)
        timed = ["/usr/bin/time", "-o", str(usage), "-f", "%I %M %e", *cmd]
        if cap_bytes is None:
            p = subprocess.run(timed, capture_output=True, text=True)
            peak, kills = None, 0
        else:
            c = memory_cap.run_capped(timed, cap_bytes)
            p, peak, kills = c, c.max_usage_bytes, c.oom_kills
        if p.returncode != 0:
            killed = f" ({kills} OOM kills under the cap)" if kills else ""
            raise TensorbendError(f"{' '.join(cmd)} failed{killed}:\n{p.stderr[-2000:]}")
        blocks, max_rss_kb, wall = usage.read_text().split()[-3:]
    t = parse_timings(p.stderr)
    disk = int(blocks) * 512
    return {
        "engine": "llama.cpp",
        "command": cmd,
        "cap_bytes": cap_bytes,
        "cold": cold,
        "mmap": mmap,
        "threads": threads,
        **t,
        "ttft_s": t["prompt_ms"] / 1e3,
        "disk_read_bytes": disk,
        "disk_read_bytes_per_token": disk / max(t["prompt_tokens"] + t["decode_tokens"], 1),
        "cap_max_usage_bytes": peak,
        "peak_rss_bytes": int(max_rss_kb) * 1024,
        "wall_s": float(wall),
        "oom_kills": kills,
        "text": p.stdout.removesuffix("\n\n"),  # (completion.cpp logs "\n\n" after the text)
    }


def command(tools: Tools, gguf: Path, prompt_file: Path, max_new_tokens: int, threads: int = 2,
            mmap: bool = True) -> list[str]:  # fmt: skip
    """The `llama-completion` argv of one greedy run: its continuation only on stdout."""
    cmd = [str(tools.completion), "-m", str(gguf), "-f", str(prompt_file),
           "-n", str(max_new_tokens), "--temp", "0", "--seed", "0", "-t", str(threads),
           "-c", "0", "--no-warmup", "-no-cnv", "--no-display-prompt"]  # fmt: skip
    return cmd + ([] if mmap else ["--no-mmap"])


_PERF = re.compile(r"(prompt eval|eval) time =\s*([\d.]+) ms /\s*(\d+) (?:tokens|runs)")


def parse_timings(stderr: str) -> dict:
    """Prefill and decode timings from llama.cpp's perf summary (`llama_perf_context_print`):
    prompt tokens, their ms, decode tokens (its "eval" runs), their ms and both rates."""
    found = {}
    for kind, ms, n in _PERF.findall(stderr):
        found[kind] = (float(ms), int(n))
    if set(found) != {"prompt eval", "eval"}:
        raise TensorbendError(
            f"expected llama.cpp's perf summary ('prompt eval time = ... ms / N tokens' and "
            f"'eval time = ... ms / N runs') on stderr, found {sorted(found) or 'neither'}"
        )
    (pms, pn), (dms, dn) = found["prompt eval"], found["eval"]
    return {
        "prompt_tokens": pn,
        "prompt_ms": pms,
        "prefill_tok_s": pn / pms * 1e3 if pms else None,
        "decode_tokens": dn,
        "decode_ms": dms,
        "decode_tok_s": dn / dms * 1e3 if dms else None,
    }


def measure(gguf: Path, prompt: str, max_new_tokens: int, cap_bytes: int | None,
            threads: int = 2, tools: Tools | None = None) -> dict:  # fmt: skip
    """Prefill and decode on one prompt, each run cold: a run of 1 new token (its time to first
    token and the bytes prefill reads) and a run of `max_new_tokens` + 1 (decode tok/s); the
    disk bytes per decode token are the difference of the two runs' reads over the extra tokens."""
    first = run(gguf, prompt, 1, cap_bytes, threads, tools=tools)
    full = run(gguf, prompt, max_new_tokens + 1, cap_bytes, threads, tools=tools)
    extra = full["decode_tokens"] - first["decode_tokens"]
    return {
        "prompt_tokens": full["prompt_tokens"],
        "ttft_s": first["ttft_s"],
        "prefill_tok_s": first["prefill_tok_s"],
        "prefill_disk_read_bytes": first["disk_read_bytes"],
        "decode_tok_s": full["decode_tok_s"],
        "decode_tokens": full["decode_tokens"],
        "decode_disk_read_bytes_per_token": (full["disk_read_bytes"] - first["disk_read_bytes"])
        / max(extra, 1),
        "cap_max_usage_bytes": max(
            first["cap_max_usage_bytes"] or 0, full["cap_max_usage_bytes"] or 0
        )
        or None,  # fmt: skip
        "peak_rss_bytes": max(first["peak_rss_bytes"], full["peak_rss_bytes"]),
        "runs": [first, full],
    }


def row(gguf: Path, ctx: dict, prefill: bool, tools: Tools | None = None) -> dict:
    """One run of the serving bench's llama.cpp row (`bench.serve_rows.EXTERNAL`), cold, in the
    bench's memory cap: the prefill run (its long prompt, 1 new token) or the decode run (each
    decode prompt in turn, `max_new_tokens` each, a cold process per prompt). Its keys are
    `serve_rows.ROW_KEYS`; disk bytes per token are the decode runs' whole reads (prefill
    included: llama.cpp does not split them) over their decode tokens."""
    cap = ctx["memory_cap_bytes"]
    if prefill:
        text = json.loads(Path(ctx["prefill_prompt"]).read_text().splitlines()[0])["text"]
        r = run(gguf, text, 1, cap, tools=tools)
        return _row(r, [r], prefill_s=r["ttft_s"], prefill_tokens=r["prompt_tokens"])
    prompts = [json.loads(x)["text"] for x in Path(ctx["prompts"]).read_text().splitlines() if x]
    rs = [run(gguf, p, ctx["max_new_tokens"], cap, tools=tools) for p in prompts]
    n = sum(r["decode_tokens"] for r in rs)
    agg = {
        "decode_tok_s": n / sum(r["decode_ms"] for r in rs) * 1e3,
        "decode_tokens": n,
        "disk_read_bytes_per_token": sum(r["disk_read_bytes"] for r in rs) / max(n, 1),
    }
    return _row(agg, rs, prefill_s=sum(r["ttft_s"] for r in rs),
                prefill_tokens=sum(r["prompt_tokens"] for r in rs))  # fmt: skip


def _row(agg: dict, rs: list[dict], prefill_s: float, prefill_tokens: int) -> dict:
    peak = max(r["peak_rss_bytes"] for r in rs)
    capped = [r["cap_max_usage_bytes"] for r in rs if r["cap_max_usage_bytes"] is not None]
    return {
        "engine": "llama.cpp", "decode_tok_s": agg["decode_tok_s"],
        "decode_tokens": agg["decode_tokens"],
        "bytes_read_per_token": agg["disk_read_bytes_per_token"],
        "disk_read_bytes_per_token": agg["disk_read_bytes_per_token"],
        "demand_hit_rate": None, "stall_s_per_token": None, "predict_s_per_token": None,
        "cache_slots": None, "peak_rss_bytes": peak, "prefill_s": prefill_s,
        "prefill_tokens": prefill_tokens, "text": "".join(r["text"] for r in rs),
        "cap_max_usage_bytes": max(capped) if capped else None,
        "oom_kills": sum(r["oom_kills"] for r in rs), "commands": [r["command"] for r in rs],
    }  # fmt: skip


# ------------------------------------------------------------ helpers

# The vendored converter in a fresh interpreter, its pre-tokenizer lookup falling back to
# "gpt-2" (the vendored files stay as shipped). argv: SOURCE CHECKPOINT converter flags...
_CONVERT = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
from conversion.base import TextModel
known = TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:  # an unrecognised hash: byte-level BPE with GPT-2's regex
        return "gpt-2"
TextModel.get_vocab_base_pre = pre
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _source(root: Path | None = None) -> Path:
    return Path(root or default_root()) / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


def _need() -> Tools:
    tools = find()
    if tools is None:
        raise TensorbendError(
            f"llama.cpp: expected a build under {default_root()} (${ENV}), found none; "
            f"run `make llama-cpp` (python -m bench.llama_cpp build)"
        )
    return tools


def precision(checkpoint: Path) -> str:
    """The checkpoint's own precision as a GGUF kind (f32, bf16 or f16), from its config."""
    config = json.loads((checkpoint / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    kinds = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
    if dtype not in kinds:
        raise TensorbendError(f"{checkpoint}: dtype {dtype!r}: expected one of {sorted(kinds)}")
    return kinds[dtype]


def _check_byte_level(checkpoint: Path) -> None:
    """The "gpt-2" fallback is right only for a byte-level BPE with GPT-2's split regex."""
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    pre = tok.get("pre_tokenizer") or {}
    if not (pre.get("type") == "ByteLevel" and pre.get("use_regex")
            and tok["model"]["type"] == "BPE"):  # fmt: skip
        raise TensorbendError(
            f"{checkpoint}/tokenizer.json: expected a byte-level BPE with GPT-2's regex "
            f"(ByteLevel, use_regex), found pre_tokenizer {pre.get('type')!r}"
        )


def _evict(path: Path) -> None:
    """Drop `path`'s pages from the page cache (this file only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _long_prompt(gguf: Path, tokens: int) -> str:
    """The held-out test prompts joined until they make at least `tokens` tokens (counted by
    the zoo tokenizer that wrote `gguf`: every zoo model shares it)."""
    from tensorbend.capture.hf import load_tokenizer
    from tensorbend.capture.prompts import load_prompts
    from tensorbend.zoo import resolve_model

    tok = load_tokenizer(resolve_model("zoo:default"))
    text = ""
    for p in load_prompts(None, "test"):
        text = f"{text}\n\n{p.text}" if text else p.text
        if len(tok(text).input_ids) >= tokens:
            return text
    raise TensorbendError(f"the test prompts make fewer than {tokens} tokens together")


def _check(cmd: list[str]) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise TensorbendError(f"{' '.join(cmd)} failed:\n{(p.stderr or p.stdout)[-3000:]}")


def main(argv=None) -> int:
    from tensorbend.memory import parse_bytes

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build")
    c = sub.add_parser("convert")
    c.add_argument("checkpoint", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--outtype", default=None, help="default: the checkpoint's precision")
    r = sub.add_parser("run")
    r.add_argument("gguf", type=Path)
    r.add_argument("--prompt", required=True, help="text, or @FILE")
    r.add_argument("--max-new-tokens", type=int, default=32)
    r.add_argument("--cap", default=None, help="memory cgroup limit, e.g. 1GB (needs root)")
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--no-mmap", action="store_true")
    r.add_argument("--warm", action="store_true", help="keep the GGUF's cached pages")
    m = sub.add_parser("measure", help="prefill (>= 512-token prompt) and decode, cold runs")
    m.add_argument("gguf", type=Path)
    m.add_argument("--prompt-tokens", type=int, default=512, help="at least this many")
    m.add_argument("--max-new-tokens", type=int, default=32)
    m.add_argument("--cap", default=None, help="memory cgroup limit, e.g. 1GB (needs root)")
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.cmd == "build":
        print(build().completion)
    elif args.cmd == "convert":
        print(convert(args.checkpoint, args.out, args.outtype))
    elif args.cmd == "measure":
        prompt = _long_prompt(args.gguf, args.prompt_tokens)
        cap = parse_bytes(args.cap) if args.cap else None
        result = {"command": ["python", "-m", "bench.llama_cpp", *(argv or sys.argv[1:])],
                  "gguf": str(args.gguf), "gguf_bytes": args.gguf.stat().st_size, "cap_bytes": cap,
                  "threads": args.threads, "cold": True, "mmap": True,
                  **measure(args.gguf, prompt, args.max_new_tokens, cap, args.threads)}  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    else:
        prompt = Path(args.prompt[1:]) if args.prompt.startswith("@") else args.prompt
        cap = parse_bytes(args.cap) if args.cap else None
        result = run(args.gguf, prompt, args.max_new_tokens, cap, args.threads,
                     not args.no_mmap, not args.warm)  # fmt: skip
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
