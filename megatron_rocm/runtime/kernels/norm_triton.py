"""Triton kernels of LayerNorm and RMSNorm over the last dimension, CUDA and ROCm.

Imported lazily by :mod:`megatron_rocm.runtime.kernels.norm`, so the package imports without
Triton. Rows are ``x.reshape(-1, columns)``; one row fits one block (``columns <=
MAX_COLUMNS``), so each row is read once per pass:

* ``_forward``: one program per row; statistics in fp32, ``y = (x - mean) * rstd * w (+ b)``
  rounded once to ``x``'s dtype; keeps one fp32 ``rstd`` (and ``mean`` for LayerNorm) per row.
* ``_backward``: a fixed number of programs (a few per SM), each walking a contiguous range of
  rows: it writes ``dx`` row by row and sums ``dy * xhat`` (and ``dy``) for its rows in fp32
  registers, then stores one partial ``dw`` (``db``) row; the partials are summed by torch.
  torch's own backward runs two kernels and reads ``x`` and ``dy`` twice (once for ``dx``,
  once for the column sums of ``dw``); this reads each once.

Math (``xhat = (x - mean) * rstd``, ``g = w * dy``; RMSNorm has ``mean = 0``)::

    dx = rstd * (g - xhat * mean(g * xhat) - mean(g))     (RMSNorm: no ``mean(g)`` term)
    dw = sum_rows(dy * xhat)        db = sum_rows(dy)
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from megatron_rocm.runtime.kernels import aot
from megatron_rocm.runtime.kernels.launch import cdiv, is_hip, sm_count

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# One row per block: a wider row would spill registers (hidden sizes of real models are far
# below this); wider rows take torch's kernels.
MAX_COLUMNS = 32768
# AMD: at most 16 waves of 64 lanes (1024 threads) hold a row, so the backward's pipelined
# loop spills to scratch from 16384 columns on gfx942/gfx90a (AMD compile gate, CPU-built).
HIP_MAX_COLUMNS = 8192
# Backward programs per SM: enough rows in flight to hide memory latency, few enough that the
# fp32 partial sums stay small (programs x columns x 4 bytes).
PROGRAMS_PER_SM = 4
# Software-pipelining depth of the backward's row loop (``tl.range(num_stages=...)``).
BACKWARD_STAGES = 3


def max_columns() -> int:
    """The widest row the Triton kernels take on this platform; wider rows take torch's."""
    return HIP_MAX_COLUMNS if is_hip() else MAX_COLUMNS


def _block(columns: int) -> int:
    return triton.next_power_of_2(columns)


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


