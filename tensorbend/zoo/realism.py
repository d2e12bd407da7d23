"""How realistic is a model's routing? The statistics that separate a small benchmark model from
a real MoE, computed from a trace, beside reference figures of a real model.

Usage:
    >>> import numpy as np
    >>> used = [np.array([[[0, 1]], [[0, 2]], [[3, 1]]])]   # 1 request, 3 tokens, L=1, K=2
    >>> recurrence(used, num_experts=4, windows=(1, 2))  # j=1: 1 of 4 uses (t=0,1); j=2: 2 of 2
    {1: 0.25, 2: 1.0}

    stats = routing_card(Trace.open("runs/bench/default/trace"))
    print(format_card({"zoo:default": stats}))

Shape legend: T tokens of a request (in order), L MoE layers, K top-k, E experts, V vocabulary.

Statistics (held-out = the trace's test prompts, decode rows in order, one stream per request;
fit = its train prompts, every row):
- `token_table_recall`: P(expert | token id, layer) counted on fit rows; its top-K scored against
  each held-out row's routing (recall@K), mean over layers (`..._by_layer` too). A token never
  seen in fit falls back to the layer's expert frequency. Routing-only traces (no token ids):
  null.
- `token_table_by_fit_count`: the same recall split by how often the held-out row's token occurs
  in fit (buckets of FIT_COUNT_BUCKETS): {bucket: {"share": of held-out rows, "recall": mean over
  layers}}. Separates a table that could not be estimated (rare tokens) from routing that is not
  a function of the token: a token seen once that already predicts its routing means the model
  routes by the token.
- `token_table_fit_fraction`: the recall with the table fit on a seeded sample of that share of
  the fit prompts ({share: recall}; 1.0 is `token_table_recall`): how much the figure depends on
  the amount of fit text (a real model's larger vocabulary spreads the same text thinner).
- `recurrence[j]`: share of (token, layer, expert) uses that the same layer uses again within
  the next j tokens of the same request (tokens with fewer than j followers are not counted).
- `routing_foresight_gap[h]`: Belady knowing the exact routing of only the current and the next
  h tokens (`NextUse` foresight h + 1: unseen experts ranked by recency, i.e. LRU beyond its
  sight), as the share of
  the LRU -> full-Belady miss gap it closes; one cache per MoE layer at `cache_frac` of its
  experts, held-out decode rows of all requests as one stream.
- `token_foresight_gap[h]`: the same with the future *routing* replaced by the token table's
  top-K for the exact future *token ids* (what a draft model could tell), one global cache.
Belady here is event-atomic per layer step: the experts of the step are pinned while placed.
"""

from __future__ import annotations

import numpy as np

from tensorbend.cache.replay import replay_named
from tensorbend.errors import TraceError

WINDOWS = (1, 2, 4, 8)
ROUTING_H = (1, 2, 4)
TOKEN_H = (1, 2, 4, 8)
FIT_COUNT_BUCKETS = ((0, 0), (1, 4), (5, 19), (20, 99), (100, None))
FIT_FRACTIONS = (0.1, 0.25, 0.5, 1.0)

REFERENCE = {
    "model": "DeepSeek-V2-Lite (public routing traces, 300 prompts; 26 MoE layers, 64 experts, "
    "top-6; measured by the project, not recomputed here)",
    "token_table_recall": 0.375,
    "token_table_recall_first3": [0.50, 0.39, 0.48],
    "recurrence": {1: 0.27, 2: 0.37, 4: 0.51, 8: 0.64},
    "routing_foresight_gap": {1: 0.25, 2: 0.45, 4: 0.75},
    "token_foresight_gap": {1: 0.0, 2: 0.09, 4: 0.16, 8: 0.19},
}
"""A real MoE's figures, the target a realistic benchmark model should come within ±0.08 of
(foresight curves within ±10 points)."""


