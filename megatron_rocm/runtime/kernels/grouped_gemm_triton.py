"""Triton grouped GEMMs for MoE experts: one launch per projection, on CUDA and ROCm alike.

Imported lazily by :mod:`megatron_rocm.runtime.kernels.grouped_gemm`. The tokens of all local
experts are one ``[T, *]`` matrix whose rows are grouped by expert (``offs[g]`` = end row of
group ``g``, int32, on the device). Two kernels cover the forward and the backward:

* :func:`gmm`: ``out[rows of g] = a[rows of g] @ B_g`` (forward with ``B_g = W_g^T``, and the
  input gradient with ``B_g = W_g``);
* :func:`gmm_wgrad`: ``C_g (+)= dy[rows of g]^T @ x[rows of g]`` (the weight gradient), fp32
  accumulation, optionally added straight into ``main_grad``.

The expert matrices ``B_g`` / ``C_g`` need not be one 3-D tensor: each is found at
``base + offsets[g]`` with common strides, so per-expert parameters that live anywhere in one
storage (Megatron's DDP buffers, whose order and padding we do not control) are read and
written in place, with no stacking copy.

``gmm`` maps each program to one output tile: a program scans the group offsets (a few dozen
scalar loads) to find its group, so the launch needs only the host-side tile count. Programs
of one group are adjacent, so an expert's weights are shared through L2.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_rocm.runtime.kernels import aot
from megatron_rocm.runtime.kernels.launch import cdiv, interpreting, is_hip


@dataclass(frozen=True)
class Strided:
    """``G`` same-shape matrices at ``base[offsets[g] + i * strides[0] + j * strides[1]]``."""

    base: torch.Tensor  # any tensor whose data pointer is the storage start
    offsets: torch.Tensor  # int64 [G], element offsets, on base.device
    strides: tuple[int, int]
    align: int = 1  # every offset is a multiple of this (lets the compiler vectorise loads)


@dataclass(frozen=True)
class Tiles:
    """Block sizes and launch settings of one kernel (constexprs + warps/stages)."""

    bm: int
    bn: int
    bk: int
    warps: int
    stages: int


@functools.cache
def _tiles(kind: str, dtype: torch.dtype, accumulate: bool = False) -> Tiles:
    """Fixed launch table (no autotuning: the wgrad kernel accumulates into live buffers)."""
    if interpreting():
        return Tiles(16, 16, 16, 1, 1)
    return _choose_tiles(kind, dtype, is_hip(), accumulate)


def _choose_tiles(kind: str, dtype: torch.dtype, hip: bool, accumulate: bool = False) -> Tiles:
    """128x128 output tiles with 64-deep K steps is the usual sweet spot of Triton GEMMs on
    Hopper and MI300; fp32 halves the K step to stay within shared memory. AMD gets two
    pipeline stages (its LDS is smaller), and a 128x64 weight-gradient tile when it adds into
    the existing gradient: reading C back converts the 128x128 fp32 accumulator's layout
    through LDS, exactly 64 KiB, the whole of gfx942's (AMD compile gate)."""
    bk = 32 if dtype == torch.float32 else 64
    stages = 2 if hip else 3
    if kind == "wgrad":
        return Tiles(bk, 128, 64 if hip and accumulate else 128, 8, stages)  # bm: the K step
    return Tiles(128, 128, bk, 8, stages)


