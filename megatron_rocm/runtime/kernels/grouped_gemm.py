"""Grouped matmul for MoE experts: TransformerEngine's ``GroupedLinear`` math without TE.

``grouped_mm(x, weights, m_splits)`` computes, for the token rows of each local expert,
``y_g = x_g @ W_g^T (+ b_g)`` in one grouped kernel per product instead of one GEMM per
expert (what ``SequentialMLP`` does), with the backward TE has: the input gradient, the
per-expert weight gradients, and with Megatron's gradient-accumulation fusion those weight
gradients added straight into each expert's fp32 ``main_grad``.

Implementations, picked per call (``MEGATRON_ROCM_GROUPED_GEMM=auto|torch|triton|loop``):

1. ``torch``: ``torch._grouped_mm``. Automatic only where it has a real grouped kernel: a
   CUDA build on sm90/sm100 in bf16 (elsewhere torch runs it as a per-group loop with a
   device sync). ROCm builds have one only with CK on gfx942/gfx950, which cannot be detected
   from Python, so ROCm gets ``triton`` unless ``torch`` is requested.
2. ``triton``: our Triton kernels (CUDA and ROCm; CPU under ``TRITON_INTERPRET=1``).
3. ``loop``: one ``torch.mm`` per expert: the CPU path.

An explicit request that cannot run raises; an automatic choice falls back with the reason
logged once. :func:`last_run` says which implementation the latest forward used, and how it
read the expert weights (a zero-copy strided view, in place, a stacking copy, per expert).

:func:`grouped_linear_reference` is the fp64 oracle of the parity tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_rocm.runtime import settings
from megatron_rocm.runtime.kernels import grouped_gemm_ops as ops
from megatron_rocm.runtime.kernels.grad_accum import main_grad_for_wgrad
from megatron_rocm.runtime.kernels.launch import (
    interpreting,
    is_hip,
    log_fallback_once,
    reference_forced,
    rocm_arch,
    triton_available,
)

ENV = "MEGATRON_ROCM_GROUPED_GEMM"
IMPLEMENTATIONS = settings.choices(ENV)[1:]  # after "auto"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class RunInfo:
    """What the latest :func:`grouped_mm` forward ran (benchmarks and the smoke report)."""

    implementation: str  # "torch" (torch._grouped_mm), "triton" or "loop"
    weights: str  # "strided view", "in place", "stacked" or "per expert"


_last: RunInfo | None = None


def last_run() -> RunInfo | None:
    return _last


GROUPED_MM_ROCM_ARCHS = ("gfx942", "gfx950")


def _torch_problem(x: torch.Tensor, features: tuple[int, int], automatic: bool) -> str | None:
    """Why ``torch._grouped_mm`` cannot (explicit) or should not (automatic) run; None if fine."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if any(f % (16 // x.element_size()) for f in features):
        return f"in/out features {features} are not multiples of 16 bytes"
    if not automatic:
        if is_hip() and x.is_cuda and rocm_arch(x.device) not in GROUPED_MM_ROCM_ARCHS:
            return (
                f"ROCm builds of torch have a grouped kernel only on gfx942/gfx950 (CK); on "
                f"{rocm_arch(x.device) or 'this GPU'} it is a per-expert loop with a device sync"
            )
        return None
    if is_hip():
        return "ROCm builds have a grouped kernel only with CK on gfx942/gfx950 (request torch)"
    if not x.is_cuda:
        return "the tensors are not on a GPU"
    if x.dtype != torch.bfloat16:
        return f"its grouped kernel is bf16-only, got {x.dtype}"
    major, _ = torch.cuda.get_device_capability(x.device)
    if major not in (9, 10):
        return f"its grouped kernel needs sm90/sm100, this GPU is sm{major}x"
    return None


def _triton_problem(x: torch.Tensor) -> str | None:
    if not triton_available():
        return "Triton is not importable"
    if not (x.is_cuda or interpreting()):
        return "the tensors are not on a GPU (TRITON_INTERPRET=1 runs Triton on the CPU)"
    return None


def requested_implementation() -> str:
    """What ``MEGATRON_ROCM_GROUPED_GEMM`` asks for: auto (the default), torch, triton or loop."""
    return str(settings.get(ENV))


