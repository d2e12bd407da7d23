"""Capture routing inside vLLM: the engine behind `tensorbend collect --engine vllm`.

Usage (in vLLM's own environment, made by `make vllm-env`):
    .venv-vllm/bin/tensorbend collect --engine vllm --model zoo:qwen3moe-tiny --out runs/vt

    engine = VllmEngine("zoo:qwen3moe-tiny", "float32", DecodeConfig(max_new_tokens=4))
    with RoutingCapture(engine.model, engine.spec, hooks=engine.hooks) as cap:
        record, rows = engine.run_prompt(cap, Prompt("p", "In the beginning"), 0)
    rows["expert_ids_TLK"].shape          # [T, L, K], T = prompt + 4 decode tokens

(not a doctest: the package's doctests run where vLLM is absent; tests/test_vllm.py runs it.)

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so hooks are plain Python on
the model `LLM.apply_model` hands back. Expert ids and weights are the ones vLLM's experts
execute: every MoE layer's router object (`mlp.experts.router`, a vLLM FusedMoERouter) has its
`select_experts` wrapped, whose (hidden_states [T, D], router_logits [T, E]) inputs are the
router input and logits and whose (topk_weights, topk_ids) [T, K] outputs are the selection
(logical ids, before any expert-parallel load-balancing map). `layer_input` is the residual
stream entering each MoE decoder layer, hidden_states + residual (vLLM carries them apart).

Prompts run one at a time with prefix caching off, so every forward holds exactly that
prompt's new tokens: the prefill, then one row per decode step. Teacher forcing runs prompt +
continuation as one prefill (vLLM cannot feed chosen decode tokens); causal attention makes
those rows the decode rows of step-by-step forcing, and they are tagged decode by position.
Greedy and sampled decoding generate with vLLM (sampling with vLLM's own seeded RNG).

DeepSeek MLA models (zoo:dsv3-vllm) need one fix on vLLM 0.32's CPU build: its in-place
rotary op, handed the query's rotary slice as a strided [T, H, R] view, rotates query row
(t, h) by position t*H + h instead of t (measured: the attention output 1.3% off on a random
checkpoint, routing 38% equal to transformers' on the trained one). `flat_mla_rope` hands it
contiguous [T, H*R] copies instead; attention then equals transformers' to 5e-8. On CPU the
engine asks for vLLM's reference MLA backend (CPU_MLA), the one these numbers were measured
with: on a CPU with AMX tiles vLLM would otherwise pick AMX_MLA, which refuses fp32 weights
("expect weight to be bfloat16, float16, int8 ...") and was never checked against
transformers here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tensorbend.capture.hf import DecodeConfig, encode_prompt, load_tokenizer
from tensorbend.errors import TensorbendError
from tensorbend.models import (
    RouterCall,
    RoutingSpec,
    decoder_layers,
    describe_model,
    max_positions,
    router_module,
)
from tensorbend.zoo import resolve_model

NEEDS_VLLM = "{verb} needs vLLM: run `make vllm-env` and use .venv-vllm/bin/tensorbend"


def _check_positions(path: Path, max_len: int, decode: DecodeConfig) -> None:
    """Refuse, before vLLM loads, a prompt + new-token window past the model's positions."""
    limit = max_positions(path)
    if limit and max_len > limit:
        raise TensorbendError(
            f"--max-prompt-tokens {decode.max_prompt_tokens} + --max-new-tokens "
            f"{decode.max_new_tokens} + 1: expected at most {limit} positions (the model's "
            "max_position_embeddings); lower --max-prompt-tokens or --max-new-tokens"
        )


