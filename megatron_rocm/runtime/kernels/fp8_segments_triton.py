"""Triton kernels that quantize a tensor's row segments, each by its own amax, in two launches.

The FP8 MoE experts (``backend.fp8_experts``) quantize every local expert's tokens (and every
expert's weight) under current scaling. One quantize per expert is three launches and a dozen
small torch calls: with a few experts per layer the step is bound by the host (the MoE table
of docs/performance.md). Here all of a tensor's segments quantize in two launches:

* ``_segment_amax``: ``PROGRAMS`` programs per segment, each the largest ``|x|`` of its
  strided share of the segment, as fp32 bits (``fp8_triton._partial_amax``'s convention: NaN
  above inf);
* ``_segment_cast_transpose``: each program a tile of one segment. It takes the segment's
  scale from the partials (``fp8_triton._scale_of``, the bits of eager ``fp8._scale``), casts
  as ``fp8_triton._cast_transpose`` does (``_scaled_byte``), writes the rows in place and,
  with ``TRANSPOSE``, the segment's transpose into its own contiguous ``[cols, bucket]`` block
  with zeros past the segment's rows; the segment's first tile writes the inverse scale.

The segment layout comes from one small int32 table: each
segment's first row (and the total), its bucket (its rows rounded up), its first tile (and
the total) and where its transposed block starts (``fp8_segments._table``).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from megatron_rocm.runtime.kernels import aot
from megatron_rocm.runtime.kernels.fp8_triton import (
    _WIDEST,
    FORMATS,
    _scale_of,
    _scaled_byte,
    cast_kind,
    cast_tile,
)
from megatron_rocm.runtime.kernels.launch import cdiv

# the amax: about AMAX_TOTAL programs over all segments (a power of two per segment, within
# AMAX_PROGRAMS_RANGE), AMAX_BLOCK elements a step; the cast reads a segment's partials at once
AMAX_TOTAL = 1024
AMAX_PROGRAMS_RANGE = (16, 256)
AMAX_BLOCK = 4096
AMAX_WARPS = 8
# the inverse scales sit SCALE_STRIDE floats apart: cuBLASLt refuses a scale pointer that is
# not 16-byte aligned (``fp8_triton.scales``)
SCALE_STRIDE = 4
# rows of the table (each ``segments + 1`` int32 entries); a jit global must be constexpr
STARTS, BUCKETS, FIRST_TILES, T_STARTS = (tl.constexpr(row) for row in range(4))


@triton.jit
def _segment_amax(
    x, table, partials, cols, segments, PROGRAMS: tl.constexpr, BLOCK: tl.constexpr,
    WIDE: tl.constexpr,
):  # fmt: skip
    """``partials[s * PROGRAMS + p]``: the bits of the largest ``|x|`` in program ``p``'s share
    of segment ``s`` (rows ``starts[s]`` to ``starts[s + 1]``); 0 for an empty share."""
    s = tl.program_id(0)
    p = tl.program_id(1)
    first = tl.load(table + STARTS * (segments + 1) + s)
    last = tl.load(table + STARTS * (segments + 1) + s + 1)
    if WIDE:
        first = first.to(tl.int64)
        last = last.to(tl.int64)
    base = first * cols
    n = (last - first) * cols
    lo = p * BLOCK
    if WIDE:
        lo = lo.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(lo, n, PROGRAMS * BLOCK):
        o = start + offs
        v = tl.load(x + base + o, mask=o < n, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF)  # |v|, NaN too
    tl.store(partials + s * PROGRAMS + p, tl.max(acc, axis=0))


@triton.jit
def _segment_cast_transpose(
    x,
    partials,
    y,
    yt,
    inverse,
    table,
    cols,
    segments,
    fp8_max,
    margin_factor,
    PROGRAMS: tl.constexpr,
    SEGMENTS_BLOCK: tl.constexpr,
    SCALE_STRIDE: tl.constexpr,
    MANTISSA: tl.constexpr,
    BIAS: tl.constexpr,
    FNUZ: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    WIDE: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    CAST: tl.constexpr,
):
    pid = tl.program_id(0)
    width = segments + 1
    # this tile's segment: how many segments after the first start at or before it
    idx = tl.arange(0, SEGMENTS_BLOCK)
    firsts = tl.load(table + FIRST_TILES * width + 1 + idx, mask=idx < segments - 1, other=pid + 1)
    s = tl.sum((firsts <= pid).to(tl.int32), axis=0)
    tile = pid - tl.load(table + FIRST_TILES * width + s)
    first = tl.load(table + STARTS * width + s)
    count = tl.load(table + STARTS * width + s + 1) - first
    bucket = tl.load(table + BUCKETS * width + s)
    t_start = tl.load(table + T_STARTS * width + s)
    lr = tile * BLOCK_R + tl.arange(0, BLOCK_R)  # rows within the segment
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    if WIDE:
        first = first.to(tl.int64)
        t_start = t_start.to(tl.int64)
        lr = lr.to(tl.int64)
        c = c.to(tl.int64)
    # the segment's scale from its partial amaxes, as fp8_triton._finalize_scale computes it
    offs = tl.arange(0, PROGRAMS)
    bits = tl.max(tl.load(partials + s * PROGRAMS + offs), axis=0)
    scale = _scale_of(bits, fp8_max, margin_factor, 1.0)
    tl.store(
        inverse + s * SCALE_STRIDE,
        tl.math.div_rn(1.0, scale),
        mask=(tile == 0) & (tl.program_id(1) == 0),
    )
    cols_in = c < cols
    mask = (lr < count)[:, None] & cols_in[None, :]
    r = first + lr
    v = tl.load(x + r[:, None] * cols + c[None, :], mask=mask, other=0.0).to(tl.float32)
    q = _scaled_byte(v, scale, fp8_max, MANTISSA, BIAS, FNUZ, CAST)
    tl.store(y + r[:, None] * cols + c[None, :], q, mask=mask)
    if TRANSPOSE:  # rows past the segment's count are zeros (the loads' other), up to its bucket
        t_mask = cols_in[:, None] & (lr < bucket)[None, :]
        dst = yt + t_start * cols + c[:, None] * bucket + lr[None, :]
        tl.store(dst, tl.trans(q), mask=t_mask)


def amax_programs(segments: int) -> int:
    """``_segment_amax``'s programs per segment: about ``AMAX_TOTAL`` in all."""
    low, high = AMAX_PROGRAMS_RANGE
    return min(high, max(low, triton.next_power_of_2(cdiv(AMAX_TOTAL, segments))))