def routing_card(trace, cache_frac: float = 0.25, max_requests: int | None = None) -> dict:
    """Every statistic of the module docstring for one trace (`trace.Trace`)."""
    spec = trace.spec
    L, K, E = spec.num_moe_layers, spec.top_k, spec.num_experts
    test = trace.load(("ids",), split="test", phase="decode")
    requests = _requests(test, max_requests)
    if not requests:
        raise TraceError(
            f"{trace.root}: expected held-out (test split) decode rows, found none; collect "
            f"with --decode teacher (or greedy) over prompts that include test ones"
        )
    tokens = [t for t, _ in requests]
    used = [u for _, u in requests]
    table = None
    if "token_ids_T" in test and int(test["token_ids_T"].max()) >= 0:
        fit = trace.load(("ids",), split="train")
        table = token_table(fit["token_ids_T"].numpy(), fit["expert_ids_TLK"].numpy(), E)
    out = {
        "requests": len(used),
        "tokens": int(sum(len(u) for u in used)),
        "num_moe_layers": L,
        "num_experts": E,
        "top_k": K,
        "cache_frac": cache_frac,
        "recurrence": recurrence(used, E),
    }
    if table is not None:
        by_layer = table_recall(table, np.concatenate(tokens), np.concatenate(used), K)
        out["token_table_recall"] = float(np.mean(by_layer))
        out["token_table_recall_by_layer"] = [round(float(x), 4) for x in by_layer]
        fit_tokens = fit["token_ids_T"].numpy().astype(np.int64)
        fit_ids = fit["expert_ids_TLK"].numpy().astype(np.int64)
        held_tokens, held_ids = np.concatenate(tokens), np.concatenate(used)
        out["token_table_by_fit_count"] = recall_by_fit_count(
            table, np.bincount(fit_tokens), held_tokens, held_ids, K
        )
        out["token_table_fit_fraction"] = recall_by_fit_fraction(
            fit_tokens, fit_ids, fit["prompt_index_T"].numpy(), held_tokens, held_ids, E, K
        )
    else:
        for key in (
            "token_table_recall",
            "token_table_recall_by_layer",
            "token_table_by_fit_count",
            "token_table_fit_fraction",
        ):
            out[key] = None
    ids_FLK = [[sorted(map(int, u_LK[m])) for m in range(L)] for u in used for u_LK in u]
    out["routing_foresight_gap"] = foresight_gaps(
        ids_FLK, ids_FLK, L, E, cache_frac, "per_layer", ROUTING_H
    )
    if table is not None:
        guess = np.argsort(-table, axis=-1, kind="stable")[..., :K]  # [V, L, K]
        pred_FLK = [
            [sorted(map(int, guess[t, m])) for m in range(L)] for t in np.concatenate(tokens)
        ]
        out["token_foresight_gap"] = foresight_gaps(
            ids_FLK, pred_FLK, L, E, cache_frac, "global", TOKEN_H
        )
    else:
        out["token_foresight_gap"] = None
    return out


def token_table(token_ids_T: np.ndarray, ids_TLK: np.ndarray, num_experts: int) -> np.ndarray:
    """P(expert | token, layer) as counts [V, L, E] (+ the layer frequency / 1e6 as a fallback
    and tie-break, so unseen tokens rank by frequency)."""
    V = int(token_ids_T.max()) + 1
    T, L, K = ids_TLK.shape
    counts = np.zeros((V, L, num_experts), dtype=np.float64)
    t_idx = np.repeat(token_ids_T, L * K)
    l_idx = np.tile(np.repeat(np.arange(L), K), T)
    np.add.at(counts, (t_idx, l_idx, ids_TLK.reshape(-1)), 1.0)
    freq_LE = counts.sum(axis=0)
    return counts + freq_LE[None] / (freq_LE.sum(axis=-1, keepdims=True) * 1e6)


def table_recall(table_VLE, token_ids_T, ids_TLK, K: int) -> np.ndarray:
    """recall@K per layer [L] of the table's top-K for each row's token."""
    T, L, _ = ids_TLK.shape
    tok = np.minimum(token_ids_T, table_VLE.shape[0] - 1)
    unseen = token_ids_T >= table_VLE.shape[0]
    scores = table_VLE[tok]  # [T, L, E]
    scores[unseen] = table_VLE.sum(axis=0)[None].repeat(int(unseen.sum()), axis=0)
    top_TLK = np.argsort(-scores, axis=-1, kind="stable")[..., :K]
    hits = (top_TLK[..., :, None] == ids_TLK[..., None, :]).any(-1).sum(-1)  # [T, L]
    return hits.mean(axis=0) / K


def recall_by_fit_count(table_VLE, fit_count_V, token_ids_T, ids_TLK, K: int) -> dict:
    """{bucket label: {"share": of rows, "recall": mean over layers}} by the row token's count in
    fit (FIT_COUNT_BUCKETS; a bucket without rows has recall None)."""
    count_T = np.zeros(len(token_ids_T), dtype=np.int64)
    seen = token_ids_T < len(fit_count_V)
    count_T[seen] = fit_count_V[token_ids_T[seen]]
    out = {}
    for lo, hi in FIT_COUNT_BUCKETS:
        label = _bucket(lo, hi)
        sel = (count_T >= lo) & ((count_T <= hi) if hi is not None else True)
        recall = table_recall(table_VLE, token_ids_T[sel], ids_TLK[sel], K) if sel.any() else None
        out[label] = {
            "share": round(float(sel.mean()), 4),
            "recall": None if recall is None else round(float(recall.mean()), 4),
        }
    return out


def recall_by_fit_fraction(
    fit_tokens_T,
    fit_ids_TLK,
    fit_prompt_T,
    token_ids_T,
    ids_TLK,
    E: int,
    K: int,
    fractions=FIT_FRACTIONS,
    seed: int = 0,
) -> dict:
    """{share: recall (mean over layers)} of the table fit on a seeded sample of that share of
    the fit prompts (at least one prompt)."""
    prompts = np.unique(fit_prompt_T)
    rng = np.random.default_rng(seed)
    out = {}
    for frac in fractions:
        n = max(1, round(frac * len(prompts)))
        keep = np.isin(fit_prompt_T, rng.choice(prompts, n, replace=False))
        table = token_table(fit_tokens_T[keep], fit_ids_TLK[keep], E)
        out[frac] = round(float(table_recall(table, token_ids_T, ids_TLK, K).mean()), 4)
    return out


