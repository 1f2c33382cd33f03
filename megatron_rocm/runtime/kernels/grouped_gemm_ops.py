"""The three grouped-GEMM backends behind :mod:`megatron_rocm.runtime.kernels.grouped_gemm`.

Each backend provides the three products of a grouped linear layer, for ``x`` rows grouped by
expert (``splits``) and expert weights ``W_g`` of shape ``[out, in]``:

* ``forward``: ``y_g = x_g @ W_g^T``;
* ``dgrad``:   ``dx_g = dy_g @ W_g``;
* ``wgrad``:   ``dW_g = dy_g^T @ x_g`` (zeros for an expert without tokens), returned, or
  added into each expert's ``main_grad`` (Megatron's gradient-accumulation fusion).

Backends: ``torch`` (``torch._grouped_mm``: one CUTLASS kernel on sm90/sm100 in bf16),
``triton`` (:mod:`._grouped_gemm_triton`, CUDA and ROCm) and ``loop`` (one ``torch.mm`` per
expert: the CPU path and what ``SequentialMLP`` does).

The expert weights arrive as separate parameters (TE's ``weight0..weight{n-1}``).
``torch._grouped_mm`` needs one 3-D tensor: when the parameters are equally spaced views of one
storage (how :class:`TEGroupedLinear` allocates them) that is a free ``as_strided`` view,
otherwise a stacking copy per call. Triton reads them where they are, whatever the spacing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_rocm.runtime.kernels.grad_accum import wgrad_gemm_accum

_CACHE_SIZE = 256  # device-side index tensors kept: per call shape and per weight layout


def _device_tensor(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without a blocking copy (pinned, non-blocking)."""
    cpu = torch.tensor(list(values), dtype=dtype)
    if device.type == "cuda":
        return cpu.pin_memory().to(device, non_blocking=True)
    return cpu.to(device)


class _LRU(OrderedDict):
    def fetch(self, key: object, make) -> torch.Tensor:  # noqa: ANN001 - a zero-arg factory
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = self[key] = make()
        if len(self) > _CACHE_SIZE:
            self.popitem(last=False)
        return value


_index_cache = _LRU()


@dataclass(frozen=True)
class Splits:
    """Rows per expert (host ints, as Megatron passes them) and their device-side forms."""

    counts: tuple[int, ...]
    device: torch.device

    @property
    def total(self) -> int:
        return sum(self.counts)

    def offsets(self) -> torch.Tensor:
        """int32 end row of each group (``torch._grouped_mm``'s ``offs``), cached per call shape."""
        ends, running = [], 0
        for count in self.counts:
            running += count
            ends.append(running)
        key = ("offs", self.counts, self.device)
        return _index_cache.fetch(key, lambda: _device_tensor(ends, torch.int32, self.device))

    def counts_tensor(self) -> torch.Tensor:
        key = ("counts", self.counts, self.device)
        return _index_cache.fetch(
            key, lambda: _device_tensor(self.counts, torch.int64, self.device)
        )


