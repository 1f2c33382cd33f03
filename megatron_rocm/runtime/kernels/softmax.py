"""Megatron's fused scaled (masked) softmax without Apex: Triton on a GPU, torch elsewhere.

Three layers, so a patch can pick whichever seam the Megatron version it targets has:

* autograd classes with Megatron's ``.apply`` signatures (``ScaledUpperTriangMaskedSoftmax``,
  ``ScaledMaskedSoftmax``, ``ScaledSoftmax``) and their functional wrappers;
* Apex-extension-shaped functions (``upper_triang_forward`` ... ``softmax_backward`` and
  ``get_batch_per_block``) that can stand in for the ``scaled_*softmax_cuda`` modules;
* :func:`is_kernel_available`: every length works, so only the dtype can say no.

Semantics follow the Apex CUDA kernels (see :mod:`megatron_rocm.runtime.kernels.softmax_reference`),
for any ``sk`` and any batch/head count. Non-contiguous inputs are copied to contiguous
first; outputs and gradients are always contiguous. ``scale`` may be a float or a 1-element
tensor (Megatron passes ``scale_t[0]``).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rocm.runtime.kernels import softmax_reference as ref
from megatron_rocm.runtime.kernels.launch import log_fallback_once, use_triton

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_kernel_available(dtype: torch.dtype, sq: int, sk: int) -> bool:
    """Whether the fused path handles this call: any ``sq, sk >= 1`` in fp16/bf16/fp32.

    Also True without a GPU: the torch reference then runs with the same semantics.
    """
    return dtype in SUPPORTED_DTYPES and sq >= 1 and sk >= 1


def get_batch_per_block(sq: int, sk: int, b: int, np: int) -> int:
    """Apex-shaped shim: no batching constraint, so Megatron's divisibility checks pass."""
    return 1


def _triton(x: torch.Tensor) -> Any | None:
    """The Triton module when ``x`` should go through it, else None (reference path)."""
    if not use_triton(x, kernel="softmax"):
        return None
    if x.dtype not in SUPPORTED_DTYPES:
        log_fallback_once(f"softmax-{x.dtype}", f"softmax: no Triton kernel for {x.dtype}")
        return None
    from megatron_rocm.runtime.kernels import softmax_triton as _softmax_triton

    return _softmax_triton


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    if x.dim() < 2:
        raise ValueError(f"softmax expects [..., sq, sk], got shape {tuple(x.shape)}")
    return x.contiguous()


# -- Apex-extension-shaped functions -------------------------------------------------------


