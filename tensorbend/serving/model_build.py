"""The model without its routed experts (`serving.offloaded.load_offloaded`'s first step):
built from config.json with the experts' parameters on `meta`, every other weight read from the
checkpoint.

Usage:
    lm, spec, layout = build_without_experts(Path("my-moe"), torch.bfloat16)
    load_non_experts(lm, plan)        # plan: offload.expert_plan.ExpertPlan of the checkpoint

`build_without_experts` builds the CausalLM from config.json with the routed experts'
parameters on `meta` (their class's __init__ runs under `torch.device("meta")`, so nothing is
allocated), and `load_non_experts` copies every other tensor from the checkpoint
(`offload.expert_plan.ExpertPlan.other`) into it, refusing a checkpoint that lacks one.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tensorbend.errors import StoreError, TensorbendError
from tensorbend.models import RoutingSpec, check_model_type, describe_model, moe_block

if TYPE_CHECKING:
    from tensorbend.offload.expert_plan import ExpertPlan


@contextlib.contextmanager
def _experts_on_meta(cls):
    """While active, instances of experts class `cls` allocate their parameters on meta."""
    orig = cls.__init__

    def init(self, *args, **kwargs):
        with torch.device("meta"):
            orig(self, *args, **kwargs)

    cls.__init__ = init
    try:
        yield
    finally:
        cls.__init__ = orig


def build_without_experts(path: Path, dtype: torch.dtype):
    """(CausalLM, spec, expert layout) from config.json: routed experts on meta (never
    allocated), every other weight randomly initialised until `load_non_experts`."""
    from transformers import AutoModelForCausalLM

    from tensorbend.models import read_config
    from tensorbend.offload.layer import check_supported
    from tensorbend.offload.layout import ExpertLayout

    check_model_type(path)
    try:
        config = read_config(path)
    except (OSError, ValueError) as e:
        raise TensorbendError(f"{path}: cannot read config.json ({e})") from e
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=dtype)
    spec = describe_model(meta)
    check_supported(spec.family)
    experts_cls = type(getattr(moe_block(meta, spec, 0), spec.experts_attr))
    layout = ExpertLayout.of(getattr(moe_block(meta, spec, 0), spec.experts_attr))
    layout = ExpertLayout(layout.parts, dtype)
    with _experts_on_meta(experts_cls):
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if (path / "generation_config.json").is_file():  # what from_pretrained would use
        from transformers import GenerationConfig

        lm.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    if hasattr(lm, "set_experts_implementation"):
        with contextlib.suppress(ValueError, TypeError):
            lm.set_experts_implementation("eager")
    return lm, spec, layout


def load_non_experts(lm, plan: ExpertPlan) -> None:
    """Copy every non-expert checkpoint tensor into the model; refuse if one is missing."""
    state = lm.state_dict(keep_vars=True)
    expert_ids = {id(p) for p in _expert_params(lm, plan.spec)}
    tied = {n for n, p in state.items() if id(p) in _tied_ids(lm)}
    with torch.no_grad():
        for key, ref in plan.other.items():
            t = plan.ckpt.read(ref)
            dst = state[key]
            if tuple(dst.shape) != tuple(t.shape):
                raise StoreError(
                    f"{plan.ckpt.directory}: {ref.key} has shape {list(t.shape)}, the model's "
                    f"{key} expects {list(dst.shape)} (config.json); is this the right config?"
                )
            dst.copy_(t.to(dst.dtype))
    persistent = {n for n, _ in lm.named_parameters()} | _persistent_buffers(lm)
    missing = [
        k
        for k in state
        if k in persistent
        and id(state[k]) not in expert_ids
        and k not in plan.other
        and k not in tied
    ]
    if missing:
        raise StoreError(
            f"{plan.ckpt.directory}: expected weights for {len(missing)} more tensors, e.g. "
            f"{missing[:3]}; the checkpoint is incomplete or of another architecture"
        )


def _expert_params(lm, spec: RoutingSpec):
    for m in range(spec.num_moe_layers):
        yield from getattr(moe_block(lm, spec, m), spec.experts_attr).parameters()


def _tied_ids(lm) -> set[int]:
    """Ids of parameters shared by several names (tied embeddings): loaded through one name."""
    seen, tied = {}, set()
    for _, p in lm.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(id(p))
        seen[id(p)] = True
    return tied


def _persistent_buffers(lm) -> set[str]:
    names = set()
    for mod_name, mod in lm.named_modules():
        for b in mod._buffers:
            if b not in mod._non_persistent_buffers_set:
                names.add(f"{mod_name}.{b}" if mod_name else b)
    return names
