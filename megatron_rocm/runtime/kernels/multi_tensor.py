"""Drop-ins for Apex's ``multi_tensor_applier`` and ``amp_C.multi_tensor_{l2norm,scale}``.

Upstream's no-Apex fallback (``megatron/core/utils.py`` ``local_multi_tensor_*``) launches one
norm per tensor and then reads every norm back to the host (``torch.tensor(list_of_cuda
scalars)``, ``float(...)``): a device sync per gradient-norm computation, and a Python loop of
copies per main-to-model parameter copy. These use torch's multi-tensor ``_foreach_*`` kernels
and keep every result, including Apex's overflow flag, on the device.

Semantics kept from amp_C:

* ``multi_tensor_l2norm`` returns ``(total_norm[1] fp32, per_tensor_norms)``; the second is an
  fp32 tensor of one norm per tensor when ``per_tensor`` is true, else an empty fp32 tensor;
  a non-finite norm sets ``noop_flag`` to 1;
* ``multi_tensor_scale`` writes ``dst = src * scale`` (any dtype pair; ``src`` may be ``dst``)
  and sets ``noop_flag`` to 1 when any *input* element is inf/nan — the output is still
  written, as in amp_C. In place on fp32/fp16 tensors (``clip_grad_by_total_norm_fp32``'s
  ``[grads, grads]`` on the fp32 main grads) that is one pass, torch's
  ``_amp_foreach_non_finite_check_and_unscale_`` (the grad scaler's kernel: it checks each
  input element and writes it times the scale); otherwise a max-abs pass over the inputs and
  then the scaled copy;
* ``chunk_size`` is Apex's launch granularity and has no meaning here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

TensorLists = Sequence[Sequence[torch.Tensor]]

_CHUNK_SIZE = 2048 * 32  # Apex's default, passed on for signature compatibility only


class MultiTensorApply:
    """Apex's ``MultiTensorApply``: ``applier(op, noop_flag, tensor_lists, *args)``."""

    available = True
    warned = False

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    def __call__(
        self,
        op: Callable[..., Any],
        noop_flag_buffer: torch.Tensor,
        tensor_lists: TensorLists,
        *args: Any,
    ) -> Any:
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(_CHUNK_SIZE)


def _flag_nonfinite(noop_flag: torch.Tensor, nonfinite: torch.Tensor) -> None:
    """``noop_flag = 1`` where ``nonfinite``, on the device and without reading it back."""
    hit = nonfinite.reshape(-1).any().to(device=noop_flag.device, dtype=noop_flag.dtype)
    noop_flag.copy_(torch.maximum(noop_flag, hit.expand_as(noop_flag)))


def _fp32_norms(tensors: Sequence[torch.Tensor], ord: float) -> list[torch.Tensor]:
    """Per-tensor norms accumulated and returned in fp32 (a bf16 norm would round)."""
    try:
        return list(torch._foreach_norm(tensors, ord, dtype=torch.float32))
    except TypeError:  # torch without the dtype argument
        return list(torch._foreach_norm([t.float() for t in tensors], ord))


def multi_tensor_l2norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: TensorLists,
    per_tensor: bool = False,
    *args: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """L2 norm over all tensors of ``tensor_lists[0]`` as if they were one flat vector."""
    tensors = list(tensor_lists[0])
    device = tensors[0].device if tensors else noop_flag.device
    if not tensors:
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        return torch.zeros(1, dtype=torch.float32, device=device), empty
    norms = torch.stack(_fp32_norms(tensors, 2.0))
    total = torch.linalg.vector_norm(norms).reshape(1)
    _flag_nonfinite(noop_flag, ~torch.isfinite(total))
    if per_tensor:
        return total, norms
    return total, torch.zeros(0, dtype=torch.float32, device=device)


# The dtypes torch's one-pass check-and-scale takes on a GPU (its CUDA/HIP kernel has no bf16).
_CHECKED_SCALE_DTYPES = (torch.float32, torch.float16)


def _scale_in_place_checked(
    tensors: list[torch.Tensor], noop_flag: torch.Tensor, scale: float | torch.Tensor
) -> bool:
    """``t *= scale`` and the non-finite check of the inputs in one pass per (device, dtype)
    group; False (nothing done) where torch lacks the op or a tensor has a dtype its GPU kernel
    does not take (bf16: CUDA and ROCm builds dispatch float, double and half only)."""
    op = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    if op is None or any(t.dtype not in _CHECKED_SCALE_DTYPES for t in tensors):
        return False
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    for (device, _), group in groups.items():
        found = torch.zeros(1, dtype=torch.float32, device=device)
        if isinstance(scale, torch.Tensor):
            factor = scale.reshape(1).to(device=device, dtype=torch.float32)
        else:
            factor = torch.full((1,), scale, dtype=torch.float32, device=device)
        op(group, found, factor)
        _flag_nonfinite(noop_flag, found > 0)
    return True


def _scale(noop_flag: torch.Tensor, tensor_lists: TensorLists, scale: float | torch.Tensor) -> None:
    src, dst = list(tensor_lists[0]), list(tensor_lists[1])
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source tensors but {len(dst)} destinations")
    if not src:
        return
    in_place = all(s is d for s, d in zip(src, dst))
    if in_place and _scale_in_place_checked(dst, noop_flag, scale):
        return
    checked = [t for t in src if t.numel()]
    if checked:
        # Max-abs propagates inf and nan, and unlike a sum of squares never overflows.
        peaks = torch.stack(torch._foreach_norm(checked, float("inf")))
        _flag_nonfinite(noop_flag, ~torch.isfinite(peaks))
    if in_place:
        torch._foreach_mul_(dst, scale)
    elif not isinstance(scale, torch.Tensor) and scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def multi_tensor_scale(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, scale: float
) -> None:
    """``tensor_lists[1][i] = tensor_lists[0][i] * scale`` for every ``i``."""
    _scale(noop_flag, tensor_lists, float(scale))


def multi_tensor_scale_tensor(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, scale: torch.Tensor
) -> None:
    """TE's variant with a device-resident ``scale`` (clip coefficient without a host sync)."""
    _scale(noop_flag, tensor_lists, scale.reshape(()).float())


def l2norm_reference(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Flatten-and-norm in fp64: the parity oracle."""
    if not tensors:
        return torch.zeros(1, dtype=torch.float64)
    flat = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    return torch.linalg.vector_norm(flat).reshape(1)