class VllmEngine:
    """A model loaded by vLLM offline inference, with what `collect` needs: `.model` (the HF
    model's routers, see routers_only, for router_params and model_fingerprint), `.spec` (its
    RoutingSpec),
    `.tokenizer` (the checkpoint's HF tokenizer), `.hooks` and `.run_prompt`."""

    def __init__(
        self,
        model: str,
        dtype: str,
        decode: DecodeConfig,
        kv_cache_gb: int = 1,
        verb: str = "collect --engine vllm",
    ):
        path = resolve_model(model)
        max_len = decode.max_prompt_tokens + decode.max_new_tokens + 1
        _check_positions(path, max_len, decode)  # (vLLM's own error is a pydantic traceback)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process: hooks
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # (stdout: our tables)
        try:
            from vllm import LLM
        except ImportError as e:
            raise TensorbendError(f"{NEEDS_VLLM.format(verb=verb)} ({e})") from None
        self.decode = decode
        self.tokenizer = load_tokenizer(path)
        self.llm = LLM(
            model=str(path),
            dtype=dtype,
            enforce_eager=True,
            max_model_len=max_len,
            max_num_batched_tokens=max(max_len, 2048),
            enable_prefix_caching=False,  # every forward must hold all of a prompt's tokens
            seed=decode.seed,
            **_attention_backend(path),
        )
        models = self.llm.apply_model(lambda m: m)
        assert len(models) == 1 and isinstance(models[0], torch.nn.Module), "model not in-process"
        self.vllm_model = models[0]
        flat_mla_rope(self.vllm_model)
        self.model = routers_only(path)
        self.spec = describe_model(self.model)

    def hooks(self, model, spec: RoutingSpec, on_route=None, on_layer_input=None):
        """RouterHooks' contract on vLLM's model (capture.RoutingCapture's `hooks`); `model` is
        the routers-only view: the hooks go on vLLM's model."""
        return VllmRouterHooks(self.vllm_model, spec, on_route, on_layer_input)

    def run_prompt(self, cap, prompt, index: int):
        """Run one prompt in vLLM; returns (manifest record, rows) as collect._run_prompt."""
        from vllm import SamplingParams

        from tensorbend.capture.collect import prompt_rows

        dc = self.decode
        inp = encode_prompt(self.tokenizer, prompt, dc)
        prompt_ids = inp.ids_1S[0].tolist()
        cap.pop()  # drop anything left from an earlier exception
        if inp.forced is not None:  # teacher forcing: prompt + continuation, one prefill
            params = SamplingParams(max_tokens=1, temperature=0.0)
            self.llm.generate({"prompt_token_ids": prompt_ids + inp.forced}, params, use_tqdm=False)
            return prompt_rows(prompt, [_popped(cap)], prompt_ids, list(inp.forced))
        # The last generated token is never fed back (HF's loop feeds max_new_tokens tokens
        # with max_new_tokens + 1 forwards): ask for one more and drop it.
        params = SamplingParams(
            max_tokens=dc.max_new_tokens + 1,
            temperature=0.0 if dc.decode == "greedy" else dc.temperature,
            seed=None if dc.decode == "greedy" else dc.seed + index,
        )
        out = self.llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)
        fed = list(out[0].outputs[0].token_ids)[:-1]
        return prompt_rows(prompt, [_popped(cap)], prompt_ids, fed)


class VllmRouterHooks:
    """models.RouterHooks for a vLLM model: on_route(RouterCall) from each MoE layer's
    `select_experts`; on_layer_input(m, residual stream [T, D]) before its decoder layer.
    Restores the routers and removes the hooks on exit, also after an exception."""

    def __init__(self, model, spec: RoutingSpec, on_route=None, on_layer_input=None):
        self.model, self.spec = model, spec
        self.on_route, self.on_layer_input = on_route, on_layer_input
        self._routers: list = []
        self._handles: list = []

    def __enter__(self) -> VllmRouterHooks:
        layers = decoder_layers(self.model)
        try:
            for m, lid in enumerate(self.spec.moe_layer_ids):
                block = getattr(layers[lid], self.spec.moe_attr)
                router = getattr(getattr(block, self.spec.experts_attr), "router", None)
                if router is None or not hasattr(router, "select_experts"):
                    raise TensorbendError(
                        f"vLLM's MoE layer {lid} has no router with select_experts (expected "
                        f"{self.spec.moe_attr}.{self.spec.experts_attr}.router, vLLM 0.32's "
                        "FusedMoE runner): this vLLM version is not supported"
                    )
                if self.on_route is not None:
                    router.select_experts = self._select_hook(m, router.select_experts)
                    self._routers.append(router)
                if self.on_layer_input is not None:
                    hook = self._layer_hook(m)
                    self._handles.append(
                        layers[lid].register_forward_pre_hook(hook, with_kwargs=True)
                    )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for router in self._routers:
            del router.select_experts  # the class's method again
        for h in self._handles:
            h.remove()
        self._routers.clear()
        self._handles.clear()

    def _select_hook(self, m: int, select):
        def select_experts(hidden_states, router_logits, *args, **kwargs):
            weights_TK, ids_TK = select(hidden_states, router_logits, *args, **kwargs)
            self.on_route(RouterCall(m, hidden_states, router_logits, weights_TK, ids_TK))
            return weights_TK, ids_TK

        return select_experts

    def _layer_hook(self, m: int):
        def hook(module, args, kwargs):
            names = ("positions", "hidden_states", "residual")
            bound = {**dict(zip(names, args, strict=False)), **kwargs}
            hidden, residual = bound["hidden_states"], bound.get("residual")
            self.on_layer_input(m, hidden if residual is None else hidden + residual)

        return hook


