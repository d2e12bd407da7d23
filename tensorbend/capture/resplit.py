"""A trace's prompts split by domain: fit on some topics, measure on topics never seen.

Usage:
    tensorbend trace resplit runs/bench/default/trace --test-topics poetry,python \\
        --out runs/bench/default/trace_domain
    >>> info = resplit(src_dir, out_dir, test_topics=("poetry", "python"))   # doctest: +SKIP

The new trace directory holds the same shards and router weights (hard links where the file system allows,
copies otherwise; each is still checked against its size and sha256 on load) and a copy of
the manifest whose prompts are split again by topic:

  test    every prompt of a test topic, whatever its split was;
  train   the train prompts of the other topics (as before);
  val     the val prompts of the other topics (as before);
  unused  the other topics' former test prompts: in no split, so no command trains,
          early-stops or measures on them.

Every command that reads a trace's splits (`train`, `eval`, the foresight
bench) then fits on some domains and measures on others, unchanged. The manifest records
`resplit`: {"source": the source trace, "test_topics": [...], "splits": prompts per split}.
The source trace is not touched.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

from tensorbend.atomic import atomic_write_text
from tensorbend.capture.trace import MANIFEST, ROUTER_FILE, Trace
from tensorbend.errors import TraceError

UNUSED = "unused"  # the split of a prompt that no command reads


def resplit(src: str | Path, out: str | Path, test_topics: tuple[str, ...]) -> dict:
    """Write the re-split trace at `out` (module docstring); its `resplit` record."""
    src, out = Path(src), Path(out)
    trace = Trace.open(src)
    manifest = json.loads(json.dumps(trace.manifest))  # a deep copy
    if manifest.get("complete") is False:
        raise TraceError(
            f"trace {src}: collection has not finished (manifest complete=false); finish it "
            f"with `tensorbend collect --out {src}` (it resumes), then resplit"
        )
    topics = Counter(p.get("topic") for p in manifest["prompts"])
    wanted = tuple(dict.fromkeys(test_topics))
    missing = [t for t in wanted if t not in topics]
    if not wanted or missing:
        known = ", ".join(f"{t} ({n})" for t, n in sorted(topics.items(), key=str))
        raise TraceError(
            f"trace {src}: test topics {', '.join(missing) or '(none given)'} not found; "
            f"its prompts' topics are: {known}"
        )
    if len(wanted) == len(topics):
        raise TraceError(f"trace {src}: every topic is a test topic; leave some to train on")
    for p in manifest["prompts"]:
        if p.get("topic") in wanted:
            p["split"] = "test"
        elif p["split"] == "test":
            p["split"] = UNUSED
    if out.resolve() == src.resolve():
        raise TraceError(f"--out {out} is the source trace; name a new directory")
    if (out / MANIFEST).exists():
        raise TraceError(f"{out}: a trace is there already; remove it or name another --out")
    out.mkdir(parents=True, exist_ok=True)
    for sh in manifest["shards"]:
        _link_or_copy(src / sh["file"], out / sh["file"])
    if (src / ROUTER_FILE).is_file():  # the router weights (spec_gate, the d1 predictor read them)
        _link_or_copy(src / ROUTER_FILE, out / ROUTER_FILE)
    splits = Counter(p["split"] for p in manifest["prompts"])
    record = {
        "source": str(src),
        "test_topics": list(wanted),
        "splits": dict(sorted(splits.items())),
    }
    manifest["resplit"] = record
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))
    return record


def _link_or_copy(a: Path, b: Path) -> None:
    if b.exists():
        b.unlink()
    try:
        os.link(a, b)
    except OSError:
        shutil.copyfile(a, b)
