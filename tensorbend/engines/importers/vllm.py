"""vLLM's per-request routed experts (`--enable-return-routed-experts`) -> imported prompts.

Usage:
    import_trace(ImportConfig(source="vllm", path=Path("responses.jsonl"), out=Path("runs/t")))

What vLLM emits (read from vLLM 0.33.0: vllm/outputs.py `CompletionOutput.routed_experts`,
vllm/entrypoints/openai/completion/protocol.py and chat_completion/protocol.py `routed_experts`,
vllm/utils/serial_utils.py `numpy2base64`, vllm/distributed/aux_output_connector/connector.py,
vllm/model_executor/layers/fused_moe/routed_experts_capturer.py):
  - per request and choice, an array [rows, num_hidden_layers, top_k] (uint8 when experts <= 256,
    else uint16) of logical expert ids; the layer axis counts every decoder layer, and dense
    layers are never written (their rows stay 0);
  - rows = prompt tokens + generated tokens - 1 (the last sampled token never ran a forward),
    minus the `routed_experts_prompt_start` prompt tokens the request asked to skip;
  - the OpenAI server returns it base64-encoded as `.npy` bytes in `choices[i].routed_experts`.
Accepted files:
  - `.json` (one response object, or a list of them) and `.jsonl` (one response per line), as the
    completions / chat completions server returns them; the prompt length comes from
    `usage.prompt_tokens` (or `prompt_token_ids`), the generated tokens from `choices[i].token_ids`
    (with `return_token_ids`) or, for one choice, `usage.completion_tokens`;
  - `.npz` from the offline API, one request per file:
    `np.savez(f, routed_experts=out.outputs[0].routed_experts, prompt_token_ids=out.prompt_token_ids,
    token_ids=out.outputs[0].token_ids)` (`num_prompt_tokens=n` may replace prompt_token_ids).
Rows at positions below the prompt length are prefill, the rest decode.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tensorbend.engines.importers.reader import ImportedPrompt, iter_files
from tensorbend.engines.importers.source import ImportConfig
from tensorbend.errors import TraceError

SUFFIXES = (".json", ".jsonl", ".npz")


def source_files(path: Path) -> list[Path]:
    return iter_files(path, SUFFIXES, "vLLM responses with routed_experts (docs/guide/import.md)")


def read_prompts(
    files: list[Path], cfg: ImportConfig, notes: list[str]
) -> Iterator[ImportedPrompt]:
    layers = _Layers(cfg, notes)
    for path in files:
        for pid, rx, n_prompt, n_gen, tokens, where in _requests(path):
            yield _prompt(pid, rx, n_prompt, n_gen, tokens, where, layers)


# ---------------------------------------------------------------- helpers


class _Layers:
    """Which decoder layers are MoE: stated, or those the engine wrote in the first request."""

    def __init__(self, cfg: ImportConfig, notes: list[str]):
        self.ids = list(cfg.moe_layer_ids) if cfg.moe_layer_ids else None
        self.notes = notes

    def select(self, rx_RAK: np.ndarray, where: str) -> np.ndarray:
        written = ~(rx_RAK == 0).all(axis=(0, 2))  # dense layers are never written: all 0
        if self.ids is None:
            if rx_RAK.shape[2] == 1:
                raise TraceError(
                    f"{where}: a top-1 model's dense layers cannot be told from expert 0: state "
                    "--moe-layer-ids"
                )
            self.ids = np.flatnonzero(written).tolist()
            dense = [i for i in range(rx_RAK.shape[1]) if i not in self.ids]
            self.notes.append(
                f"vllm: {rx_RAK.shape[1]} decoder layers, {len(self.ids)} MoE; layers {dense} "
                "were never written (dense) and are dropped"
            )
        if max(self.ids, default=-1) >= rx_RAK.shape[1]:
            raise TraceError(
                f"{where}: routed_experts has {rx_RAK.shape[1]} layers, --moe-layer-ids names "
                f"{max(self.ids)}"
            )
        stray = [i for i in np.flatnonzero(written).tolist() if i not in self.ids]
        if stray:
            raise TraceError(
                f"{where}: layers {stray} hold routing but are not among the MoE layers "
                f"{self.ids[:6]}...; state --moe-layer-ids"
            )
        return rx_RAK[:, self.ids]


def _prompt(pid, rx, n_prompt, n_gen, tokens, where, layers: _Layers) -> ImportedPrompt:
    if rx.ndim != 3:
        raise TraceError(
            f"{where}: routed_experts has shape {list(rx.shape)}, expected [tokens, layers, top_k]"
        )
    R = rx.shape[0]
    start = 0 if n_gen is None else n_prompt + n_gen - 1 - R  # routed_experts_prompt_start
    if start < 0:
        raise TraceError(
            f"{where}: {R} routing rows for {n_prompt} prompt + {n_gen} generated tokens, expected "
            f"at most {n_prompt + n_gen - 1}"
        )
    pos = np.arange(start, start + R)
    tok = np.full(R, -1, dtype=np.int64)
    if tokens is not None:
        ok = pos < len(tokens)
        tok[ok] = np.asarray(tokens, dtype=np.int64)[pos[ok]]
    return ImportedPrompt(
        id=pid,
        expert_ids_TLK=layers.select(rx.astype(np.int64), where),
        positions_T=pos,
        phase_T=(pos >= n_prompt).astype(np.int64),
        token_ids_T=tok,
        where=where,
        layer_ids=tuple(layers.ids),
    )


def _requests(path: Path):
    """(prompt id, routed experts [R, A, K], prompt tokens, generated tokens | None, token ids |
    None, where) per request and choice in one file."""
    if path.name.endswith(".npz"):
        yield _npz(path)
        return
    with open(path, encoding="utf-8") as f:
        if path.name.endswith(".jsonl"):
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    yield from _response(
                        _json(line, f"{path}, line {lineno}"), f"{path}, line {lineno}"
                    )
        else:
            obj = _json(f.read(), str(path))
            for i, resp in enumerate(obj if isinstance(obj, list) else [obj]):
                yield from _response(resp, f"{path}, response {i}")


def _response(resp, where: str):
    if not isinstance(resp, dict) or not isinstance(resp.get("choices"), list):
        raise TraceError(
            f"{where}: expected a completion response with `choices`, found {str(resp)[:80]}"
        )
    usage = resp.get("usage") or {}
    prompt_ids = resp.get("prompt_token_ids")
    n_prompt = usage.get("prompt_tokens", len(prompt_ids) if prompt_ids else None)
    if n_prompt is None:
        raise TraceError(
            f"{where}: no usage.prompt_tokens or prompt_token_ids: the prompt length is unknown"
        )
    choices = resp["choices"]
    for c in choices:
        s = c.get("routed_experts")
        if s is None:
            raise TraceError(
                f"{where}: choice {c.get('index')} has no routed_experts; start vLLM with "
                "--enable-return-routed-experts"
            )
        gen = c.get("token_ids")
        n_gen = (
            len(gen)
            if gen is not None
            else (usage.get("completion_tokens") if len(choices) == 1 else None)
        )
        tokens = (
            list(prompt_ids) + list(gen) if prompt_ids is not None and gen is not None else None
        )
        pid = str(resp.get("id", where)) + (f"#{c.get('index', 0)}" if len(choices) > 1 else "")
        yield pid, _decode(s, where), int(n_prompt), n_gen, tokens, where


def _npz(path: Path):
    where = str(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise TraceError(f"{path}: not a readable .npz ({e})") from e
    if "routed_experts" not in data:
        raise TraceError(f"{path}: no `routed_experts` array (found {sorted(data)})")
    prompt_ids = data.get("prompt_token_ids")
    if prompt_ids is None and "num_prompt_tokens" not in data:
        raise TraceError(
            f"{path}: needs `prompt_token_ids` or `num_prompt_tokens` to split prefill from decode"
        )
    n_prompt = int(data["num_prompt_tokens"]) if prompt_ids is None else len(prompt_ids)
    gen = data.get("token_ids")
    tokens = None if prompt_ids is None or gen is None else [*prompt_ids.tolist(), *gen.tolist()]
    rid = str(data["request_id"]) if "request_id" in data else path.stem
    return rid, data["routed_experts"], n_prompt, None if gen is None else len(gen), tokens, where


def _decode(s: str, where: str) -> np.ndarray:
    try:
        return np.load(io.BytesIO(base64.b64decode(s, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError) as e:
        raise TraceError(f"{where}: routed_experts is not base64 .npy data ({e})") from e


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg} at line {e.lineno})") from e