def recurrence(used: list, num_experts: int, windows=WINDOWS) -> dict:
    """Share of uses the same layer uses again within j tokens (module docstring)."""
    out = {}
    for j in windows:
        again = total = 0
        for ids_TLK in used:
            T = ids_TLK.shape[0]
            if T <= j:
                continue
            hot_TLE = np.zeros((T, ids_TLK.shape[1], num_experts), dtype=bool)
            np.put_along_axis(hot_TLE, ids_TLK, True, axis=-1)
            later = np.zeros_like(hot_TLE[: T - j])
            for d in range(1, j + 1):
                later |= hot_TLE[d : T - j + d]
            again += int((hot_TLE[: T - j] & later).sum())
            total += int(hot_TLE[: T - j].sum())
        out[j] = again / total if total else None
    return out


def foresight_gaps(ids_FLK, seen_FLK, L, E, cache_frac, pool, hs) -> dict:
    """{h: share of the LRU -> Belady miss gap closed by Belady seeing `seen_FLK` for the
    current and the next h forwards}; demands are always `ids_FLK` (THE replay,
    cache/replay.py)."""
    slots = max(round(cache_frac * E) * L if pool == "per_layer" else round(cache_frac * L * E), L)

    def misses(name: str, seen_FLK) -> int:
        return replay_named(ids_FLK, name, slots, E, pool, seen_FLK).misses

    lru = misses("lru", ids_FLK)
    full = misses("belady", ids_FLK)
    gap = lru - full
    return {h: (lru - misses(f"belady/h={h + 1}", seen_FLK)) / gap if gap else None for h in hs}


def format_card(cards: dict[str, dict], reference: dict = REFERENCE) -> str:
    """A markdown table: one column per model, the reference beside."""
    names = list(cards)

    def cell(v) -> str:
        return _cell(v) if v is None or isinstance(v, float) else str(v)

    def row(label, get) -> str:
        vals = [cell(get(c)) for c in cards.values()]
        return f"| {label} | {cell(get(reference))} | " + " | ".join(vals) + " |"

    lines = [
        "| statistic | real ("
        + reference["model"].split(" (")[0]
        + ") | "
        + " | ".join(names)
        + " |",
        "|---|---|" + "---|" * len(names),
        row(
            "token-id table -> same forward's routing, recall@k (mean over layers)",
            lambda c: c.get("token_table_recall"),
        ),
    ]
    for j in WINDOWS:
        lines.append(
            row(
                f"recurrence in the same layer within {j} token(s)",
                lambda c, j=j: _at(c.get("recurrence"), j),
            )
        )
    for h in ROUTING_H:
        lines.append(
            row(
                f"exact routing of {h} token(s) as eviction foresight: share of the "
                f"LRU->Belady gap (per-layer caches)",
                lambda c, h=h: _at(c.get("routing_foresight_gap"), h),
            )
        )
    for h in TOKEN_H:
        lines.append(
            row(
                f"exact future token ids (token table) as foresight, h = {h} (one global cache)",
                lambda c, h=h: _at(c.get("token_foresight_gap"), h),
            )
        )
    return "\n".join(lines) + "\n"


def format_fit_detail(cards: dict[str, dict]) -> str:
    """A markdown table of the token table's recall by fit count and by fit share, one column per
    model (traces without token ids: "-")."""
    names = list(cards)
    lines = ["| token table recall@k | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for lo, hi in FIT_COUNT_BUCKETS:
        label = _bucket(lo, hi)
        cells = []
        for c in cards.values():
            b = (c.get("token_table_by_fit_count") or {}).get(label)
            cells.append(
                "-"
                if b is None or b["recall"] is None
                else f"{b['recall']:.3f} ({100 * b['share']:.1f}% of rows)"
            )
        lines.append(f"| held-out token seen {label} time(s) in fit | " + " | ".join(cells) + " |")
    for frac in FIT_FRACTIONS:
        cells = [_cell(_at(c.get("token_table_fit_fraction"), frac)) for c in cards.values()]
        lines.append(
            f"| table fit on {100 * frac:g}% of the fit prompts | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------ helpers


def _bucket(lo: int, hi: int | None) -> str:
    """A fit-count bucket's label: "0", "1-4", "100+"."""
    return f"{lo}" if lo == hi else f"{lo}+" if hi is None else f"{lo}-{hi}"


def _cell(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _at(d, k):
    if d is None:
        return None
    return d.get(k, d.get(str(k)))


def _requests(rows: dict, max_requests: int | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(token_ids_T, ids_TLK)] per prompt, rows in order."""
    p = rows["prompt_index_T"].numpy()
    ids = rows["expert_ids_TLK"].numpy().astype(np.int64)
    tok = rows["token_ids_T"].numpy().astype(np.int64)
    out = []
    for q in dict.fromkeys(p.tolist()):
        sel = p == q
        out.append((tok[sel], ids[sel]))
    return out[:max_requests]
