"""Replay speed per policy: layer-steps per second through the linear scan, the victim index
and the compiled replay.

Usage (what `bench/replay_speed.py` runs; docs/bench/replay_speed.md is its output):
    >>> r = measure(SpeedConfig(prompts=2, tokens=4, layers=3, experts=8, top_k=2,
    ...                         before_prompts=1, policies=("lru", "lfru")))
    >>> [row["policy"] for row in r["results"]], r["results"][0]["same_victims"]
    (['lru', 'lfru'], True)

A layer-step is one MoE layer of one forward: its K demands, the policy's predictions for it,
and the misses' placements (`cache.replay.replay`). The trace is `cache.replay.planted_trace`
at the given geometry. "before" replays the first `before_prompts` prompts through
`cache.resident.ResidentSet` (a rank per pool entry at each miss: the reference, and what
every replay did before the index); "after" replays the same prefix, then the whole trace,
through `cache.victim_heap.IndexedResidentSet`; the prefix's victims must be identical.
"compiled" replays the whole trace through `cache.compiled.run` (numba; the column is absent
without it), timed from the list trace to its placement arrays, after one warm-up call that
compiles the kernel (or loads it from numba's cache: `compile_s`); its placements must equal
the index's on the whole trace. Rates are wall-clock (`time.perf_counter`) and process CPU time (`time.process_time`), whose
ratio shows how much of the machine other work took while this ran.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass

from tensorbend.cache import compiled
from tensorbend.cache.replay import REPLAY_POLICIES, planted_trace, replay, replay_policy
from tensorbend.cache.resident import ResidentSet
from tensorbend.cache.victim_heap import IndexedResidentSet


@dataclass(frozen=True)
class SpeedConfig:
    prompts: int = 60  # prompts of `tokens` forwards each, one after another
    tokens: int = 64
    layers: int = 26  # MoE layers (L); an imported real trace's geometry
    experts: int = 64  # per layer (E)
    top_k: int = 6  # (K)
    reuse: float = 0.5  # planted_trace: chance to keep each of the last token's experts
    seed: int = 0
    cache_frac: float = 0.25  # slots = round(cache_frac * L * E), one global pool
    before_prompts: int = 6  # the prefix replayed by both (the scan is slow)
    policies: tuple[str, ...] = REPLAY_POLICIES

    def __post_init__(self):
        assert 1 <= self.before_prompts <= self.prompts, "before_prompts in 1..prompts"
        assert set(self.policies) <= set(REPLAY_POLICIES), self.policies


def measure(cfg: SpeedConfig, command: str = "") -> dict:
    """Every policy before and after (module docstring): a JSON-ready dict; `command` is
    what produced it (the doc names it)."""
    L, E = cfg.layers, cfg.experts
    ids_FLK = planted_trace(cfg.prompts, cfg.tokens, L, E, cfg.top_k, cfg.reuse, cfg.seed)
    prefix = ids_FLK[: cfg.before_prompts * cfg.tokens]
    slots = round(cfg.cache_frac * L * E)
    load = os.getloadavg()[0]
    compile_s = None
    if compiled.available():
        t0 = time.perf_counter()
        compiled.run(ids_FLK[:2], "reuse", 4, E)  # (compiles every function it calls)
        compile_s = round(time.perf_counter() - t0, 2)
    rows = []
    for name in cfg.policies:
        before = _timed(prefix, ResidentSet, name, slots, L, E)
        after_prefix = _timed(prefix, IndexedResidentSet, name, slots, L, E)
        after = _timed(ids_FLK, IndexedResidentSet, name, slots, L, E)
        policy, _ = replay_policy(name, prefix, L, E)
        fast = {} if compile_s is None else _timed_compiled(ids_FLK, name, slots, E, after)
        rows.append({
            "policy": name,
            "ranking": policy.ranking,
            "before_layer_steps_per_s": before["rate"],
            "after_prefix_layer_steps_per_s": after_prefix["rate"],
            "speedup": round(after_prefix["rate"] / before["rate"], 1),
            "after_layer_steps_per_s": after["rate"],
            "after_cpu_layer_steps_per_s": after["cpu_rate"],
            "before_cpu_layer_steps_per_s": before["cpu_rate"],
            "same_victims": before["victims"] == after_prefix["victims"],
            "misses": after["misses"],
            "evictions": after["evictions"],
            **fast,
        })  # fmt: skip
    return {
        "command": command,
        "config": asdict(cfg) | {"policies": list(cfg.policies)},
        "layer_steps": len(ids_FLK) * L,
        "before_layer_steps": len(prefix) * L,
        "cache_slots": slots,
        "pool": "global",
        "admission": "all",
        "compile_s": compile_s,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_1min_at_start": round(load, 2),
            "load_avg_1min_at_end": round(os.getloadavg()[0], 2),
        },
        "results": rows,
    }


def _sharing(r: dict) -> str:
    """Whether the run had a core to itself, from its own rates (wall clock against CPU time)
    rather than the 1-minute load average, which lags behind work that just ended."""
    m = r["machine"]
    own = min(x["after_layer_steps_per_s"] / x["after_cpu_layer_steps_per_s"]
              for x in r["results"])  # fmt: skip
    loads = (f"1-minute load average {m['load_avg_1min_at_start']} at the start, "
             f"{m['load_avg_1min_at_end']} at the end")  # fmt: skip
    if own >= 0.95:
        return (f"The process had a core to itself: every wall-clock rate is within 5% of its "
                f"CPU-time rate ({loads}).")  # fmt: skip
    return (f"Measured while other work shared the machine (wall-clock rates down to "
            f"{own:.0%} of the CPU-time rates; {loads}): an idle machine replays faster.")  # fmt: skip


def markdown(r: dict) -> str:
    """docs/bench/replay_speed.md from `measure`'s dict."""
    c, m = r["config"], r["machine"]
    fast = r.get("compile_s") is not None
    lines = [
        "# Replay speed per policy",
        "",
        f"Generated by `{r['command']}`. A planted trace of {c['prompts']} prompts x {c['tokens']} "
        f"tokens at {c['layers']} MoE layers, {c['experts']} experts, top-{c['top_k']} "
        f"({r['layer_steps']:,} layer-steps), one global pool of {r['cache_slots']} slots "
        f"({c['cache_frac']:.0%}), admission of every miss; what each policy is fed: "
        "`tensorbend/cache/replay.py`. Before = `ResidentSet` (a rank per entry at each miss) "
        f"on the first {c['before_prompts']} prompts ({r['before_layer_steps']:,} layer-steps); "
        "after = `IndexedResidentSet` on the same prefix (victims compared) and on the whole "
        "trace. Layer-steps per second, wall clock; CPU = per second of this process's CPU "
        f"time. Machine: {m['cpus']} CPUs, Python {m['python']}. " + _sharing(r),
        "",
    ]
    if fast:
        slowest = min(r["results"], key=lambda x: x["compiled_layer_steps_per_s"])
        lines += [
            "Compiled = `cache/compiled.py` (numba) on the whole trace, timed from the list "
            "trace to its placement arrays (preparation included), after a warm-up call "
            f"that compiled the kernel or loaded it from numba's cache ({r['compile_s']} s); "
            "same placements = every placement of the whole trace equals the index's. "
            f"Slowest policy compiled: {slowest['policy']}, "
            f"{slowest['compiled_layer_steps_per_s']:,.0f} layer-steps per second.",
            "",
        ]
    head = ("| policy | index | before | after (prefix) | speedup | after (whole trace) | "
            "after, CPU | same victims |")  # fmt: skip
    lines += [head + (" compiled | compiled, CPU | vs index | same placements |" if fast else ""),
              "|---|---|---|---|---|---|---|---|" + ("---|---|---|---|" if fast else "")]  # fmt: skip
    for x in r["results"]:
        row = (
            f"| {x['policy']} | {x['ranking']} | {x['before_layer_steps_per_s']:,.0f} | "
            f"{x['after_prefix_layer_steps_per_s']:,.0f} | {x['speedup']}x | "
            f"{x['after_layer_steps_per_s']:,.0f} | {x['after_cpu_layer_steps_per_s']:,.0f} | "
            f"{'yes' if x['same_victims'] else 'NO'} |"
        )
        if fast:
            row += (f" {x['compiled_layer_steps_per_s']:,.0f} | "
                    f"{x['compiled_cpu_layer_steps_per_s']:,.0f} | {x['compiled_speedup']}x | "
                    f"{'yes' if x['compiled_same_victims'] else 'NO'} |")  # fmt: skip
        lines.append(row)
    return "\n".join(lines) + "\n"


def _timed_compiled(ids_FLK: list, name: str, slots: int, E: int, after: dict) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    out = compiled.run(ids_FLK, name, slots, E)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = len(ids_FLK) * len(ids_FLK[0])
    return {
        "compiled_layer_steps_per_s": round(steps / wall),
        "compiled_cpu_layer_steps_per_s": round(steps / max(cpu, 1e-9)),
        "compiled_speedup": round(steps / wall / after["rate"], 1),
        "compiled_same_victims": out.replayed().victims == after["victims"],
    }


def _timed(ids_FLK: list, cls, name: str, slots: int, L: int, E: int) -> dict:
    policy, feed = replay_policy(name, ids_FLK, L, E)
    rs = cls(slots, L, policy)
    t0, c0 = time.perf_counter(), time.process_time()
    out = replay(ids_FLK, rs, feed)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = len(ids_FLK) * L
    return {
        "rate": round(steps / wall),
        "cpu_rate": round(steps / max(cpu, 1e-9)),
        "victims": out.victims,
        "misses": out.misses,
        "evictions": rs.evictions,
    }