def upper_triang_forward(inputs: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Causal softmax of ``[attn_batches, sq, sk]`` (any leading dims); zeros above diagonal."""
    x = _rows_view(inputs)
    tri = _triton(x)
    if tri is None:
        return ref.scaled_upper_triang_masked_softmax(x, scale)
    return tri.forward(x, ref.forward_scale(scale, x.dtype), tri.CAUSAL, sq=x.shape[-2])


def upper_triang_backward(
    output_grads: torch.Tensor, softmax_results: torch.Tensor, scale: float | torch.Tensor
) -> torch.Tensor:
    return _backward(output_grads, softmax_results, scale, causal=True)


def masked_forward(
    inputs: torch.Tensor, mask: torch.Tensor | None, scale: float | torch.Tensor
) -> torch.Tensor:
    """Softmax of ``[b, np, sq, sk]`` with a bool mask ``[b|1, 1, sq, sk]`` (True = masked)."""
    if mask is None:
        return softmax_forward(inputs, scale)
    if inputs.dim() != 4:
        raise ValueError(f"masked softmax expects [b, np, sq, sk], got {tuple(inputs.shape)}")
    b, heads, sq, sk = inputs.shape
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, b):
        raise ValueError(
            f"mask must be [b|1, 1, sq, sk], got {tuple(mask.shape)} for {(b, sq, sk)}"
        )
    x = inputs.contiguous()
    tri = _triton(x)
    if tri is None:
        return ref.scaled_masked_softmax(x, mask, scale)
    m = mask if mask.dtype == torch.bool else mask != 0
    m = m.to(x.device).expand(m.shape[0], 1, sq, sk).view(torch.uint8)
    s = ref.forward_scale(scale, x.dtype)
    return tri.forward(x, s, tri.MASKED, sq=sq, mask=m, heads=heads)


def masked_backward(
    output_grads: torch.Tensor, softmax_results: torch.Tensor, scale: float | torch.Tensor
) -> torch.Tensor:
    return _backward(output_grads, softmax_results, scale, causal=False)


def softmax_forward(inputs: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Softmax of ``inputs * scale`` over the last dimension (``[b, np, sq, sk]`` or any)."""
    x = _rows_view(inputs)
    tri = _triton(x)
    if tri is None:
        return ref.scaled_softmax(x, scale)
    return tri.forward(x, ref.forward_scale(scale, x.dtype), tri.PLAIN, sq=x.shape[-2])


def softmax_backward(
    output_grads: torch.Tensor, softmax_results: torch.Tensor, scale: float | torch.Tensor
) -> torch.Tensor:
    return _backward(output_grads, softmax_results, scale, causal=False)


def _backward(
    dy: torch.Tensor, y: torch.Tensor, scale: float | torch.Tensor, causal: bool
) -> torch.Tensor:
    if dy.shape != y.shape:
        raise ValueError(f"grad shape {tuple(dy.shape)} != softmax shape {tuple(y.shape)}")
    dy, y = _rows_view(dy), _rows_view(y)
    tri = _triton(dy)
    if tri is None or y.dtype != dy.dtype:
        return ref.softmax_backward(dy, y, scale, causal=causal)
    return tri.backward(dy, y, ref.scale_value(scale), causal=causal, sq=y.shape[-2])


# -- autograd classes with Megatron's signatures --------------------------------------------


class ScaledUpperTriangMaskedSoftmax(torch.autograd.Function):
    """scale -> causal (upper-triangular) mask -> softmax, on ``[attn_batches, sq, sk]``."""

    @staticmethod
    def forward(ctx: Any, inputs: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
        ctx.scale = ref.scale_value(scale)
        y = upper_triang_forward(inputs, ctx.scale)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, output_grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        (y,) = ctx.saved_tensors
        return upper_triang_backward(output_grads, y, ctx.scale), None


class ScaledMaskedSoftmax(torch.autograd.Function):
    """scale -> padding mask (True = masked) -> softmax, on ``[b, np, sq, sk]``."""

    @staticmethod
    def forward(
        ctx: Any, inputs: torch.Tensor, mask: torch.Tensor, scale: float | torch.Tensor
    ) -> torch.Tensor:
        ctx.scale = ref.scale_value(scale)
        y = masked_forward(inputs, mask, ctx.scale)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, output_grads: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (y,) = ctx.saved_tensors
        return masked_backward(output_grads, y, ctx.scale), None, None


class ScaledSoftmax(torch.autograd.Function):
    """scale -> softmax, on ``[b, np, sq, sk]`` (or any ``[..., sk]``)."""

    @staticmethod
    def forward(ctx: Any, inputs: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
        ctx.scale = ref.scale_value(scale)
        y = softmax_forward(inputs, ctx.scale)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, output_grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        (y,) = ctx.saved_tensors
        return softmax_backward(output_grads, y, ctx.scale), None


def scaled_upper_triang_masked_softmax(
    x: torch.Tensor, scale: float | torch.Tensor
) -> torch.Tensor:
    return ScaledUpperTriangMaskedSoftmax.apply(x, scale)


def scaled_masked_softmax(
    x: torch.Tensor, mask: torch.Tensor, scale: float | torch.Tensor
) -> torch.Tensor:
    return ScaledMaskedSoftmax.apply(x, mask, scale)


def scaled_softmax(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    return ScaledSoftmax.apply(x, scale)
