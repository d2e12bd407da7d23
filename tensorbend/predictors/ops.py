"""Tensor operations every predictor shares: RMS normalisation, per-row standardising, multi-hot.

Usage:
    >>> import torch
    >>> multi_hot(torch.tensor([[0, 2], [1, 3]]), 4)
    tensor([[1., 0., 1., 0.],
            [0., 1., 0., 1.]])
    >>> multi_hot(torch.tensor([[0, 2], [1, 3]]), 4, valid_T=torch.tensor([True, False]))
    tensor([[1., 0., 1., 0.],
            [0., 0., 0., 0.]])
    >>> standardise(torch.tensor([[1.0, 2.0, 3.0]]))
    tensor([[-1.0000,  0.0000,  1.0000]])
    >>> rmsnorm(torch.tensor([[3.0, -3.0]]))
    tensor([[ 1.0000, -1.0000]])

Shapes: T tokens, D hidden size, E experts, K top-k.
"""

from __future__ import annotations

import torch

EPS_RMS = 1e-6  # inside the square root of rmsnorm (the models' own norm eps order)
EPS_STD = 1e-6  # added to the standard deviation of standardise


def rmsnorm(x_TD: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) per row, without a weight (a router input's scale-free part)."""
    return x_TD * rms_inverse(x_TD)


def rms_inverse(x_TD: torch.Tensor) -> torch.Tensor:
    """[T, 1] factor 1 / sqrt(mean(x^2) + eps) per row (rmsnorm(x) == x * rms_inverse(x))."""
    return torch.rsqrt(x_TD.pow(2).mean(-1, keepdim=True) + EPS_RMS)


def standardise(s_TE: torch.Tensor) -> torch.Tensor:
    """(s - mean) / (std + eps) per row, std unbiased: scores of different scales made comparable."""
    std_T1, mean_T1 = torch.std_mean(s_TE, -1, keepdim=True)
    return (s_TE - mean_T1) / (std_T1 + EPS_STD)


def multi_hot(
    ids_TK: torch.Tensor, num_experts: int, valid_T: torch.Tensor | None = None
) -> torch.Tensor:
    """[T, E] float 0/1 from expert ids; rows where valid_T is False are all zero."""
    out_TE = torch.zeros(ids_TK.shape[0], num_experts)
    out_TE.scatter_(1, ids_TK.long(), 1.0)
    if valid_T is not None:
        out_TE *= valid_T.float()[:, None]
    return out_TE
