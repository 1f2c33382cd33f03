"""SwiGLU forward and backward behind upstream's ``bias_swiglu_impl`` (patch ``swiglu``).

Upstream's bias-free SwiGLU (``--swiglu`` with ``--bias-swiglu-fusion``, the default; every
Llama-style model, both specs) runs two ``torch.compile``-d functions, ``swiglu`` and
``swiglu_back``. The backward's ``torch.cat`` makes the compiled kernel load each input twice,
and it is the largest non-GEMM kernel of a Llama step (``docs/kernels.md``). On a GPU these run
one Triton pass each (:mod:`~megatron_rocm.runtime.kernels.swiglu_triton`).

``native_swiglu(bias_swiglu_impl, swiglu, swiglu_back)`` wraps upstream's entry point: the
plain case (no bias, no FP8 input store, no CPU offload, no clamp) runs ``NativeSwiGLU``, every
other case upstream's own function unchanged. Inside ``NativeSwiGLU`` anything the kernel does
not take -- a CPU tensor, another dtype, a gradient of another dtype, rows that are not
contiguous -- goes to upstream's ``swiglu`` / ``swiglu_back``, so the result is upstream's
wherever the kernel does not run; ``MEGATRON_ROCM_KERNELS=reference:swiglu`` forces that.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from megatron_rocm.runtime.kernels.launch import log_fallback_once, use_triton

Forward = Callable[[torch.Tensor], torch.Tensor]
Backward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _unsupported(y: torch.Tensor, g: torch.Tensor | None = None) -> str | None:
    """Why the Triton kernel cannot take these tensors, or None."""
    from megatron_rocm.runtime.kernels.swiglu_triton import SUPPORTED_DTYPES

    if y.dtype not in SUPPORTED_DTYPES:
        return f"dtype {y.dtype}"
    if y.dim() == 0 or y.shape[-1] % 2:
        return f"last dimension {y.shape[-1] if y.dim() else 0} is not even"
    if not y.is_contiguous():
        return "input is not contiguous"
    if g is not None:
        if g.dtype != y.dtype:
            return f"gradient dtype {g.dtype} differs from the input's {y.dtype}"
        if g.shape != y.shape[:-1] + (y.shape[-1] // 2,) or not g.is_contiguous():
            return "gradient is not a contiguous tensor of the output's shape"
    return None


def _use_kernel(y: torch.Tensor, g: torch.Tensor | None = None) -> bool:
    if not use_triton(y, *([] if g is None else [g]), kernel="swiglu"):
        return False
    reason = _unsupported(y, g)
    if reason is not None:
        log_fallback_once(f"swiglu:{reason}", f"SwiGLU on upstream's compiled function: {reason}")
    return reason is None


def forward(y: torch.Tensor, fallback: Forward) -> torch.Tensor:
    """``silu(y1) * y2`` where ``y = [y1 | y2]`` on the last dimension."""
    if not _use_kernel(y):
        return fallback(y)
    from megatron_rocm.runtime.kernels import swiglu_triton as tri

    out = tri.swiglu_forward(y.view(-1, y.shape[-1]))
    return out.view(*y.shape[:-1], y.shape[-1] // 2)


def backward(g: torch.Tensor, y: torch.Tensor, fallback: Backward) -> torch.Tensor:
    """The gradient w.r.t. ``y`` of ``forward(y)`` for the output gradient ``g``."""
    if not _use_kernel(y, g):
        return fallback(g, y)
    from megatron_rocm.runtime.kernels import swiglu_triton as tri

    dy = tri.swiglu_backward(g.view(-1, g.shape[-1]), y.view(-1, y.shape[-1]))
    return dy.view(y.shape)


class NativeSwiGLU(torch.autograd.Function):
    """upstream's ``SwiGLUFunction`` without its options: saves the input, as upstream does."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, y: torch.Tensor, swiglu_fn: Forward, swiglu_back_fn: Backward
    ) -> torch.Tensor:
        ctx.save_for_backward(y)
        ctx.swiglu_back_fn = swiglu_back_fn
        return forward(y, swiglu_fn)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return backward(g, y, ctx.swiglu_back_fn), None, None


def _plain(bias: Any, options: tuple[Any, ...], keywords: dict[str, Any]) -> bool:
    """No bias and every option at its default (False / None): the case ``NativeSwiGLU`` runs.
    Any other value -- even one this code has never seen, from a later upstream -- goes to
    upstream's function."""
    return bias is None and all(v is None or v is False for v in (*options, *keywords.values()))


def native_swiglu(upstream_impl: Callable, swiglu_fn: Forward, swiglu_back_fn: Backward):
    """``bias_swiglu_impl(input, bias, *options)`` with the plain case on ``NativeSwiGLU``."""

    @functools.wraps(upstream_impl)
    def bias_swiglu_impl(input: torch.Tensor, bias: Any, *options: Any, **keywords: Any):
        if not _plain(bias, options, keywords) or input.dim() not in (2, 3):
            return upstream_impl(input, bias, *options, **keywords)
        return NativeSwiGLU.apply(input, swiglu_fn, swiglu_back_fn)

    return bias_swiglu_impl  # functools.wraps keeps upstream's as __wrapped__