def choose(x: torch.Tensor, features: tuple[int, int], requested: str | None = None) -> str:
    """The implementation for ``x`` and weights of ``features = (out, in)``.

    ``requested`` (or ``$MEGATRON_ROCM_GROUPED_GEMM``) names one: it runs or this raises.
    """
    # an explicit request is checked by the same grammar as the environment variable
    wanted = (
        str(settings.parse(ENV, requested.strip())) if requested else requested_implementation()
    )
    if wanted == "auto" and reference_forced("grouped_gemm"):
        return "loop"
    checks = {
        "torch": lambda auto: _torch_problem(x, features, auto),
        "triton": lambda auto: _triton_problem(x),
        "loop": lambda auto: None,
    }
    if wanted in checks:
        problem = checks[wanted](False)
        if problem:
            raise RuntimeError(
                f"grouped GEMM {wanted!r} was requested but cannot run: {problem} "
                f"({ENV}=auto chooses what can)"
            )
        return wanted
    for name in ("torch", "triton"):
        problem = checks[name](True)
        if problem is None:
            return name
        log_fallback_once(f"grouped-gemm:{name}:{problem}", f"grouped GEMM: not {name}: {problem}")
    return "loop"


@dataclass(frozen=True)
class _Plan:
    impl: str
    splits: ops.Splits
    n_weights: int
    packed: bool  # one [G, out, in] tensor instead of G parameters
    fuse_wgrad: bool


def _placeholders(weights: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """Weight "gradients" after fused accumulation, as Megatron's DDP expects them.

    Megatron's hooks need a gradient to fire and skip adding it when the parameter says
    ``grad_added_to_main_grad``. Like TE, return uninitialised (or, with ``zero_out_wgrad``,
    zero) tensors, but one allocation shared by all experts: each gets its own view, so
    autograd hands it over without a copy.
    """
    flagged = [w for w in weights if hasattr(w, "grad_added_to_main_grad")]
    if not flagged:
        return [None] * len(weights)
    zero = any(getattr(w, "zero_out_wgrad", False) for w in flagged)
    w0 = flagged[0]
    shared = (torch.zeros if zero else torch.empty)(w0.shape, dtype=w0.dtype, device=w0.device)
    out: list[torch.Tensor | None] = []
    for w in weights:
        if hasattr(w, "grad_added_to_main_grad"):
            w.grad_added_to_main_grad = True
            out.append(shared.view(w.shape))
        else:
            out.append(None)
    return out


def _experts(plan: _Plan, weights: Sequence[torch.Tensor], dtype: torch.dtype) -> ops.Matrices:
    mats = list(weights[0].unbind(0)) if plan.packed else list(weights)
    if mats[0].dtype != dtype:  # TE computes in the activation dtype
        mats = [m.to(dtype) for m in mats]
    return ops.Matrices(mats)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: _Plan, *params: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        global _last
        weights, biases = params[: plan.n_weights], params[plan.n_weights :]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        experts = _experts(plan, weights, x.dtype)
        if plan.splits.total == 0:
            out, how = x2.new_zeros(0, experts.shape[0]), "none (no tokens)"
        else:
            out, how = ops.FORWARD[plan.impl](x2, experts, plan.splits)
            if biases:
                rows = torch.stack([b.to(out.dtype) for b in biases])
                out += torch.repeat_interleave(
                    rows, plan.splits.counts_tensor(), dim=0, output_size=out.shape[0]
                )
        _last = RunInfo(plan.impl, how)
        ctx.plan, ctx.x_shape = plan, x.shape
        ctx.save_for_backward(x2, *weights)
        ctx.bias_dtypes = [b.dtype for b in biases]
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # noqa: ANN001, ANN205 - autograd signature
        plan: _Plan = ctx.plan
        x2, *weights = ctx.saved_tensors
        dy = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        experts = _experts(plan, weights, dy.dtype)
        s, empty = plan.splits, plan.splits.total == 0
        needs = ctx.needs_input_grad
        dx = None
        if needs[0]:
            dx = x2.new_zeros(x2.shape) if empty else ops.DGRAD[plan.impl](dy, experts, s)[0]
            dx = dx.view(ctx.x_shape)
        wgrads: list[torch.Tensor | None] = [None] * plan.n_weights
        if any(needs[2 : 2 + plan.n_weights]):
            if plan.fuse_wgrad:
                grads = [main_grad_for_wgrad(w) for w in weights]
                main = ops.Matrices(list(grads[0].unbind(0)) if plan.packed else grads)
                if not empty:
                    ops.wgrad_accumulate(plan.impl, dy, x2, s, main)
                wgrads = _placeholders(weights)
            else:
                dtype = weights[0].dtype
                if empty:
                    full = dy.new_zeros(len(s.counts), *experts.shape, dtype=dtype)
                else:
                    full = ops.wgrad(plan.impl, dy, x2, s, dtype)
                wgrads = [full] if plan.packed else list(full.unbind(0))
        bgrads: list[torch.Tensor | None] = [None] * len(ctx.bias_dtypes)
        if any(needs[2 + plan.n_weights :]):
            sums = torch.segment_reduce(
                dy.float(), "sum", lengths=s.counts_tensor(), axis=0, unsafe=True, initial=0
            )
            bgrads = [row.to(dt) for row, dt in zip(sums.unbind(0), ctx.bias_dtypes)]
        return (dx, None, *wgrads, *bgrads)


def _split_list(m_splits: Sequence[int] | torch.Tensor, groups: int) -> tuple[int, ...]:
    counts = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits)
    if len(counts) != groups:
        raise ValueError(f"grouped GEMM: {len(counts)} splits for {groups} experts")
    if any(int(c) < 0 for c in counts):
        raise ValueError(f"grouped GEMM: negative split in {counts}")
    return tuple(int(c) for c in counts)