def needs_int64(rows: int, cols: int, transposed: int) -> bool:
    """Offsets past int32 in ``x``/``y`` (``rows`` of them, with a tile's reach past the last)
    or in the transposed blocks (``transposed`` elements in all, with a tile's reach)."""
    block_r, block_c = _WIDEST  # fp8_triton's widest tile: one answer for every cast tile
    reach = block_r * (cols + block_c)
    return max((rows + block_r) * (cols + block_c), transposed + reach) >= 2**31


def quantize_segments(
    x: torch.Tensor,
    table: torch.Tensor,
    segments: int,
    tiles: int,
    y: torch.Tensor,
    yt: torch.Tensor | None,
    inverse: torch.Tensor,
    dtype: torch.dtype,
    fp8_max: float,
    margin_factor: float,
) -> None:
    """``y`` (and ``yt``, ``inverse``) written from ``x`` [rows, cols] (contiguous): each
    segment of ``table`` (on ``x``'s device) cast by its own scale, in two launches."""
    cols = x.shape[1]
    wide = needs_int64(y.shape[0], cols, 0 if yt is None else yt.numel())
    programs = amax_programs(segments)
    partials = torch.empty(segments * programs, dtype=torch.int32, device=x.device)
    _segment_amax[(segments, programs)](
        x, table, partials, cols, segments, PROGRAMS=programs, BLOCK=AMAX_BLOCK, WIDE=wide,
        num_warps=AMAX_WARPS,
    )  # fmt: skip
    mantissa, bias, fnuz = FORMATS[dtype]
    cast = cast_kind(dtype, x.device)
    tile = cast_tile(cast)
    y_bytes = y.view(torch.uint8)
    _segment_cast_transpose[(tiles, cdiv(cols, tile.cols))](
        x, partials, y_bytes, y_bytes if yt is None else yt.view(torch.uint8), inverse, table,
        cols, segments, fp8_max, margin_factor, PROGRAMS=programs,
        SEGMENTS_BLOCK=triton.next_power_of_2(segments), SCALE_STRIDE=SCALE_STRIDE,
        MANTISSA=mantissa, BIAS=bias, FNUZ=fnuz, BLOCK_R=tile.rows, BLOCK_C=tile.cols, WIDE=wide,
        TRANSPOSE=yt is not None, CAST=cast, num_warps=tile.warps,
    )  # fmt: skip


def aot_configs(shapes: aot.Shapes) -> list[aot.Launch]:
    """What ROCm launches: the amax and the cast on the integer encode's tile (``CAST=0``) for
    every input dtype and FP8 format, with and without the transpose, int32 and int64
    offsets, for each local expert count of ``shapes`` (its segment block and programs)."""
    rows = max(shapes.seq_lens) * max(shapes.batch)
    widest = max(shapes.ffn_hiddens + shapes.hiddens)
    encode = cast_tile(0)
    wides = sorted({needs_int64(rows, widest, rows * widest), False})
    out = []
    for source, experts in itertools.product(shapes.dtypes, shapes.experts):
        programs = amax_programs(experts)
        for wide in wides:
            out.append(
                aot.launch(
                    _segment_amax,
                    dict(PROGRAMS=programs, BLOCK=AMAX_BLOCK, WIDE=wide),
                    ptrs=dict(x=source, table="i32", partials="i32"),
                    num_warps=AMAX_WARPS,
                    grid=(experts, programs),
                )
            )
        for (mantissa, bias, fnuz), wide, transpose in itertools.product(
            FORMATS.values(), wides, (True, False)
        ):
            consts = dict(PROGRAMS=programs, SEGMENTS_BLOCK=triton.next_power_of_2(experts),
                          SCALE_STRIDE=SCALE_STRIDE, MANTISSA=mantissa, BIAS=bias, FNUZ=fnuz,
                          BLOCK_R=encode.rows, BLOCK_C=encode.cols, WIDE=wide,
                          TRANSPOSE=transpose, CAST=0)  # fmt: skip
            out.append(
                aot.launch(
                    _segment_cast_transpose,
                    consts,
                    ptrs=dict(
                        x=source,
                        partials="i32",
                        y="u8",
                        yt="u8",
                        inverse=torch.float32,
                        table="i32",
                    ),  # fmt: skip
                    floats=("fp8_max", "margin_factor"),
                    num_warps=encode.warps,
                    grid=(cdiv(rows, encode.rows) + experts, cdiv(widest, encode.cols)),
                    neutral=("BIAS",),
                )
            )
    return out
