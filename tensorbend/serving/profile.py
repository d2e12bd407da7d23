"""`tensorbend generate --profile`: where decode's time went, and each MoE layer's cache.

Usage:
    print(profile(model.tensorbend.counters()))     # after generating

Decode's wall seconds split four ways, per decode token: the experts' math (weights in their
slots; `layer.ExpertCompute`, calls of one token), waiting for expert loads (the compute
thread blocked: `stall`), prediction (the hooks' scoring and queueing), and the rest
(attention, routers, sampling, the interpreter). Then per MoE layer, over the whole run
(prefill and decode): demand hits, late hits (the expert was still loading), misses and the
bytes read.
"""

from __future__ import annotations


def profile(c: dict) -> str:
    dec = c["decode"]
    n, wall = dec["tokens"], dec["seconds"]
    lines = []
    if n:
        math = sum(row[4] for row in c["expert_compute"] if row[0] == 1)  # (one-token calls)
        parts = {
            "expert math": math,
            "waiting for expert loads": dec["stall_s_per_token"] * n,
            "prediction": c["decode_predict_s"],
        }
        parts["the rest (attention, routers, sampling, Python)"] = max(
            0.0, wall - sum(parts.values())
        )
        lines.append(f"[tensorbend] decode: {n} tokens in {wall:.2f} s; per token:")
        for what, s in parts.items():
            lines.append(f"  {s / n * 1e3:8.2f} ms  {s / wall if wall else 0:5.1%}  {what}")
    lines.append("[tensorbend] per MoE layer (prefill and decode): hits, late, misses, MB read")
    for row in c["per_layer"]:
        lines.append(
            f"  layer {row['layer']:3d}  {row['hits']:6d}  {row['late']:5d}  {row['misses']:6d}"
            f"  {row['bytes_read'] / 1e6:9.1f}"
        )
    return "\n".join(lines)