def grouped_mm(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor] | torch.Tensor,
    m_splits: Sequence[int] | torch.Tensor,
    *,
    bias: Sequence[torch.Tensor] | None = None,
    fuse_wgrad_accumulation: bool = False,
    implementation: str | None = None,
) -> torch.Tensor:
    """``y[rows of expert g] = x[rows of g] @ weights[g]^T (+ bias[g])``: ``[tokens, out]``.

    ``x`` is ``[tokens, in]`` (or ``[..., in]``, flattened) with rows grouped by expert,
    ``m_splits`` the rows per expert (host ints; a tensor is read with ``.tolist()``), and
    ``weights`` the experts' ``[out, in]`` matrices (a sequence, TE's ``weight0..``, or one
    ``[G, out, in]`` tensor). Differentiable in ``x``, ``weights`` and ``bias``. With
    ``fuse_wgrad_accumulation`` the weight gradients are added into each weight's
    ``main_grad`` instead, as TE and Megatron's fused wgrad do.
    """
    packed = isinstance(weights, torch.Tensor)
    if packed and weights.dim() != 3:
        raise ValueError(f"grouped GEMM: packed weights must be [G, out, in], got {weights.shape}")
    groups = weights.shape[0] if packed else len(weights)
    if groups == 0:
        raise ValueError("grouped GEMM: no experts")
    first = weights[0]
    if x.shape[-1] != first.shape[-1]:
        raise ValueError(f"grouped GEMM: input has {x.shape[-1]} features, weights {first.shape}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"grouped GEMM: unsupported dtype {x.dtype}")
    splits = ops.Splits(_split_list(m_splits, groups), x.device)
    if splits.total != x.numel() // max(x.shape[-1], 1):
        rows = x.numel() // x.shape[-1]
        raise ValueError(f"grouped GEMM: splits sum to {splits.total}, the input has {rows} rows")
    impl = choose(x, tuple(first.shape), implementation)
    plan = _Plan(impl, splits, 1 if packed else groups, packed, fuse_wgrad_accumulation)
    params = [weights] if packed else list(weights)
    return _GroupedLinear.apply(x, plan, *params, *(bias or ()))


def grouped_linear_reference(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    m_splits: Sequence[int],
    bias: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The oracle: the per-expert loop in fp64 (differentiable), cast back to ``x.dtype``."""
    x2 = x.reshape(-1, x.shape[-1]).double()
    parts = []
    for g, rows in enumerate(x2.split(list(m_splits))):
        y = rows @ weights[g].double().t()
        if bias is not None:
            y = y + bias[g].double()
        parts.append(y)
    out = torch.cat(parts)
    return out.view(*x.shape[:-1], weights[0].shape[0]).to(x.dtype)
