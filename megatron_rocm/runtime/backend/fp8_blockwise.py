"""The native linears' GEMMs under ``--fp8-recipe blockwise`` (TE's ``Float8BlockScaling``):
1 x 128 blocks for the input and the output gradient, 128 x 128 tiles for the weight
(``kernels.fp8_blockwise``).

Each operand is quantized in the layout of the GEMM that reads it, from the high-precision
tensor, as TE does: the input's rows for the forward and its columns (transposed, over the
tokens) for the weight gradient, the output gradient's rows for the input gradient and its
columns for the weight gradient. The weight's tiles serve the forward and, transposed, the
input gradient. No state crosses steps (no amax history), so checkpoints and CUDA graphs hold
nothing of it; the quantized weight is kept for a step's later micro-batches as under the
other recipes (``backend.fp8.weight_reuse``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron_rocm.runtime.backend._linear_function import (
    deliver_wgrad,
    keep_for_backward,
    wgrad_from_activations,
)
from megatron_rocm.runtime.kernels.fp8_blockwise import (
    Blocks,
    block_mm,
    quantize_rows,
    quantize_tiles,
    quantize_transposed_rows,
)
from megatron_rocm.runtime.kernels.grad_accum import main_grad_for_wgrad

if TYPE_CHECKING:
    from megatron_rocm.runtime.backend.fp8 import Fp8Recipe


class Fp8BlockwiseLinearFunction(torch.autograd.Function):
    """``y = x W^T`` with every GEMM in FP8 under block scaling; the weight gradient keeps
    ``LinearFunction``'s contract (added into ``weight.main_grad`` under gradient-accumulation
    fusion, Megatron's placeholder returned)."""

    @staticmethod
    def forward(ctx, x, weight, fuse_wgrad, recipe, grad_enabled, reuse_weight=None):  # noqa: ANN001, ANN205
        fmt = recipe.formats.forward
        rows = x.reshape(-1, x.shape[-1])
        need_dgrad = grad_enabled and ctx.needs_input_grad[0]
        need_wgrad = grad_enabled and ctx.needs_input_grad[1]
        fp8_wgrad = need_wgrad and recipe.wgrad_in_fp8
        x_blocks, x_t = quantize_rows(rows, fmt, transposed=fp8_wgrad)
        cached = recipe.weight_cache.get(weight, need_dgrad) if reuse_weight else None
        if cached is not None:
            w, w_t, _ = cached
        else:
            w, w_t = quantize_tiles(weight, fmt, transposed=need_dgrad)
            if reuse_weight is not None:
                recipe.weight_cache.put(weight, (w, w_t, None))
        out = block_mm(x_blocks, w, True, x.dtype)
        saved_x = rows if need_wgrad and not recipe.wgrad_in_fp8 else None
        ctx.save_for_backward(
            *(x_t if x_t is not None else (None, None)),
            *(w_t if need_dgrad else (None, None)),
            saved_x,
            weight,
        )
        keep_for_backward(ctx, recipe, x, fuse_wgrad, weight)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205 - autograd signature
        x_t_data, x_t_inv, w_t_data, w_t_inv, saved_x, weight = ctx.saved_tensors
        recipe: Fp8Recipe = ctx.recipe
        fmt = recipe.formats.backward
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fp8_wgrad = need_wgrad and recipe.wgrad_in_fp8
        if need_dgrad:
            dy_blocks, dy_t = quantize_rows(dy, fmt, transposed=fp8_wgrad)
        else:
            dy_blocks, dy_t = None, quantize_transposed_rows(dy, fmt) if fp8_wgrad else None
        grad_input = grad_weight = None
        if need_dgrad:  # [M, N] x [N, K]: the weight's tiles transposed, [K, N]
            w_t = Blocks(w_t_data, w_t_inv)
            grad_input = block_mm(dy_blocks, w_t, True, ctx.x_dtype).view(ctx.x_shape)
        if need_wgrad and fp8_wgrad:  # [N, M] x [M, K]: both over the tokens
            x_t = Blocks(x_t_data, x_t_inv)
            if ctx.fuse_wgrad:
                main_grad = main_grad_for_wgrad(weight)
                block_mm(dy_t, x_t, False, torch.float32, add_into=main_grad)
                grad_weight = deliver_wgrad(True, weight, None, dy, main_grad)
            else:
                wgrad = block_mm(dy_t, x_t, False, torch.float32)
                grad_weight = deliver_wgrad(False, weight, wgrad, dy)
        elif need_wgrad:  # --no-fp8-wgrad: in fp32 from the activations
            grad_weight = wgrad_from_activations(ctx, dy, saved_x, weight)
        return grad_input, grad_weight, None, None, None, None