def _popped(cap) -> dict:
    """The rows a prompt's forwards captured; a clear error where vLLM routed without calling
    select_experts (a monolithic expert kernel: zentorch, ARM W4A8)."""
    rows = cap.pop()
    if "expert_ids_TLK" not in rows:
        raise TensorbendError(
            "vLLM ran this model's experts without its router's select_experts (a monolithic "
            "expert kernel), so no expert ids were seen: --engine vllm needs a modular backend"
        )
    return rows


def routers_only(path: Path) -> torch.nn.Module:
    """The checkpoint's HF model on the meta device with only what describe_model,
    router_params and model_fingerprint read loaded from its files: the routers, their layers'
    norms and the embedding. vLLM's CPU gate keeps its weight packed (its `weight` is empty),
    so these come from the checkpoint; spec and fingerprint then equal an HF collection's."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    spec = describe_model(model)
    layers = decoder_layers(model)
    wanted = {id(router_module(model, spec, m)) for m in range(spec.num_moe_layers)}
    for lid in spec.moe_layer_ids:
        wanted |= {
            id(getattr(layers[lid], n, None))
            for n in ("input_layernorm", "post_attention_layernorm")
        }
    wanted.add(id(model.get_input_embeddings()))
    names = {
        f"{prefix}.{n}"
        for prefix, mod in model.named_modules()
        if id(mod) in wanted
        for n, _ in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]
    }
    state = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            state |= {k: f.get_tensor(k).float() for k in f.keys() if k in names}  # noqa: SIM118
    missing = names - set(state)
    if missing:
        raise TensorbendError(
            f"{path}: expected the router tensors {sorted(missing)[:3]} in its *.safetensors "
            "files (a checkpoint with renamed weights is not supported by --engine vllm)"
        )
    model.load_state_dict(state, strict=False, assign=True)
    return model


def _attention_backend(path: Path) -> dict:
    """LLM kwargs pinning CPU_MLA for an MLA checkpoint on vLLM's CPU platform (module note)."""
    from vllm.platforms import current_platform

    config = json.loads((Path(path) / "config.json").read_text())
    if current_platform.is_cpu() and config.get("kv_lora_rank") is not None:
        return {"attention_backend": "CPU_MLA"}
    return {}


def flat_mla_rope(model: torch.nn.Module) -> None:
    """Give every MLA layer's rotary op contiguous 2-D query/key rows (see the module note)."""
    for layer in getattr(getattr(model, "model", None), "layers", []):
        rope = getattr(getattr(layer, "self_attn", None), "rotary_emb", None)
        if rope is None or not hasattr(layer.self_attn, "kv_lora_rank"):
            continue  # not MLA: its rotary op gets contiguous tensors already

        def forward(positions, query, key=None, inner=rope.forward):
            if query.dim() != 3 or key is None:  # warm-up and profiling calls
                return inner(positions, query, key)
            q, k = inner(positions, query.flatten(1).contiguous(), key.flatten(1).contiguous())
            return q.view(query.shape), k.view(key.shape)

        rope.forward = forward
