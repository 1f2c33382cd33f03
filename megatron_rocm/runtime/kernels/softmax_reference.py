"""Torch reference for Megatron's fused scaled (masked) softmax: the CPU path and parity oracle.

The semantics are those of the Apex/Megatron CUDA kernels (``scaled_*softmax_cuda``), not of
Megatron's unfused torch fallback, because the fused path is what these functions replace:

* math in fp32, result cast to the input dtype;
* forward ``scale`` is rounded to the input dtype first (the CUDA dispatchers take it as
  ``input_t``), backward ``scale`` stays fp32 (they take it as ``acc_t``);
* padding mask: True = masked out, the logit becomes ``-10000.0`` (not ``-inf``), and a row
  whose maximum is exactly ``-10000.0`` (every element masked) yields zeros, not ``1/sk``;
* causal: row ``i`` keeps columns ``0..i`` (``torch.triu(ones(sq, sk), 1)`` masks the rest,
  top-left aligned when ``sq != sk``); masked positions are excluded (``-inf``) and the
  backward never reads ``dy`` or ``y`` there, so their gradient is exactly zero.
"""

from __future__ import annotations

import torch

MASK_FILL = -10000.0
"""Logit given to masked-out positions by Apex's scaled_masked_softmax (and Megatron's mask_func)."""


def scale_value(scale: float | torch.Tensor) -> float:
    """Megatron passes ``scale_t[0]`` (a 0-d CPU tensor) where a float is expected."""
    if isinstance(scale, torch.Tensor):
        return float(scale.reshape(()).item())
    return float(scale)


def forward_scale(scale: float | torch.Tensor, dtype: torch.dtype) -> float:
    """The forward scale as the CUDA kernels see it: rounded through the input dtype."""
    value = scale_value(scale)
    if dtype in (torch.float16, torch.bfloat16):
        return float(torch.tensor(value, dtype=dtype))
    return value


def causal_mask(sq: int, sk: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[sq, sk]`` bool, True above the diagonal: the positions causal softmax never reads."""
    ones = torch.ones(sq, sk, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1)


def scaled_softmax(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``softmax(x * scale)`` over the last dimension."""
    z = x.float() * forward_scale(scale, x.dtype)
    return torch.softmax(z, dim=-1).to(x.dtype)


def scaled_masked_softmax(
    x: torch.Tensor, mask: torch.Tensor, scale: float | torch.Tensor
) -> torch.Tensor:
    """Padding-mask softmax; ``mask`` broadcasts to ``x`` (``[b|1, 1, sq, sk]`` for 4-D x)."""
    z = x.float() * forward_scale(scale, x.dtype)
    z = z.masked_fill(mask.bool(), MASK_FILL)
    probs = torch.softmax(z, dim=-1)
    fully_masked = z.amax(dim=-1, keepdim=True) == MASK_FILL
    return probs.masked_fill(fully_masked, 0.0).to(x.dtype)


def scaled_upper_triang_masked_softmax(
    x: torch.Tensor, scale: float | torch.Tensor
) -> torch.Tensor:
    """Causal softmax over ``[..., sq, sk]``; zeros above the diagonal."""
    sq, sk = x.shape[-2], x.shape[-1]
    z = x.float() * forward_scale(scale, x.dtype)
    z = z.masked_fill(causal_mask(sq, sk, x.device), float("-inf"))
    return torch.softmax(z, dim=-1).to(x.dtype)


def softmax_backward(
    dy: torch.Tensor, y: torch.Tensor, scale: float | torch.Tensor, causal: bool = False
) -> torch.Tensor:
    """``dx = scale * (dy*y - y * sum(dy*y))`` in fp32 (Apex's order of operations).

    With ``causal`` the upper triangle of ``dy`` and ``y`` is treated as zero, as the causal
    kernel never loads it.
    """
    g = dy.float()
    p = y.float()
    if causal:
        keep = ~causal_mask(y.shape[-2], y.shape[-1], y.device)
        g = torch.where(keep, g, 0.0)
        p = torch.where(keep, p, 0.0)
    gy = g * p
    dx = scale_value(scale) * (gy - p * gy.sum(dim=-1, keepdim=True))
    return dx.to(dy.dtype)
