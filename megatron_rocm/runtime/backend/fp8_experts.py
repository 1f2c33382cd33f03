"""The FP8 MoE experts' GEMMs: every local expert of a grouped linear in one autograd function.

Under current scaling (``--fp8-recipe tensorwise``) each expert's tokens, weight and output
gradient are quantized by their own amax, as TE's ``GroupedLinear`` does. Per expert that
would be a linear of its own (three launches per quantize, a dozen small torch calls, an
autograd node), which leaves a step with a few experts a layer bound by the host. Here the
tokens of all experts quantize together (``kernels.fp8_segments``: two launches per tensor),
so do the weights, and each expert costs only its GEMMs: ``torch._scaled_mm`` over its rows
rounded up to ``EXPERT_ROW_BUCKET`` (shapes repeat from step to step, and cuBLASLt plans each
new shape on the host), written straight into the output (``fp8_mm_into``) in expert order,
so a bucket's spare rows are overwritten by the next expert's GEMM or fall past the output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rocm.runtime.backend.fp8 import deliver_wgrad, fp8_wgrad
from megatron_rocm.runtime.kernels.fp8 import fp8_mm_into
from megatron_rocm.runtime.kernels.fp8_segments import (
    QuantizedSegments,
    Segments,
    quantize_segments,
)
from megatron_rocm.runtime.kernels.grad_accum import has_main_grad
from megatron_rocm.runtime.kernels.grouped_gemm_ops import Matrices

# each expert's GEMMs run on its rows rounded up to a multiple of this (module docstring)
EXPERT_ROW_BUCKET = 128
_WEIGHT_MULTIPLE = 16  # a weight's rows are already a multiple of 16 (check_gemm_dims)


@dataclass(eq=False)
class ExpertWeightCache:
    """The experts' quantized weights, kept for a step's later micro-batches (TE's parameter
    cache, driven by ``fp8.weight_reuse``), with the weight storages they were taken from."""

    quantized: QuantizedSegments | None = None
    sources: tuple[int, ...] = ()

    def get(self, weights: tuple[torch.Tensor, ...], transposed: bool) -> QuantizedSegments | None:
        q = self.quantized
        if q is None or self.sources != tuple(w.data_ptr() for w in weights):
            return None
        return None if transposed and q.transposed is None else q

    def put(self, weights: tuple[torch.Tensor, ...], quantized: QuantizedSegments) -> None:
        self.quantized, self.sources = quantized, tuple(w.data_ptr() for w in weights)


def _stacked(weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The weights [out, in] as one [experts * out, in] tensor: a view where they are equally
    spaced in one storage (as the grouped linear allocates them), else a copy."""
    view = Matrices(list(weights)).view3d()
    if view is not None and view.is_contiguous():
        return view.reshape(-1, view.shape[-1])
    return torch.cat([w.detach() for w in weights])


def quantize_weights(
    weights: tuple[torch.Tensor, ...], dtype: torch.dtype, margin: int, transpose: bool
) -> QuantizedSegments:
    """Each expert's weight quantized by its own amax, all in one go."""
    segs = Segments((weights[0].shape[0],) * len(weights), _WEIGHT_MULTIPLE)
    with torch.no_grad():
        return quantize_segments(_stacked(weights).detach(), segs, dtype, margin, transpose)


@dataclass(frozen=True)
class ExpertsCall:
    """What one forward of the FP8 experts needs besides the tensors."""

    segs: Segments
    recipe: Any  # backend.fp8.Fp8Recipe: the formats, the margin, --fp8-wgrad
    fuse_wgrad: bool
    cache: ExpertWeightCache
    reuse_weight: bool | None  # fp8.weight_reuse


