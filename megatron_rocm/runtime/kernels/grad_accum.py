"""Weight-gradient GEMM accumulated into ``main_grad``: Apex ``fused_weight_gradient_mlp_cuda``.

Megatron's ``gradient_accumulation_fusion`` (on by default in training) computes
``main_grad += grad_output^T @ total_input`` in one GEMM with ``beta=1``, straight into the fp32
main-grad buffer, so no bf16 weight gradient is materialised and rounded. Without Apex the
model build stops with a RuntimeError.

The fp32 accumulation from bf16/fp16 operands is done the cheapest way this torch allows:

1. ``torch.addmm(main_grad, a, b, out_dtype=float32, out=main_grad)`` — one GEMM, fp32
   accumulate in place (CUDA/HIP builds whose ``addmm.dtype_out`` accepts an fp32 ``self``);
2. ``main_grad.add_(torch.mm(a, b, out_dtype=float32))`` — fp32 GEMM output, one temporary of
   the weight's size (torch builds with ``mm.dtype`` only);
3. upcast both operands to fp32 (CPU, and any build without the ``out_dtype`` overloads).

Which one works is probed once per (device type, dtype) with the real call and cached; a
fallback is logged once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_rocm.runtime.kernels.launch import log_fallback_once

_Accum = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def _addmm_out_dtype(main_grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    torch.addmm(main_grad, a, b, out_dtype=torch.float32, out=main_grad)


def _mm_out_dtype(main_grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    main_grad.add_(torch.mm(a, b, out_dtype=torch.float32))


def _upcast(main_grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    main_grad.addmm_(a.float(), b.float())


_STRATEGIES: tuple[tuple[str, _Accum], ...] = (
    ("addmm(out_dtype=float32, out=main_grad)", _addmm_out_dtype),
    ("main_grad += mm(out_dtype=float32)", _mm_out_dtype),
    ("upcast operands to fp32", _upcast),
)
_chosen: dict[tuple[str, torch.dtype], int] = {}


def _gpu_gemm_overloads(x: torch.Tensor) -> bool:
    """The ``out_dtype`` GEMM overloads exist only in the CUDA/HIP backend."""
    return x.is_cuda


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    """Apex collapses leading dims: ``[s, b, h] -> [s*b, h]``."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _check(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    if total_input.dtype != grad_output.dtype:
        raise TypeError(f"input {total_input.dtype} and grad {grad_output.dtype} differ")
    expected = (grad_output.shape[-1], total_input.shape[-1])
    if tuple(main_grad.shape) != expected:
        raise ValueError(f"main_grad has shape {tuple(main_grad.shape)}, expected {expected}")


def wgrad_gemm_accum_fp32(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> None:
    """``main_grad(fp32) += grad_output^T @ total_input`` for fp32/bf16/fp16 operands."""
    _check(total_input, grad_output, main_grad)
    if main_grad.dtype != torch.float32:
        raise TypeError(f"wgrad_gemm_accum_fp32 needs an fp32 main_grad, got {main_grad.dtype}")
    a = _as_2d(grad_output).t()
    b = _as_2d(total_input)
    if b.dtype == torch.float32:
        main_grad.addmm_(a, b)
        return
    key = (b.device.type, b.dtype)
    start = _chosen.get(key, 0 if _gpu_gemm_overloads(b) else len(_STRATEGIES) - 1)
    for index in range(start, len(_STRATEGIES)):
        name, accumulate = _STRATEGIES[index]
        try:
            accumulate(main_grad, a, b)
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            if index == len(_STRATEGIES) - 1 or key in _chosen:
                raise
            log_fallback_once(f"wgrad:{key}:{index}", f"wgrad accumulation: {name} failed: {exc}")
            continue
        _chosen[key] = index
        return


def wgrad_gemm_accum_fp16(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> None:
    """``main_grad += grad_output^T @ total_input`` with ``main_grad`` in the operands' dtype."""
    _check(total_input, grad_output, main_grad)
    if main_grad.dtype != total_input.dtype:
        raise TypeError(f"main_grad {main_grad.dtype} must match the input {total_input.dtype}")
    main_grad.addmm_(_as_2d(grad_output).t(), _as_2d(total_input))


def wgrad_gemm_accum(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> None:
    """``main_grad += grad_output^T @ total_input`` through the function of ``main_grad``'s
    dtype (``wgrad_gemm_accum_fp32`` for fp32, else ``wgrad_gemm_accum_fp16``)."""
    if main_grad.dtype == torch.float32:
        wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    else:
        wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)


def has_main_grad(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s gradient has a ``main_grad`` to go into: Megatron's DDP sets one
    on the parameter; Megatron-FSDP (``__fsdp_param__``) hands it out in the backward."""
    return hasattr(weight, "main_grad") or hasattr(weight, "__fsdp_param__")


def main_grad_for_wgrad(weight: torch.Tensor) -> torch.Tensor:
    """The buffer a fused weight-gradient GEMM adds into, ready to add into.

    Megatron's DDP gives each parameter a persistent ``main_grad`` to accumulate into.
    Megatron-FSDP marks its parameters ``__fsdp_param__`` and hands the buffer out per backward
    through ``get_main_grad()``; with sharded gradients (``overwrite_main_grad``) that buffer
    must end up holding this gradient alone, as upstream's ``layers.py`` and TE (>= 2.10)
    write it, so it is zeroed first.
    """
    if hasattr(weight, "__fsdp_param__"):
        weight.main_grad = weight.get_main_grad()
        if getattr(weight, "overwrite_main_grad", False):
            weight.main_grad.zero_()
    grad = getattr(weight, "main_grad", None)
    if grad is None and callable(getattr(weight, "get_main_grad", None)):
        grad = weight.get_main_grad()
    if grad is None:
        raise RuntimeError(
            "gradient_accumulation_fusion needs weight.main_grad (set by Megatron's DDP or "
            "FSDP wrapper); build the model with gradient_accumulation_fusion=False otherwise"
        )
    return grad


def wgrad_reference(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> torch.Tensor:
    """Out-of-place fp64 oracle: ``main_grad + grad_output^T @ total_input``."""
    product = _as_2d(grad_output).double().t() @ _as_2d(total_input).double()
    return (main_grad.double() + product).to(main_grad.dtype)


def chosen_strategy(device_type: str, dtype: torch.dtype) -> str | None:
    """Which accumulation the probe settled on (benchmarks report it); None before first use."""
    index = _chosen.get((device_type, dtype))
    return None if index is None else _STRATEGIES[index][0]
