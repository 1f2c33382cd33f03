"""``y = x W^T`` with Megatron's weight-gradient contract and no tensor-parallel communication.

Used by the duplicated ``TELinear`` and by ``TERowParallelLinear`` without tensor parallelism
when its input is an a2a attention output whose exchanges it can overlap
(``project_attention_output``: the forward's last one lands while it computes over the rank's
own heads, ``cp.early_output``; it starts the backward's first one, ``cp.handoff``). Kept
free of Megatron imports so the CP tests run it on bare torch.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rocm.runtime.backend.cp.early_output import Landing, take
from megatron_rocm.runtime.backend.cp.handoff import Handoff, claim
from megatron_rocm.runtime.kernels.grad_accum import (
    has_main_grad,
    main_grad_for_wgrad,
    wgrad_gemm_accum,
)


class LinearFunction(torch.autograd.Function):
    """``y = x W^T`` whose weight gradient goes straight into ``main_grad`` when asked.

    Mirrors Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` with no TP
    communication: with gradient-accumulation fusion the wgrad GEMM accumulates into
    ``weight.main_grad`` and autograd gets a placeholder, flagged ``grad_added_to_main_grad``
    so Megatron's DDP hooks do not add it again. With a ``handoff`` the input gradient starts
    the attention's exchange before the weight-gradient GEMM, whose transfers run beside it.
    With a ``landing`` the input's peers' heads are still on their way (``cp.early_output``).
    """

    @staticmethod
    def forward(ctx, x, weight, fuse_wgrad, handoff=None, landing=None):  # noqa: ANN001, ANN205
        if landing is None:
            output = torch.matmul(x, weight.t())
        else:  # x is the early output's view; the math reads the output itself
            x = landing.output
            output = _matmul_while_landing(x, weight, landing)
        ctx.save_for_backward(x, weight)
        ctx.fuse_wgrad = fuse_wgrad and has_main_grad(weight)
        ctx.handoff = handoff
        return output

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205 - autograd signature
        x, weight = ctx.saved_tensors
        # no input gradient asked for: the attention's backward will not run to take it
        handoff: Handoff | None = ctx.handoff if ctx.needs_input_grad[0] else None
        grad_input = grad_output.matmul(weight)
        if handoff is not None:
            handoff.begin(grad_input)
        grad_weight = _weight_gradient(ctx.fuse_wgrad, x, weight, grad_output)
        if handoff is not None:
            handoff.post()
        return grad_input, grad_weight, None, None, None


def project_attention_output(x: torch.Tensor, weight: Any, fuse_wgrad: bool) -> Any:
    """``x W^T`` on ``LinearFunction`` with the handoffs of the a2a attention whose output
    ``x`` is (its early output, its backward's first exchange), or None when ``x`` has none
    (the caller computes as usual)."""
    landing = take(x)
    # the handoff is offered for the plain output: reading the early view would land it now
    handoff = claim(landing.output if landing is not None else x)
    if landing is None and handoff is None:
        return None
    return LinearFunction.apply(x, weight, fuse_wgrad, handoff, landing)


def _matmul_while_landing(x: torch.Tensor, weight: Any, landing: Landing) -> torch.Tensor:
    """``x W^T`` as the GEMM over the input columns in place (the rank's own heads), then, once
    the rest have landed, the GEMMs over them added to it: the peers' heads travel meanwhile.
    In bf16 the first partial sum is rounded once more, as a tensor-parallel row linear's
    partial sums are before their all-reduce."""
    rows = x.reshape(-1, x.shape[-1])
    try:
        output = torch.mm(rows[:, landing.ready], weight[:, landing.ready].t())
    finally:  # land even if the GEMM fails: every rank's exchanges must stay paired
        landing.finish()
    for cols in landing.arriving():  # as mm's dtype under autocast, which addmm_ does not apply
        output.addmm_(rows[:, cols].to(output.dtype), weight[:, cols].t().to(output.dtype))
    return output.view(*x.shape[:-1], weight.shape[0])


def _weight_gradient(fuse: bool, x: torch.Tensor, weight: Any, grad_output: torch.Tensor) -> Any:
    """The weight's gradient for autograd: computed, or added into ``main_grad`` (then a
    placeholder where Megatron's DDP expects one, else None)."""
    if not fuse:
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        return grad_2d.t().matmul(x.reshape(-1, x.shape[-1]))
    main_grad = main_grad_for_wgrad(weight)
    wgrad_gemm_accum(x, grad_output, main_grad)
    return added_to_main_grad(weight, main_grad, x)


def added_to_main_grad(
    weight: Any, main_grad: torch.Tensor, like: torch.Tensor
) -> torch.Tensor | None:
    """What autograd gets for a weight whose gradient went into ``main_grad``: a placeholder
    of its shape (in ``like``'s dtype and device) flagged ``grad_added_to_main_grad`` where
    Megatron's DDP expects one, so that its hooks do not add it again; else None."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    weight.grad_added_to_main_grad = True
    return make(main_grad.shape, dtype=like.dtype, device=like.device)


def deliver_wgrad(
    fuse: bool,
    weight: Any,
    wgrad: torch.Tensor | None,
    like: torch.Tensor,
    main_grad: torch.Tensor | None = None,
) -> Any:
    """The weight gradient for autograd (in the weight's dtype; None: no tokens, zeros), or
    added into ``main_grad`` (``main_grad_for_wgrad``'s unless given) with Megatron's
    placeholder returned instead (``LinearFunction``'s contract)."""
    if not fuse:
        return torch.zeros_like(weight) if wgrad is None else wgrad.to(weight.dtype)
    if main_grad is None:
        main_grad = main_grad_for_wgrad(weight)
    if wgrad is not None:
        main_grad.add_(wgrad)
    return added_to_main_grad(weight, main_grad, like)


def keep_for_backward(ctx: Any, recipe: Any, x: torch.Tensor, fuse: bool, weight: Any) -> None:
    """What an FP8 linear's backward reads besides its saved tensors: the recipe, the input's
    shape and dtype, and whether the weight gradient goes into ``main_grad``."""
    ctx.recipe, ctx.x_shape, ctx.x_dtype = recipe, x.shape, x.dtype
    ctx.fuse_wgrad = fuse and has_main_grad(weight)


def wgrad_from_activations(ctx: Any, dy: torch.Tensor, x: torch.Tensor, weight: Any) -> Any:
    """``--no-fp8-wgrad``'s weight gradient: ``dy^T x`` in fp32 from the bf16 tensors,
    delivered as :func:`deliver_wgrad` delivers it."""
    return deliver_wgrad(ctx.fuse_wgrad, weight, dy.t().float() @ x.float(), dy)
