"""Triton kernels for the scaled (masked / causal) softmax: portable across CUDA and ROCm.

Imported lazily by :mod:`megatron_rocm.runtime.kernels.softmax`, so the package imports without Triton.
Every kernel sees the input as contiguous rows ``[n_rows, sk]``; a row's query index is
``row % sq`` and its batch index (for the padding mask) is ``row // (heads * sq)``.

Two shapes of kernel, picked per call by :func:`plan`:

* ``*_rows``: the whole row (or several short rows) lives in registers, so it is read once
  and written once: the memory-bandwidth ideal.
* ``*_loop``: a persistent grid, one row at a time per program, two passes over tiles
  (online max/sum, then write); few programs keep the second read of a row in L2. Used
  only for rows longer than ``Tuning.max_block`` (32k; 16k for the causal backward).

The padding-mask forward runs the heads of one ``(b, q)`` mask row back to back, so the
mask, shared by all heads, is read from DRAM about once.

The causal mode only loads columns ``<= row % sq``; everything right of the diagonal is
stored as zeros without being read, in both directions.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import triton
import triton.language as tl

from megatron_rocm.runtime.kernels import aot
from megatron_rocm.runtime.kernels.launch import cdiv, is_hip, sm_count

PLAIN, CAUSAL, MASKED = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch heuristics: a small table instead of autotuning every call signature.

    The defaults are the per-regime winners of scripts/bench/softmax.py on an H100
    (docs/kernels.md); AMD uses the same table with 64-wide wavefronts and at most 16 of them.
    """

    max_block: int = 32768  # rows up to this (power-of-2 padded) length stay in registers,
    causal_bwd_max_block: int = 16384  # except causal backward: the loop won at 32k (78 vs 52%)
    elems_per_thread: int = 16  # sets num_warps; 16 beat 8 (more warps) in the forward
    long_causal_fwd_elems: int = 32  # causal forward, rows >= 16k: fewer warps (91 vs 84%)
    min_tile: int = 2048  # short rows are packed until a program holds this many elements
    max_warps: int = 0  # 0: the hardware limit (32 on NVIDIA, 16 on AMD)
    loop_block: int = 8192  # tile of the two-pass loop for longer rows
    loop_programs_per_sm: int = 1  # >0: persistent loop grid (keeps its re-reads in L2)
    head_fastest_min_sk: int = 2048  # padding mask: heads of a mask row back to back from here


_tuning = Tuning()


def get_tuning() -> Tuning:
    return _tuning


def set_tuning(tuning: Tuning) -> None:
    """Swap the heuristics (scripts/bench/softmax.py compares a few in one GPU run)."""
    global _tuning
    _tuning = tuning


@dataclasses.dataclass(frozen=True)
class Plan:
    looped: bool
    block: int
    rows: int
    num_warps: int
    grid: int
    head_fastest: bool


