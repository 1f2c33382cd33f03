"""Triton kernels of SwiGLU, ``silu(y1) * y2`` with ``y = [y1 | y2]`` split on the last dim.

Imported lazily by :mod:`megatron_rocm.runtime.kernels.swiglu`, so the package imports without
Triton. The input is a contiguous ``[rows, 2F]`` tensor; each program takes ``BLOCK``
consecutive elements of the ``[rows, F]`` output (flat indexing: no lanes lost to a row's
ragged end) and finds ``y1``/``y2`` at ``row * 2F + col`` and ``+ F``, so every element is
read and written exactly once:

* ``_forward``: reads ``y1``, ``y2``; writes ``out``.
* ``_backward``: reads ``g``, ``y1``, ``y2``; writes ``dy1``, ``dy2`` into the two halves of
  one ``[rows, 2F]`` tensor. upstream's compiled ``swiglu_back`` builds the same tensor with a
  ``torch.cat`` and runs at 93% of copy bandwidth on an H100, this at 100%; the forwards tie
  (``scripts/bench/swiglu.py``, ``docs/kernels.md``). A per-row 2-D grid was measured at 97%
  both ways and dropped.

Math in fp32, rounded once to the input's dtype, as upstream's compiled functions do
(``s = sigmoid(y1)``)::

    out = y1 * s * y2
    dy1 = g * s * (1 + y1 * (1 - s)) * y2        dy2 = g * y1 * s
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_rocm.runtime.kernels import aot
from megatron_rocm.runtime.kernels.launch import cdiv

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _offsets(n, columns, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """This program's output elements ``i`` (of ``n``), their mask, and where ``y1[row, col]``
    of each sits in the ``[rows, 2F]`` input (``y2`` is ``columns`` further)."""
    program = tl.program_id(0)
    if WIDE:
        program = program.to(tl.int64)
    i = program * BLOCK + tl.arange(0, BLOCK)
    return i, i < n, i + (i // columns) * columns


@triton.jit
def _forward(y, out, n, columns, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    i, mask, at = _offsets(n, columns, BLOCK, WIDE)
    a = tl.load(y + at, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(y + at + columns, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + i, (a * tl.sigmoid(a) * b).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _backward(g, y, dy, n, columns, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    i, mask, at = _offsets(n, columns, BLOCK, WIDE)
    grad = tl.load(g + i, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(y + at, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(y + at + columns, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    da = grad * s * (1.0 + a * (1.0 - s)) * b
    db = grad * a * s
    tl.store(dy + at, da.to(dy.dtype.element_ty), mask=mask)
    tl.store(dy + at + columns, db.to(dy.dtype.element_ty), mask=mask)


BLOCK = 1024


def needs_int64(n: int) -> bool:
    """Offsets reach 2n (the input has 2F columns per row): int64 once that passes int32."""
    return n + BLOCK >= 2**30


def _launch(kernel: triton.JITFunction, n: int, *args: object) -> None:
    kernel[(cdiv(n, BLOCK),)](*args, BLOCK=BLOCK, WIDE=needs_int64(n), num_warps=4)


def _require_contiguous(*tensors: torch.Tensor) -> None:
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("the SwiGLU kernels take contiguous tensors (kernels.swiglu checks)")


def swiglu_forward(y2d: torch.Tensor) -> torch.Tensor:
    """``silu(y1) * y2`` of a ``[rows, 2F]`` tensor whose rows are contiguous."""
    rows, columns = y2d.shape[0], y2d.shape[1] // 2
    _require_contiguous(y2d)
    out = torch.empty((rows, columns), dtype=y2d.dtype, device=y2d.device)
    if out.numel():
        _launch(_forward, out.numel(), y2d, out, out.numel(), columns)
    return out


def swiglu_backward(g2d: torch.Tensor, y2d: torch.Tensor) -> torch.Tensor:
    """``d(silu(y1) * y2) / dy`` for the output gradient ``g2d`` (``[rows, F]``)."""
    columns = y2d.shape[1] // 2
    _require_contiguous(y2d, g2d)
    dy = torch.empty_like(y2d)
    if g2d.numel():
        _launch(_backward, g2d.numel(), g2d, y2d, dy, g2d.numel(), columns)
    return dy


def aot_configs(shapes: aot.Shapes) -> list[aot.Launch]:
    """Both launches for every FFN width and dtype, int32 and int64 offsets."""
    out = []
    for ffn, dt in ((f, d) for f in shapes.ffn_hiddens for d in shapes.dtypes):
        n = max(shapes.seq_lens) * max(shapes.batch) * ffn
        for wide in sorted({needs_int64(n), False}):
            consts = dict(BLOCK=BLOCK, WIDE=wide)
            grid = (cdiv(n, BLOCK),)
            out.append(
                aot.launch(_forward, consts, ptrs=dict(y=dt, out=dt), num_warps=4, grid=grid)
            )
            out.append(
                aot.launch(_backward, consts, ptrs=dict(g=dt, y=dt, dy=dt), num_warps=4, grid=grid)
            )
    return out