def _precision(dtype: torch.dtype) -> str:
    """fp32 matches torch's matmul: IEEE unless the user allowed TF32 (never on ROCm)."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 and not is_hip():
        return "tf32"
    return "ieee"


@triton.jit
def _gmm_kernel(
    a_ptr,
    b_ptr,
    b_off_ptr,
    c_ptr,
    offs_ptr,
    G,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    B_ALIGN: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    # Find this program's group: tiles are numbered group by group, row tile by row tile.
    first_tile = 0
    row_start = 0
    group = -1
    group_tile = 0
    group_start = 0
    group_end = 0
    for g in range(0, G):
        row_end = tl.load(offs_ptr + g)
        n_tiles = tl.cdiv(row_end - row_start, BM) * tiles_n
        mine = (pid >= first_tile) & (pid < first_tile + n_tiles)
        group = tl.where(mine, g, group)
        group_tile = tl.where(mine, first_tile, group_tile)
        group_start = tl.where(mine, row_start, group_start)
        group_end = tl.where(mine, row_end, group_end)
        first_tile += n_tiles
        row_start = row_end
    if group < 0:
        return
    local = pid - group_tile
    rows = group_start + (local // tiles_n) * BM + tl.arange(0, BM)
    cols = (local % tiles_n) * BN + tl.arange(0, BN)
    row_ok = rows < group_end
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    b_off = tl.load(b_off_ptr + group)
    if B_ALIGN > 1:  # a loaded offset has unknown alignment unless we say so
        b_off = tl.multiple_of(b_off, B_ALIGN)
    b_base = b_ptr + b_off
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BK)):
        ks = step * BK + tl.arange(0, BK)
        k_ok = ks < K
        a = tl.load(
            a_ptr + rows64[:, None] * stride_am + ks[None, :] * stride_ak,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_base + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        if UPCAST:  # the CPU interpreter's dot mishandles bf16 operands
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    out = c_ptr + rows64[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _wgrad_kernel(
    dy_ptr,
    x_ptr,
    c_ptr,
    c_off_ptr,
    offs_ptr,
    N,
    K,
    stride_dym,
    stride_dyn,
    stride_xm,
    stride_xk,
    stride_cn,
    stride_ck,
    ACCUMULATE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    C_ALIGN: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    tiles_k = tl.cdiv(K, BK)
    group = pid // (tiles_n * tiles_k)
    local = pid % (tiles_n * tiles_k)
    ns = (local // tiles_k) * BN + tl.arange(0, BN)
    ks = (local % tiles_k) * BK + tl.arange(0, BK)
    n_ok = ns < N
    k_ok = ks < K
    row_end = tl.load(offs_ptr + group)
    row_start = tl.load(offs_ptr + group - 1, mask=group > 0, other=0)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for start in range(row_start, row_end, BM):
        rows = start + tl.arange(0, BM)
        row_ok = rows < row_end
        rows64 = rows.to(tl.int64)
        dy = tl.load(
            dy_ptr + rows64[:, None] * stride_dym + ns[None, :] * stride_dyn,
            mask=row_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        x = tl.load(
            x_ptr + rows64[:, None] * stride_xm + ks[None, :] * stride_xk,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            dy = dy.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(tl.trans(dy), x, acc, input_precision=PRECISION)
    c_off = tl.load(c_off_ptr + group)
    if C_ALIGN > 1:
        c_off = tl.multiple_of(c_off, C_ALIGN)
    c = c_ptr + c_off + ns[:, None] * stride_cn + ks[None, :] * stride_ck
    mask = n_ok[:, None] & k_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(c, mask=mask, other=0.0).to(tl.float32)
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask)


def gmm(
    a: torch.Tensor, b: Strided, b_shape: tuple[int, int], offs: torch.Tensor, splits: list[int]
) -> torch.Tensor:
    """``out[rows of g] = a[rows of g] @ B_g`` with ``B_g`` of shape ``b_shape = (K, N)``."""
    k, n = b_shape
    out = torch.empty(a.shape[0], n, dtype=a.dtype, device=a.device)
    t = _tiles("gmm", a.dtype)
    tiles = sum(cdiv(m, t.bm) for m in splits) * cdiv(n, t.bn)
    if tiles == 0:
        return out
    _gmm_kernel[(tiles,)](
        a,
        b.base,
        b.offsets,
        out,
        offs,
        len(splits),
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.strides[0],
        b.strides[1],
        out.stride(0),
        out.stride(1),
        BM=t.bm,
        BN=t.bn,
        BK=t.bk,
        PRECISION=_precision(a.dtype),
        UPCAST=interpreting(),
        B_ALIGN=b.align,
        num_warps=t.warps,
        num_stages=t.stages,
    )
    return out


def gmm_wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    c: Strided,
    offs: torch.Tensor,
    groups: int,
    accumulate: bool,
) -> None:
    """``C_g (+)= dy[rows of g]^T @ x[rows of g]`` for every group; empty groups give zeros."""
    n, k = dy.shape[1], x.shape[1]
    t = _tiles("wgrad", dy.dtype, accumulate)
    grid = groups * cdiv(n, t.bn) * cdiv(k, t.bk)
    if grid == 0:
        return
    _wgrad_kernel[(grid,)](
        dy,
        x,
        c.base,
        c.offsets,
        offs,
        n,
        k,
        dy.stride(0),
        dy.stride(1),
        x.stride(0),
        x.stride(1),
        c.strides[0],
        c.strides[1],
        ACCUMULATE=accumulate,
        BM=t.bm,
        BN=t.bn,
        BK=t.bk,
        PRECISION=_precision(dy.dtype),
        UPCAST=interpreting(),
        C_ALIGN=c.align,
        num_warps=t.warps,
        num_stages=t.stages,
    )


def aot_configs(shapes: aot.Shapes) -> list[aot.Launch]:
    """Forward/dgrad and wgrad launches (into a fresh gradient, or added into an fp32 or
    same-dtype ``main_grad``) for every dtype; the tiles do not depend on the model's sizes."""
    out = []
    for dt in shapes.dtypes:
        t = _choose_tiles("gmm", dt, is_hip())
        align = 16 // torch.empty((), dtype=dt).element_size()
        for b_align in (1, align):
            out.append(
                aot.launch(
                    _gmm_kernel,
                    dict(
                        BM=t.bm, BN=t.bn, BK=t.bk, PRECISION="ieee", UPCAST=False, B_ALIGN=b_align
                    ),
                    ptrs=dict(a_ptr=dt, b_ptr=dt, b_off_ptr="i64", c_ptr=dt, offs_ptr="i32"),
                    num_warps=t.warps,
                    num_stages=t.stages,
                    grid=(max(shapes.experts) * 64,),
                )
            )
        for c_dt, acc in ((dt, False), (torch.float32, True), (dt, True)):
            t = _choose_tiles("wgrad", dt, is_hip(), acc)
            out.append(
                aot.launch(
                    _wgrad_kernel,
                    dict(
                        ACCUMULATE=acc,
                        BM=t.bm,
                        BN=t.bn,
                        BK=t.bk,
                        PRECISION="ieee",
                        UPCAST=False,
                        C_ALIGN=align,
                    ),
                    ptrs=dict(dy_ptr=dt, x_ptr=dt, c_ptr=c_dt, c_off_ptr="i64", offs_ptr="i32"),
                    num_warps=t.warps,
                    num_stages=t.stages,
                    grid=(max(shapes.experts) * 64,),
                )
            )
    return out