def plan(
    n_rows: int,
    sk: int,
    mode: int = PLAIN,
    sms: int = 132,
    tuning: Tuning | None = None,
    backward: bool = False,
) -> Plan:
    """Block size, rows per program, warps and grid for ``n_rows`` rows of length ``sk``."""
    t = tuning or _tuning
    warp_size, hw_warps = (64, 16) if is_hip() else (32, 32)
    causal = mode == CAUSAL
    block = max(16, triton.next_power_of_2(sk))
    looped = block > (t.causal_bwd_max_block if causal and backward else t.max_block)
    if looped:
        block = t.loop_block
    rows = 1
    if not looped and block < t.min_tile:
        rows = min(t.min_tile // block, triton.next_power_of_2(max(n_rows, 1)))
    elems = t.elems_per_thread
    if causal and not backward and not looped and block >= 16384:
        elems = t.long_causal_fwd_elems
    warps = (block * rows) // (warp_size * elems)
    warps = max(1, min(t.max_warps or hw_warps, hw_warps, triton.next_power_of_2(max(warps, 1))))
    grid = cdiv(n_rows, rows)
    if looped and t.loop_programs_per_sm > 0:
        grid = min(grid, sms * t.loop_programs_per_sm)
    head_fastest = mode == MASKED and sk >= t.head_fastest_min_sk
    return Plan(looped, block, rows, warps, grid, head_fastest)


@triton.jit
def _row_of(v, sq, heads, MODE: tl.constexpr, HEAD_FASTEST: tl.constexpr):
    """Row of launch index ``v``. Padding mask: ``v`` runs over heads fastest, so the programs
    sharing one mask row are adjacent and the mask is read from DRAM about once."""
    row = v
    if MODE == 2:
        if HEAD_FASTEST:
            t = v // heads
            row = ((t // sq) * heads + v % heads) * sq + t % sq
    return row


@triton.jit
def _masks(rows, cols, n_rows, sk, sq, MODE: tl.constexpr):
    """``(load, keep)`` masks of a [ROWS, BLOCK] tile.

    ``keep``: in range and, when causal, on/below the diagonal. ``load`` rounds the causal
    bound up to a multiple of 16 columns: a per-element bound would make Triton split every
    vector access into scalar ones; the few extra elements are dropped by ``keep``.
    """
    keep = (rows < n_rows)[:, None] & (cols < sk)[None, :]
    load = keep
    if MODE == 1:
        q = (rows % sq)[:, None]
        load = keep & (cols[None, :] < (q // 16 + 1) * 16)
        keep = keep & (cols[None, :] <= q)
    return load, keep


@triton.jit
def _logits(x_ptr, m_ptr, rows, cols, n_rows, sk, sq, hq, smb, smq, smk, scale, MODE: tl.constexpr):
    """Scaled fp32 logits of a tile; -10000 where the mask says so, -inf where not read."""
    load, keep = _masks(rows, cols, n_rows, sk, sq, MODE)
    offs = rows.to(tl.int64)[:, None] * sk + cols[None, :]
    z = tl.load(x_ptr + offs, mask=load, other=0.0).to(tl.float32) * scale
    if MODE == 2:
        moff = (rows // hq).to(tl.int64) * smb + (rows % sq).to(tl.int64) * smq
        masked = tl.load(
            m_ptr + moff[:, None] + cols.to(tl.int64)[None, :] * smk, mask=load, other=0
        )
        z = tl.where(masked != 0, -10000.0, z)
    return tl.where(keep, z, float("-inf"))


@triton.jit
def _finish(e, m, s, MODE: tl.constexpr):
    """Normalise; Apex zeroes a padding-masked row whose max is the fill value."""
    y = e * (1.0 / s)[:, None]
    if MODE == 2:
        y = tl.where((m == -10000.0)[:, None], 0.0, y)
    return y


@triton.jit
def _fwd_rows(
    x_ptr,
    y_ptr,
    m_ptr,
    n_rows,
    sk,
    sq,
    hq,
    smb,
    smq,
    smk,
    scale,
    heads,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_FASTEST: tl.constexpr,
):
    v = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rows = _row_of(v, sq, heads, MODE, HEAD_FASTEST)
    cols = tl.arange(0, BLOCK)
    z = _logits(x_ptr, m_ptr, rows, cols, n_rows, sk, sq, hq, smb, smq, smk, scale, MODE)
    m = tl.max(z, 1)
    e = tl.exp(z - m[:, None])
    y = _finish(e, m, tl.sum(e, 1), MODE)
    offs = rows.to(tl.int64)[:, None] * sk + cols[None, :]
    out = (rows < n_rows)[:, None] & (cols < sk)[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=out)


@triton.jit
def _fwd_loop(
    x_ptr,
    y_ptr,
    m_ptr,
    n_rows,
    sk,
    sq,
    hq,
    smb,
    smq,
    smk,
    scale,
    heads,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
    HEAD_FASTEST: tl.constexpr,
):
    for v in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = _row_of(v, sq, heads, MODE, HEAD_FASTEST)
        rows = tl.full([1], 0, tl.int32) + row
        n_read = sk
        if MODE == 1:
            n_read = row % sq + 1  # past sk (only if sq > sk) the loads are masked off anyway
        m = tl.full([1], float("-inf"), tl.float32)
        s = tl.zeros([1], tl.float32)
        for start in range(0, n_read, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = _logits(x_ptr, m_ptr, rows, cols, n_rows, sk, sq, hq, smb, smq, smk, scale, MODE)
            m_new = tl.maximum(m, tl.max(z, 1))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), 1)
            m = m_new
        for start in range(0, sk, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = _logits(x_ptr, m_ptr, rows, cols, n_rows, sk, sq, hq, smb, smq, smk, scale, MODE)
            y = _finish(tl.exp(z - m[:, None]), m, s, MODE)
            offs = rows.to(tl.int64)[:, None] * sk + cols[None, :]
            tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=(cols < sk)[None, :])


@triton.jit
def _grad_terms(dy_ptr, y_ptr, rows, cols, n_rows, sk, sq, MODE: tl.constexpr):
    """fp32 ``(dy*y, y)`` of a tile, zero where not read."""
    load, keep = _masks(rows, cols, n_rows, sk, sq, MODE)
    offs = rows.to(tl.int64)[:, None] * sk + cols[None, :]
    y = tl.load(y_ptr + offs, mask=load, other=0.0).to(tl.float32)
    g = tl.load(dy_ptr + offs, mask=load, other=0.0).to(tl.float32) * y
    if MODE == 1:
        y = tl.where(keep, y, 0.0)
        g = tl.where(keep, g, 0.0)
    return g, y


@triton.jit
def _bwd_rows(
    dy_ptr,
    y_ptr,
    dx_ptr,
    n_rows,
    sk,
    sq,
    scale,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    g, y = _grad_terms(dy_ptr, y_ptr, rows, cols, n_rows, sk, sq, MODE)
    dx = scale * (g - y * tl.sum(g, 1)[:, None])
    offs = rows.to(tl.int64)[:, None] * sk + cols[None, :]
    out = (rows < n_rows)[:, None] & (cols < sk)[None, :]
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=out)


@triton.jit
def _bwd_loop(
    dy_ptr,
    y_ptr,
    dx_ptr,
    n_rows,
    sk,
    sq,
    scale,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        rows = tl.full([1], 0, tl.int32) + row
        n_read = sk
        if MODE == 1:
            n_read = row % sq + 1  # past sk (only if sq > sk) the loads are masked off anyway
        acc = tl.zeros([1], tl.float32)
        for start in range(0, n_read, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            g, y = _grad_terms(dy_ptr, y_ptr, rows, cols, n_rows, sk, sq, MODE)
            acc += tl.sum(g, 1)
        for start in range(0, sk, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            g, y = _grad_terms(dy_ptr, y_ptr, rows, cols, n_rows, sk, sq, MODE)
            dx = scale * (g - y * acc[:, None])
            offs = rows.to(tl.int64)[:, None] * sk + cols[None, :]
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=(cols < sk)[None, :])


def forward(
    x: torch.Tensor,
    scale: float,
    mode: int,
    sq: int,
    mask: torch.Tensor | None = None,
    heads: int = 1,
) -> torch.Tensor:
    """Softmax of contiguous ``x`` (rows of ``x.shape[-1]``); ``scale`` already rounded.

    ``mask`` (MASKED only) is a uint8 view ``[b|1, 1, sq, sk]`` with any strides (0 = broadcast);
    ``heads`` is the number of rows blocks sharing one mask batch entry (``np`` of ``[b, np]``).
    """
    sk = x.shape[-1]
    y = torch.empty_like(x)
    n_rows = x.numel() // sk if sk else 0
    if n_rows == 0:
        return y
    if mode == MASKED:
        assert mask is not None
        smb = mask.stride(0) if mask.shape[0] > 1 else 0
        smq, smk, m_arg = mask.stride(2), mask.stride(3), mask
    else:
        smb = smq = smk = 0
        m_arg = x
    p = plan(n_rows, sk, mode, sm_count(x.device))
    args = (x, y, m_arg, n_rows, sk, sq, heads * sq, smb, smq, smk, scale, heads)
    meta = dict(MODE=mode, BLOCK=p.block, HEAD_FASTEST=p.head_fastest, num_warps=p.num_warps)
    if p.looped:
        _fwd_loop[(p.grid,)](*args, **meta)
    else:
        _fwd_rows[(p.grid,)](*args, ROWS=p.rows, **meta)
    return y


def backward(
    dy: torch.Tensor, y: torch.Tensor, scale: float, causal: bool, sq: int
) -> torch.Tensor:
    """``dx = scale * (dy*y - y*sum(dy*y))`` for contiguous ``dy``/``y`` of the same shape."""
    sk = y.shape[-1]
    dx = torch.empty_like(dy)
    n_rows = y.numel() // sk if sk else 0
    if n_rows == 0:
        return dx
    mode = CAUSAL if causal else PLAIN
    p = plan(n_rows, sk, mode, sm_count(dy.device), backward=True)
    args = (dy, y, dx, n_rows, sk, sq, scale)
    if p.looped:
        _bwd_loop[(p.grid,)](*args, MODE=mode, BLOCK=p.block, num_warps=p.num_warps)
    else:
        _bwd_rows[(p.grid,)](*args, MODE=mode, BLOCK=p.block, ROWS=p.rows, num_warps=p.num_warps)
    return dx


def aot_configs(shapes: aot.Shapes, sms: int = 304) -> list[aot.Launch]:
    """The forward (plain, causal, padding mask) and backward launches :func:`plan` picks for
    attention scores ``[b, heads, sq, sk]`` of every sequence length (sq = sk)."""
    out = []
    for seq, heads, b, dt in itertools.product(
        shapes.seq_lens, shapes.heads, shapes.batch, shapes.dtypes
    ):
        n_rows = b * heads * seq
        model = seq in shapes.model_seq_lens
        for mode in (PLAIN, CAUSAL, MASKED):
            p = plan(n_rows, seq, mode, sms)
            meta = dict(MODE=mode, BLOCK=p.block, HEAD_FASTEST=p.head_fastest)
            if not p.looped:
                meta["ROWS"] = p.rows
            mask = "u8" if mode == MASKED else dt
            out.append(
                aot.launch(
                    _fwd_loop if p.looped else _fwd_rows,
                    meta,
                    ptrs=dict(x_ptr=dt, y_ptr=dt, m_ptr=mask),
                    floats=("scale",),
                    num_warps=p.num_warps,
                    grid=(p.grid,),
                    model_shape=model,
                )
            )
            if mode == MASKED:
                continue
            p = plan(n_rows, seq, mode, sms, backward=True)
            meta = dict(MODE=mode, BLOCK=p.block)
            if not p.looped:
                meta["ROWS"] = p.rows
            out.append(
                aot.launch(
                    _bwd_loop if p.looped else _bwd_rows,
                    meta,
                    ptrs=dict(dy_ptr=dt, y_ptr=dt, dx_ptr=dt),
                    floats=("scale",),
                    num_warps=p.num_warps,
                    grid=(p.grid,),
                    model_shape=model,
                )
            )
    return out