class Matrices:
    """``G`` same-shape 2-D tensors (expert weights or their ``main_grad``), read in place."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = [t.detach() for t in tensors]
        first = self.tensors[0]
        if any(t.shape != first.shape or t.dtype != first.dtype for t in self.tensors):
            raise ValueError("grouped GEMM: all experts' matrices must share shape and dtype")
        self.shape: tuple[int, int] = tuple(first.shape)  # type: ignore[assignment]
        self.dtype = first.dtype

    def __len__(self) -> int:
        return len(self.tensors)

    def _one_storage(self) -> bool:
        first = self.tensors[0]
        ptr = first.untyped_storage().data_ptr()
        return all(
            t.untyped_storage().data_ptr() == ptr and t.stride() == first.stride()
            for t in self.tensors
        )

    def view3d(self) -> torch.Tensor | None:
        """A zero-copy ``[G, r, c]`` view when the matrices are equally spaced, ascending."""
        first = self.tensors[0]
        if len(self.tensors) == 1:
            return first.unsqueeze(0)
        if not self._one_storage():
            return None
        step = self.tensors[1].storage_offset() - first.storage_offset()
        if step <= 0 or any(
            t.storage_offset() - first.storage_offset() != i * step
            for i, t in enumerate(self.tensors)
        ):
            return None
        return first.as_strided((len(self.tensors), *self.shape), (step, *first.stride()))

    def stacked(self) -> torch.Tensor:
        return torch.stack(self.tensors)

    def strided(self):  # noqa: ANN201 - returns _grouped_gemm_triton.Strided | None
        """Base + per-matrix element offsets (any spacing or order), for the Triton kernels."""
        from megatron_rocm.runtime.kernels.grouped_gemm_triton import Strided

        if not self._one_storage():
            return None
        first = self.tensors[0]
        base = first.as_strided((1,), (1,), 0)  # the storage start
        starts = tuple(t.storage_offset() for t in self.tensors)
        key = ("layout", first.untyped_storage().data_ptr(), starts, first.device)
        offsets = _index_cache.fetch(key, lambda: _device_tensor(starts, torch.int64, first.device))
        vector = 16 // first.element_size()  # elements per 16-byte load
        align = vector if all(start % vector == 0 for start in starts) else 1
        return Strided(base, offsets, tuple(first.stride()), align)  # type: ignore[arg-type]

    def strided_or_stacked(self):  # noqa: ANN201
        found = self.strided()
        if found is not None:
            return found, "in place"
        return Matrices(list(self.stacked().unbind(0))).strided(), "stacked"


# -- torch._grouped_mm ----------------------------------------------------------------------


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` needs 16-byte aligned operands (a slice may start anywhere)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _weights3d(w: Matrices) -> tuple[torch.Tensor, str]:
    view = w.view3d()
    if view is not None and view.data_ptr() % 16 == 0:
        return view, "strided view"
    return w.stacked(), "stacked"


def torch_forward(x: torch.Tensor, w: Matrices, s: Splits) -> tuple[torch.Tensor, str]:
    w3, how = _weights3d(w)
    return torch._grouped_mm(_aligned(x), w3.transpose(1, 2), offs=s.offsets()), how


def torch_dgrad(dy: torch.Tensor, w: Matrices, s: Splits) -> tuple[torch.Tensor, str]:
    w3, how = _weights3d(w)
    return torch._grouped_mm(_aligned(dy), w3, offs=s.offsets()), how


def torch_wgrad(dy: torch.Tensor, x: torch.Tensor, s: Splits) -> torch.Tensor:
    grads = torch._grouped_mm(_aligned(dy).t(), _aligned(x), offs=s.offsets())
    for g, count in enumerate(s.counts):
        if count == 0:  # no rows: make the empty product's zeros explicit
            grads[g].zero_()
    return grads


# -- Triton ---------------------------------------------------------------------------------


def triton_forward(x: torch.Tensor, w: Matrices, s: Splits) -> tuple[torch.Tensor, str]:
    from megatron_rocm.runtime.kernels import grouped_gemm_triton as tri

    b, how = w.strided_or_stacked()
    b_t = tri.Strided(b.base, b.offsets, (b.strides[1], b.strides[0]), b.align)  # B_g = W_g^T
    return tri.gmm(x, b_t, (w.shape[1], w.shape[0]), s.offsets(), list(s.counts)), how


def triton_dgrad(dy: torch.Tensor, w: Matrices, s: Splits) -> tuple[torch.Tensor, str]:
    from megatron_rocm.runtime.kernels import grouped_gemm_triton as tri

    b, how = w.strided_or_stacked()
    return tri.gmm(dy, b, w.shape, s.offsets(), list(s.counts)), how


def triton_wgrad_into(
    dy: torch.Tensor, x: torch.Tensor, s: Splits, out: Matrices, accumulate: bool
) -> bool:
    """Write (or add) the weight gradients into ``out`` in place; False if it cannot."""
    from megatron_rocm.runtime.kernels import grouped_gemm_triton as tri

    c = out.strided()
    if c is None:
        return False
    tri.gmm_wgrad(dy, x, c, s.offsets(), len(out), accumulate)
    return True


def triton_wgrad(dy: torch.Tensor, x: torch.Tensor, s: Splits, dtype: torch.dtype) -> torch.Tensor:
    grads = torch.empty(len(s.counts), dy.shape[1], x.shape[1], dtype=dtype, device=x.device)
    triton_wgrad_into(dy, x, s, Matrices(list(grads.unbind(0))), accumulate=False)
    return grads


# -- per-expert loop ------------------------------------------------------------------------


def loop_forward(x: torch.Tensor, w: Matrices, s: Splits) -> tuple[torch.Tensor, str]:
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    for xs, ws, os_ in zip(x.split(s.counts), w.tensors, out.split(s.counts)):
        if xs.shape[0]:
            torch.mm(xs, ws.t(), out=os_)
    return out, "per expert"


def loop_dgrad(dy: torch.Tensor, w: Matrices, s: Splits) -> tuple[torch.Tensor, str]:
    out = torch.empty(dy.shape[0], w.shape[1], dtype=dy.dtype, device=dy.device)
    for ds, ws, os_ in zip(dy.split(s.counts), w.tensors, out.split(s.counts)):
        if ds.shape[0]:
            torch.mm(ds, ws, out=os_)
    return out, "per expert"


def loop_wgrad(dy: torch.Tensor, x: torch.Tensor, s: Splits, dtype: torch.dtype) -> torch.Tensor:
    grads = torch.zeros(len(s.counts), dy.shape[1], x.shape[1], dtype=dtype, device=x.device)
    for g, (ds, xs) in enumerate(zip(dy.split(s.counts), x.split(s.counts))):
        if ds.shape[0]:
            grads[g] = ds.t() @ xs
    return grads


def loop_wgrad_accumulate(dy: torch.Tensor, x: torch.Tensor, s: Splits, out: Matrices) -> None:
    for ds, xs, main_grad in zip(dy.split(s.counts), x.split(s.counts), out.tensors):
        if ds.shape[0]:
            wgrad_gemm_accum(xs, ds, main_grad)


# -- dispatch -------------------------------------------------------------------------------

FORWARD = {"torch": torch_forward, "triton": triton_forward, "loop": loop_forward}
DGRAD = {"torch": torch_dgrad, "triton": triton_dgrad, "loop": loop_dgrad}


def wgrad(impl: str, dy: torch.Tensor, x: torch.Tensor, s: Splits, dtype: torch.dtype):  # noqa: ANN201
    """``[G, out, in]`` weight gradients in ``dtype`` (fp32 accumulation where the backend can)."""
    if impl == "torch":
        return torch_wgrad(dy, x, s).to(dtype)
    if impl == "triton":
        return triton_wgrad(dy, x, s, dtype)
    return loop_wgrad(dy, x, s, dtype)


def wgrad_accumulate(
    impl: str, dy: torch.Tensor, x: torch.Tensor, s: Splits, out: Matrices
) -> None:
    """``out_g += dy_g^T @ x_g`` for every expert (``out`` = the experts' ``main_grad``)."""
    if impl == "loop":
        loop_wgrad_accumulate(dy, x, s, out)
        return
    if impl == "triton" and triton_wgrad_into(dy, x, s, out, accumulate=True):
        return
    grads = torch_wgrad(dy, x, s) if impl == "torch" else triton_wgrad(dy, x, s, torch.float32)
    view = out.view3d()
    if view is not None:
        view.add_(grads)
    else:
        torch._foreach_add_(out.tensors, list(grads.unbind(0)))