class Fp8ExpertsFunction(torch.autograd.Function):
    """``out[rows of e] = x[rows of e] W_e^T`` for every expert ``e``, each GEMM in FP8.

    Backward: the output gradient quantized per expert (the backward format), each expert's
    input gradient ``dy_e W_e`` in FP8 into one buffer, each weight gradient ``dy_e^T x_e`` in
    FP8 with an fp32 result (in fp32 from the activations without ``wgrad_in_fp8``), added into
    ``main_grad`` under gradient-accumulation fusion (Megatron's placeholder returned), as the
    dense FP8 linear does. The forward keeps only the transposes its backward reads.
    """

    @staticmethod
    def forward(ctx, x, call: ExpertsCall, grad_enabled, *weights):  # noqa: ANN001, ANN205
        recipe, segs = call.recipe, call.segs
        fmt = recipe.formats.forward
        need_dgrad = grad_enabled and ctx.needs_input_grad[0]
        need_wgrad = grad_enabled and any(ctx.needs_input_grad[3:])
        wgrad_fp8 = need_wgrad and recipe.wgrad_in_fp8
        xq = quantize_segments(x, segs, fmt, recipe.margin, transpose=wgrad_fp8)
        wq = call.cache.get(weights, need_dgrad) if call.reuse_weight else None
        if wq is None:
            wq = quantize_weights(weights, fmt, recipe.margin, need_dgrad)
            if call.reuse_weight is not None:
                call.cache.put(weights, wq)
        out = x.new_empty(segs.padded_rows, weights[0].shape[0])
        _gemms_into(out, xq, lambda e: (wq.rows(e).t(), wq.inv(e)), fast_accum=True)
        ctx.call, ctx.x_cols, ctx.w_segs = call, xq.cols, wq.segs
        ctx.save_for_backward(
            x if need_wgrad and not wgrad_fp8 else None,
            xq.transposed if wgrad_fp8 else None,
            xq.inverse,
            wq.transposed if need_dgrad else None,
            wq.inverse,
            *weights,
        )
        ctx.fuse = [call.fuse_wgrad and w.requires_grad and has_main_grad(w) for w in weights]
        return _viewless(out[: segs.rows])

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205 - autograd signature
        saved_x, x_t, x_inv, w_t, w_inv, *weights = ctx.saved_tensors
        call: ExpertsCall = ctx.call
        segs, recipe = call.segs, call.recipe
        out_features, in_features = weights[0].shape
        xq = QuantizedSegments(segs, ctx.x_cols, None, x_t, x_inv)
        wq = QuantizedSegments(ctx.w_segs, in_features, None, w_t, w_inv)
        needs = ctx.needs_input_grad
        dy = grad_output.reshape(segs.rows, out_features)
        wgrad_fp8 = any(needs[3:]) and recipe.wgrad_in_fp8
        dyq = quantize_segments(dy, segs, recipe.formats.backward, recipe.margin, wgrad_fp8)
        grad_x = None
        if needs[0]:
            grad_x = dy.new_empty(segs.padded_rows, in_features)
            _gemms_into(grad_x, dyq, lambda e: (wq.t(e).t(), wq.inv(e)))
            grad_x = _viewless(grad_x[: segs.rows])
        grads = []
        for e, weight in enumerate(weights):
            if not needs[3 + e]:
                grads.append(None)
                continue
            if segs.counts[e] and wgrad_fp8:
                a, b = (dyq.t(e), dyq.inv(e)), (xq.t(e).t(), xq.inv(e))
                grads.append(fp8_wgrad(ctx.fuse[e], weight, a, b, dy))
                continue
            wgrad = None
            if segs.counts[e]:
                rows = slice(segs.starts[e], segs.starts[e + 1])
                wgrad = dy[rows].t().float() @ saved_x[rows].float()
            grads.append(deliver_wgrad(ctx.fuse[e], weight, wgrad, dy))
        return (grad_x, None, None, *grads)


def _gemms_into(
    out: torch.Tensor,
    a: QuantizedSegments,
    b: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    fast_accum: bool = False,
) -> None:
    """``out`` [padded rows, n]: each expert's rows of ``a`` (its bucket) times ``b(e)`` (a
    column-major operand and its inverse scale), in expert order, so that the rows a bucket
    writes past its expert's are the next experts' to overwrite, or past the rows returned."""
    segs = a.segs
    for e in segs.nonempty():
        start = segs.starts[e]
        b_e, b_inv = b(e)
        rows = out[start : start + segs.buckets[e]]
        fp8_mm_into(rows, a.rows(e), a.inv(e), b_e, b_inv, fast_accum)


def _viewless(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a tensor that is no view for autograd (Megatron's
    ``make_viewless_tensor``): a caller may change the experts' output in place, as it could
    the per-expert path's ``torch.cat``."""
    out = torch.empty((1,), dtype=t.dtype, device=t.device)
    out.data = t.data
    return out


def fp8_experts(x: torch.Tensor, weights: tuple[torch.Tensor, ...], call: ExpertsCall) -> Any:
    """``x`` [tokens, in] (the experts' rows one after another, ``call.segs``) through every
    expert's weight in FP8: [tokens, out]."""
    return Fp8ExpertsFunction.apply(x, call, torch.is_grad_enabled(), *weights)
