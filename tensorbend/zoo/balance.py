"""Expert load balancing for zoo training: per-step expert loads, aux loss, bias updates.

Usage (inside the training loop; see trainer.py):
    routers = RouterLoad(model, keep_logits=True)   # hooks every MoE router (models.RouterHooks)
    routers.clear(); loss = model(...).loss + coef * routers.aux_loss()
    routers.update_bias(routers.load_LE(), gamma)     # DeepSeek-V3's aux-loss-free balancing
    routers.remove()

The ids are the router's own selection (what the experts consume); logits keep their grad so
the aux loss trains the router.
"""

from __future__ import annotations

import torch

from tensorbend.models import RouterCall, RouterHooks, describe_model, router_module


class RouterLoad:
    """Records each MoE router's ids (and logits) of the latest forward."""

    def __init__(self, model: torch.nn.Module, keep_logits: bool = False) -> None:
        self.spec = describe_model(model)
        L = self.spec.num_moe_layers
        self.routers = [router_module(model, self.spec, m) for m in range(L)]
        self.num_experts = self.spec.num_experts
        self.keep_logits = keep_logits
        self._ids: list[torch.Tensor | None] = [None] * L
        self._logits: list[torch.Tensor | None] = [None] * L
        self._hooks = RouterHooks(model, self.spec, on_route=self._on_route).__enter__()

    def _on_route(self, call: RouterCall) -> None:
        self._ids[call.m] = call.ids_TK.detach()  # [T, K] expert ids the experts consume
        if self.keep_logits:
            self._logits[call.m] = call.logits_TE  # [T, E] raw router logits, with grad

    def clear(self) -> None:
        self._ids = [None] * len(self._ids)
        self._logits = [None] * len(self._logits)

    def aux_loss(self) -> torch.Tensor:
        """Sum over MoE layers of the Switch loss E * sum_e f_e * P_e (1 per layer when even)."""
        total = 0.0
        for ids_TK, logits_TE in zip(self._ids, self._logits, strict=True):
            E = logits_TE.shape[-1]
            f_E = torch.bincount(ids_TK.reshape(-1), minlength=E).float() / ids_TK.numel()
            P_E = torch.softmax(logits_TE.reshape(-1, E).float(), dim=-1).mean(0)
            total = total + E * (f_E.to(P_E.device) * P_E).sum()
        return total

    def load_LE(self) -> torch.Tensor:
        E = self.num_experts
        return torch.stack(
            [torch.bincount(ids.reshape(-1), minlength=E).float() for ids in self._ids]
        )

    @torch.no_grad()
    def update_bias(self, load_LE: torch.Tensor, gamma: float) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded."""
        for router, load_E in zip(self.routers, load_LE, strict=True):
            bias = router.e_score_correction_bias
            bias += gamma * torch.sign(load_E.mean() - load_E).to(bias.device)

    def remove(self) -> None:
        self._hooks.__exit__()