@triton.jit
def _forward(
    x,
    w,
    b,
    y,
    mean_out,
    rstd_out,
    x_stride,
    y_stride,
    columns,
    eps,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < columns
    xv = tl.load(x + row * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = xv
    else:
        mean = tl.sum(xv, axis=0) / columns
        xc = tl.where(inside, xv - mean, 0.0)
        tl.store(mean_out + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / columns + eps)
    tl.store(rstd_out + row, rstd)
    out = xc * rstd * tl.load(w + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        out += tl.load(b + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y + row * y_stride + cols, out.to(y.dtype.element_ty), mask=inside)


@triton.jit
def _backward(
    dy,
    x,
    w,
    mean_in,
    rstd_in,
    dx,
    dw_part,
    db_part,
    rows,
    rows_per_program,
    dy_stride,
    x_stride,
    dx_stride,
    columns,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < columns
    wv = tl.load(w + cols, mask=inside, other=0.0).to(tl.float32)
    dw_sum = tl.zeros([BLOCK], tl.float32)
    db_sum = tl.zeros([BLOCK], tl.float32)
    first = program.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, rows)
    # Pipelined: the next rows' loads are issued while this row is reduced and stored.
    for row in tl.range(first, last, num_stages=STAGES):
        xv = tl.load(x + row * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
        dyv = tl.load(dy + row * dy_stride + cols, mask=inside, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_in + row)
        if IS_RMS:
            xhat = xv * rstd
        else:
            xhat = tl.where(inside, (xv - tl.load(mean_in + row)) * rstd, 0.0)
        g = wv * dyv
        grad = g - xhat * (tl.sum(g * xhat, axis=0) / columns)
        if not IS_RMS:
            grad -= tl.sum(g, axis=0) / columns
        tl.store(dx + row * dx_stride + cols, (grad * rstd).to(dx.dtype.element_ty), mask=inside)
        dw_sum += dyv * xhat
        if HAS_BIAS:
            db_sum += dyv
    tl.store(dw_part + program * columns + cols, dw_sum, mask=inside)
    if HAS_BIAS:
        tl.store(db_part + program * columns + cols, db_sum, mask=inside)


def norm_forward(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, is_rms: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, rstd)`` for ``x2d[rows, columns]`` (last dim contiguous); RMSNorm has no
    mean and returns ``rstd`` in its place (never read). Few host-side ops on purpose: at the
    benchmark's size a norm is ~0.1 ms of GPU time, so launch overhead shows."""
    rows, columns = x2d.shape
    y = torch.empty_like(x2d)
    rstd = torch.empty(rows, dtype=torch.float32, device=x2d.device)
    mean = rstd if is_rms else torch.empty(rows, dtype=torch.float32, device=x2d.device)
    if rows:
        block = _block(columns)
        _forward[(rows,)](
            x2d,
            weight,
            weight if bias is None else bias,
            y,
            mean,
            rstd,
            x2d.stride(0),
            y.stride(0),
            columns,
            eps,
            IS_RMS=is_rms,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            num_warps=_warps(block),
        )
    return y, mean, rstd


def backward_programs(x2d: torch.Tensor) -> int:
    """How many programs the backward runs: a few per SM (per "SM" of the CPU interpreter)."""
    return PROGRAMS_PER_SM * sm_count(x2d.device)


def norm_backward(
    dy2d: torch.Tensor,
    x2d: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    has_bias: bool,
    is_rms: bool,
    programs: int | None = None,
    stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dx, dw, db)``: ``dx`` in ``x``'s dtype, ``dw``/``db`` summed in fp32 and returned in
    the weight's dtype (``db`` is None without a bias). ``programs`` and ``stages`` override
    ``PROGRAMS_PER_SM`` and ``BACKWARD_STAGES`` (``scripts/bench/norm.py`` sweeps them)."""
    rows, columns = x2d.shape
    dx = torch.empty_like(x2d)
    programs = max(1, min(rows, programs or backward_programs(x2d)))
    if not rows:
        zeros = torch.zeros(columns, dtype=weight.dtype, device=x2d.device)
        return dx, zeros, zeros.clone() if has_bias else None
    # Every program stores its partial row (zeros when its row range is empty): no memset.
    dw_part = torch.empty(programs, columns, dtype=torch.float32, device=x2d.device)
    db_part = torch.empty_like(dw_part) if has_bias else dw_part
    block = _block(columns)
    _backward[(programs,)](
        dy2d,
        x2d,
        weight,
        mean,
        rstd,
        dx,
        dw_part,
        db_part,
        rows,
        cdiv(rows, programs),
        dy2d.stride(0),
        x2d.stride(0),
        dx.stride(0),
        columns,
        IS_RMS=is_rms,
        HAS_BIAS=has_bias,
        BLOCK=block,
        STAGES=stages or BACKWARD_STAGES,
        num_warps=_warps(block),
    )
    dw = dw_part.sum(0).to(weight.dtype)
    db = db_part.sum(0).to(weight.dtype) if has_bias else None
    return dx, dw, db


def aot_configs(shapes: aot.Shapes, sms: int = 304) -> list[aot.Launch]:
    """The forward and backward launches for every hidden size the kernels take here."""
    out = []
    for columns in shapes.hiddens:
        if columns > max_columns():
            continue
        block = _block(columns)
        model = columns in shapes.model_hiddens
        for dt, rms in itertools.product(shapes.dtypes, (True, False)):
            flags = dict(IS_RMS=rms, HAS_BIAS=not rms, BLOCK=block)
            rows = max(shapes.seq_lens) * max(shapes.batch)
            f32 = torch.float32
            out.append(
                aot.launch(
                    _forward,
                    flags,
                    ptrs=dict(x=dt, w=dt, b=dt, y=dt, mean_out=f32, rstd_out=f32),
                    floats=("eps",),
                    num_warps=_warps(block),
                    grid=(rows,),
                    model_shape=model,
                )
            )
            ptrs = dict(dy=dt, x=dt, w=dt, mean_in=f32, rstd_in=f32, dx=dt, dw_part=f32)
            out.append(
                aot.launch(
                    _backward,
                    dict(flags, STAGES=BACKWARD_STAGES),
                    ptrs=dict(ptrs, db_part=f32),
                    num_warps=_warps(block),
                    grid=(PROGRAMS_PER_SM * sms,),
                    model_shape=model,
                )
            )
    return out
