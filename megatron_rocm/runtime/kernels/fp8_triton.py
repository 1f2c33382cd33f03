"""Triton kernels of FP8 scaling: the amax and scale, the cast with its transpose, and delayed
scaling's history.

Imported lazily by :mod:`megatron_rocm.runtime.kernels.fp8`. Under current scaling a GPU
quantizes in three launches:
``_partial_amax`` (each program the largest ``|x|`` of its slice, as fp32 bits), ``_finalize_scale``
(one program: the amax, the scale and its inverse, torch's operations in torch's order, so the
bits are eager ``fp8._scale``'s), and ``_cast_transpose``: few launches and no host sync,
where eager torch's scale alone takes about ten small ones.

``torch._scaled_mm`` takes its first operand row-major and its second column-major, so of the
three GEMMs of a linear two need
an operand transposed: the weight for the input gradient, the output gradient and the input for
the weight gradient. Copying FP8 tensors into those layouts with torch was half of an FP8
linear's GPU time on an H200 (``aten::copy_``, 32768 x 1536 x 1536). Here each program reads a
``BLOCK_R x BLOCK_C`` tile of ``x`` once and writes it scaled, clamped and cast both ways:
``y`` [R, C] and ``yt`` [C, ld_t] (``ld_t >= R``; the columns past R, zero-padding for the
GEMM's 16-multiple, are zeroed by ``cast_transpose``).

Math as ``fp8._apply``: ``x`` in fp32 times the scale, clamped to the format's largest value
(NaN kept), rounded to nearest even. The rounding and the FP8 encoding are integer arithmetic on
the fp32 bits (``_encode``), the same on every GPU and under Triton's CPU interpreter (whose own
FP8 casts drop the carry of a rounding, 31.98 -> 16, so they cannot be what the tests check);
the outputs are the FP8 tensors' bytes. Bitwise torch's conversion, NaN and signed zero
included: OCP formats keep the sign of zero and encode NaN as 0x7F with the sign of the fp32
NaN (which the device's multiply by the scale decides: a GPU returns its canonical NaN), ``fnuz``
ones have one zero and NaN at 0x80. ``TRANSPOSE=False`` writes ``y`` only (``quantize``).

On NVIDIA GPUs the OCP formats cast in hardware instead (``_hardware_cast``: one
``cvt.rn.satfinite`` for two values, where ``_encode`` spends about forty integer operations on
each: the hardware cast moves about twice the bytes a second on an H200, the Kernels table of
docs/performance.md). The GPU tests hold it to torch's bytes for every value and tie, as the encode.
ROCm uses the encode (the hardware conversion has not run on gfx942 or gfx950), and so do the
fnuz formats, GPUs before compute capability 8.9 and Triton's interpreter.

Delayed scaling quantizes in two launches and one read of ``x``: ``_delayed_update`` (one
program: the previous quantize's amax into the history, the scale from the history) and
``_cast_transpose`` with ``RECORD``, which raises the tensor's current amax with one atomic max
per tile as it casts (NaN elements left out, as TE's ``fmaxf`` leaves them).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_rocm.runtime.kernels import aot
from megatron_rocm.runtime.kernels.launch import cdiv, interpreting, is_hip


@dataclass(frozen=True)
class Tile:
    """A 2-D kernel's tile: ``rows x cols`` elements a program, ``warps`` warps."""

    rows: int
    cols: int
    warps: int


# the cast-transpose's tile by its cast, the fastest of a sweep on an H200 (the Kernels table):
# the hardware conversion is bound by memory and moves the most bytes with 64 x 128 tiles; the
# integer encode is bound by its arithmetic and runs best at 64 x 64. The byte transpose, bound
# by memory, as the hardware cast.
ENCODE_TILE = Tile(64, 64, 4)
HARDWARE_TILE = Tile(64, 128, 4)
BYTES_TILE = Tile(64, 128, 4)
_TILES = (ENCODE_TILE, HARDWARE_TILE, BYTES_TILE)
_WIDEST = (max(t.rows for t in _TILES), max(t.cols for t in _TILES))  # for int64 offsets
_NARROWEST = (min(t.rows for t in _TILES), min(t.cols for t in _TILES))  # for the grid limits
# the amax: each of at most AMAX_PROGRAMS programs reduces a contiguous slice, AMAX_BLOCK
# elements a step; the finalize program reads every partial in one block
AMAX_BLOCK = 4096
AMAX_PROGRAMS = 1024
AMAX_WARPS = 8
# --fp8-param-gather's shard cast: FLAT_BLOCK elements a program
FLAT_BLOCK = 4096
FLAT_WARPS = 8
# delayed scaling's history (upstream's --fp8-amax-history-len, 1024 in its 8B example):
# read HISTORY_BLOCK entries a step by one program
HISTORY_BLOCK = 1024
HISTORY_WARPS = 4
# the cast in hardware where the GPU converts exactly as torch does (module docstring);
# False sends every format through ``_encode`` (benchmarks compare the two)
HARDWARE_CAST = True
FLT_MAX = tl.constexpr(3.4028234663852886e38)  # fp32 largest; a jit global must be constexpr

# (mantissa bits, exponent bias, fnuz) of each FP8 dtype
FORMATS = {
    torch.float8_e4m3fn: (3, 7, False),
    torch.float8_e5m2: (2, 15, False),
    torch.float8_e4m3fnuz: (3, 8, True),
    torch.float8_e5m2fnuz: (2, 16, True),
}
# ``_cast_transpose``'s CAST: 0 the integer encode, else the hardware conversion to this format
HARDWARE_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


@triton.jit
def _rne_shift(v, s):
    """``v >> s`` rounded to nearest, ties to even (``v`` >= 0, 1 <= ``s`` <= 30)."""
    q = v >> s
    rem = v & ((1 << s) - 1)
    half = 1 << (s - 1)
    return q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)


@triton.jit
def _encode(v, MANTISSA: tl.constexpr, BIAS: tl.constexpr, FNUZ: tl.constexpr):
    """The FP8 byte (as int32) of fp32 ``v``, |v| within the format's range or NaN."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    exponent = (mag >> 23) - 127
    # normal: round the fp32 bits at the FP8 mantissa's last place (a carry moves the
    # exponent), then rebias; below the smallest normal: the significand in units of the
    # smallest subnormal, 2^(1 - BIAS - MANTISSA)
    normal = _rne_shift(mag, 23 - MANTISSA) - ((127 - BIAS) << MANTISSA)
    significand = (mag & 0x7FFFFF) | tl.where(exponent > -127, 0x800000, 0)
    s = tl.minimum(23 - MANTISSA + (1 - BIAS) - exponent, 30)
    subnormal = _rne_shift(significand, tl.maximum(s, 1))
    code = tl.where(exponent >= 1 - BIAS, normal, subnormal)
    is_nan = mag > 0x7F800000
    if FNUZ:  # one zero (0x00); 0x80 is NaN
        code = tl.where(code == 0, 0, code | (sign << 7))
        code = tl.where(is_nan, 0x80, code)
    else:
        code = tl.where(is_nan, 0x7F, code) | (sign << 7)
    return code


@triton.jit
def _partial_amax(x, partials, n, blocks_per_program, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """``partials[pid]``: the bits of the largest ``|x|`` of this program's slice, as int32
    (non-negative fp32 bits order as the values do; any NaN's are above +inf's)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    first = pid * blocks_per_program
    if WIDE:
        first = first.to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, blocks_per_program):
        o = (first + i) * BLOCK + offs
        v = tl.load(x + o, mask=o < n, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF)  # |v|, NaN too
    tl.store(partials + pid, tl.max(acc, axis=0))


@triton.jit
def _scale_of(bits, fp8_max, margin_factor, fallback):
    """``fp8._scale`` of an amax given as its fp32 bits: ``fallback`` where the amax is zero,
    inf or NaN. torch's ``fp8_max / t`` is ``t.reciprocal() * fp8_max``
    (``Tensor.__rdiv__``), both correctly rounded: ``div_rn``, not Triton's approximate ``/``."""
    usable = (bits > 0) & (bits < 0x7F800000)  # not zero, not inf or NaN
    t = bits.to(tl.float32, bitcast=True) * margin_factor
    scale = tl.where(usable, tl.math.div_rn(1.0, t) * fp8_max, fallback)
    return tl.minimum(scale, FLT_MAX)


@triton.jit
def _finalize_scale(
    partials, count, scale_out, inverse_out, fp8_max, margin_factor, PARTIALS: tl.constexpr
):
    """``scale_out``: ``fp8._scale`` of the amax, ``inverse_out``: its reciprocal."""
    offs = tl.arange(0, PARTIALS)
    bits = tl.max(tl.load(partials + offs, mask=offs < count, other=0), axis=0)
    scale = _scale_of(bits, fp8_max, margin_factor, 1.0)
    tl.store(scale_out, scale)
    tl.store(inverse_out, tl.math.div_rn(1.0, scale))


@triton.jit
def _delayed_update(
    history,
    current,
    pos,
    scale,
    inverse,
    length,
    fp8_max,
    margin_factor,
    MOST_RECENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Delayed scaling's step between two quantizes of one tensor (one program;
    ``fp8.AmaxHistory.advance`` in torch): the last quantize's amax (``current``, fp32 bits)
    goes into ``history`` at ``pos``, the scale follows from the history's largest entry
    (``MOST_RECENT``: from that amax alone), kept where that amax is not finite; ``pos`` moves
    on and ``current`` starts again from zero. A zero amax changes nothing (TE's rule)."""
    p = tl.load(pos)
    newest = tl.load(current)
    seen = newest > 0  # a zero amax changes nothing (TE)
    tl.store(history + p, newest, mask=seen)
    bits = newest
    if not MOST_RECENT:  # the slot just written is read as ``newest``: no store-load race
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, length, BLOCK):
            o = start + tl.arange(0, BLOCK)
            h = tl.load(history + o, mask=(o < length) & (o != p), other=0)
            acc = tl.maximum(acc, h)
        bits = tl.maximum(tl.max(acc, axis=0), newest)
    old = tl.load(scale)
    s = tl.where(seen, _scale_of(bits, fp8_max, margin_factor, old), old)
    tl.store(scale, s)
    tl.store(inverse, tl.math.div_rn(1.0, s))
    tl.store(pos, tl.where(seen, (p + 1) % length, p))
    tl.store(current, 0)


@triton.jit
def _hardware_cast(v, CAST: tl.constexpr):
    """The FP8 bytes of ``v`` (clamped to the format's range, or NaN) by the GPU's
    conversion: ``cvt.rn.satfinite`` (two values an instruction) in inline PTX, four bytes to a
    32-bit register. Not Triton's own cast (``v.to(tl.float8e4nv)``): with Triton 3.6 on an
    H200 it stores wrong transposed bytes for fp32 inputs, whether the clamp is min/max
    (triton-lang/triton#11111) or selects; the row-major bytes, and bf16 and fp16 inputs, come
    out right. The GPU tests check this form for all three input dtypes."""
    if CAST == 1:
        q = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;"
            " cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
            "=r,f,f,f,f", [v], dtype=tl.uint8, is_pure=True, pack=4,
        )  # fmt: skip
    else:
        q = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1;"
            " cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
            "=r,f,f,f,f", [v], dtype=tl.uint8, is_pure=True, pack=4,
        )  # fmt: skip
    return q


@triton.jit
def _tile(rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, WIDE: tl.constexpr):
    """This program's tile of an [rows, cols] tensor: its row and column indices (int64 with
    ``WIDE``) and the mask of those inside the tensor."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    if WIDE:
        r = r.to(tl.int64)
        c = c.to(tl.int64)
    return r, c, (r[:, None] < rows) & (c[None, :] < cols)


@triton.jit
def _abs_bits_without_nan(v):
    """``|v|`` as fp32 bits (int32, which order as the values do), NaN as 0 (TE's ``fmaxf``
    leaves NaN out of delayed scaling's amax); inf kept."""
    bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.where(bits > 0x7F800000, 0, bits)


@triton.jit
def _scaled_byte(
    v, s, fp8_max, MANTISSA: tl.constexpr, BIAS: tl.constexpr, FNUZ: tl.constexpr,
    CAST: tl.constexpr,
):  # fmt: skip
    """The FP8 bytes of fp32 ``v`` times the scale ``s``, clamped (``fp8._apply``)."""
    v = v * s
    # the clamp as selects (NaN compares false, so it stays NaN), not min/max with
    # PropagateNan.ALL, which corrupts a transposed FP8 store in triton-lang/triton#11111
    v = tl.where(v < -fp8_max, -fp8_max, v)
    v = tl.where(v > fp8_max, fp8_max, v)
    if CAST == 0:
        q = _encode(v, MANTISSA, BIAS, FNUZ).to(tl.uint8)
    else:
        q = _hardware_cast(v, CAST)
    return q


@triton.jit
def _cast_transpose(
    x,
    scale,
    y,
    yt,
    amax_out,
    rows,
    cols,
    ld_t,
    fp8_max,
    MANTISSA: tl.constexpr,
    BIAS: tl.constexpr,
    FNUZ: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    WIDE: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    RECORD: tl.constexpr,
    CAST: tl.constexpr,
):
    r, c, mask = _tile(rows, cols, BLOCK_R, BLOCK_C, WIDE)
    s = tl.load(scale)
    v = tl.load(x + r[:, None] * cols + c[None, :], mask=mask, other=0.0).to(tl.float32)
    if RECORD:  # delayed scaling: each row's largest |x| as fp32 bits (int32), before the cast
        row_bits = tl.max(_abs_bits_without_nan(v), axis=1)
    q = _scaled_byte(v, s, fp8_max, MANTISSA, BIAS, FNUZ, CAST)
    tl.store(y + r[:, None] * cols + c[None, :], q, mask=mask)
    if TRANSPOSE:
        tl.store(yt + c[:, None] * ld_t + r[None, :], tl.trans(q), mask=tl.trans(mask))
    if RECORD:
        # the row maxima (taken along the rows, within a thread and its warp, so only
        # BLOCK_R values stay live across the cast; the whole tile reduced here was slower on
        # an H200) and a relaxed atomic after the stores: the amax is read by a later launch
        # only (stream order), and the default acq_rel atomic's fence cost the cast about 30%
        tl.atomic_max(amax_out, tl.max(row_bits, axis=0), sem="relaxed")


@triton.jit
def _cast_flat(
    x, scale, y, amax_out, n, fp8_max, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
    FNUZ: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr, RECORD: tl.constexpr,
    CAST: tl.constexpr,
):  # fmt: skip
    """``y[:n]``: the bytes of ``x[:n]`` scaled by ``scale[0]`` and cast, as
    ``_cast_transpose`` casts (``--fp8-param-gather``'s shard of a weight: a flat slice that
    need not start at a row); ``RECORD``: ``amax_out`` raised to the largest ``|x|`` (NaN left
    out), as ``_cast_transpose`` records it."""
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    o = pid * BLOCK + tl.arange(0, BLOCK)
    mask = o < n
    v = tl.load(x + o, mask=mask, other=0.0).to(tl.float32)
    q = _scaled_byte(v, tl.load(scale), fp8_max, MANTISSA, BIAS, FNUZ, CAST)
    tl.store(y + o, q, mask=mask)
    if RECORD:  # after the store, relaxed: as _cast_transpose's
        tl.atomic_max(amax_out, tl.max(_abs_bits_without_nan(v), axis=0), sem="relaxed")


@triton.jit
def _transpose_bytes(
    x, yt, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, WIDE: tl.constexpr
):
    """``yt`` [C, R]: the bytes of ``x`` [R, C] transposed (an FP8 weight's copy for the input
    gradient's GEMM, after ``--fp8-param-gather``'s all-gather wrote the weight)."""
    r, c, mask = _tile(rows, cols, BLOCK_R, BLOCK_C, WIDE)
    v = tl.load(x + r[:, None] * cols + c[None, :], mask=mask)
    tl.store(yt + c[:, None] * rows + r[None, :], tl.trans(v), mask=tl.trans(mask))


def cast_kind(dtype: torch.dtype, device: torch.device) -> int:
    """``_cast_transpose``'s CAST for ``dtype`` on ``device``: the hardware conversion on an
    NVIDIA GPU of compute capability 8.9 or later (the first with FP8 ``cvt``) for the OCP
    formats, else 0 (the integer encode; also under Triton's interpreter, which runs no PTX)."""
    if not HARDWARE_CAST or dtype not in HARDWARE_FORMATS or interpreting():
        return 0
    if device.type != "cuda" or is_hip():
        return 0
    return HARDWARE_FORMATS[dtype] if has_fp8_conversion(device) else 0


@functools.lru_cache(maxsize=16)
def has_fp8_conversion(device: torch.device) -> bool:
    """Whether an NVIDIA GPU converts to FP8 in hardware (compute capability 8.9 or later);
    asked once per device, not on every launch."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def needs_int64(rows: int, cols: int, ld_t: int) -> bool:
    """Offsets past int32 in either output, the last tile's masked lanes included (of the
    largest tile: one answer for every kernel of this module)."""
    block_r, block_c = _WIDEST
    return max((rows + block_r) * (cols + block_c), (cols + block_c) * (ld_t + block_r)) >= 2**31


def amax_programs(n: int) -> tuple[int, int]:
    """(programs, blocks per program) of ``_partial_amax`` for ``n`` elements."""
    blocks = cdiv(n, AMAX_BLOCK)
    per_program = cdiv(blocks, AMAX_PROGRAMS)
    return cdiv(blocks, per_program), per_program


def amax_needs_int64(n: int) -> bool:
    """Offsets past int32 in ``_partial_amax``, the last program's masked lanes included."""
    programs, per_program = amax_programs(n)
    return programs * per_program * AMAX_BLOCK >= 2**31


def fits_grid(rows: int, cols: int) -> bool:
    """Whether the 2-D kernels' grids fit the GPU's limits (the second axis: 65,535 tiles of
    columns on CUDA and ROCm alike), for the narrowest tile."""
    block_r, block_c = _NARROWEST
    return cdiv(cols, block_c) <= 65535 and cdiv(rows, block_r) < 2**31


def cast_tile(cast: int) -> Tile:
    """``_cast_transpose``'s tile for its ``CAST`` (0: the integer encode)."""
    return ENCODE_TILE if cast == 0 else HARDWARE_TILE


def scales(
    x: torch.Tensor, fp8_max: float, margin_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, 1 / scale)``, 0-d fp32 tensors on ``x``'s device, of a contiguous, non-empty
    ``x``: bitwise ``fp8._scale(amax(x), fp8_max, margin)`` (``margin_factor = 2.0**margin``)
    and its reciprocal, in two launches and no host sync. Two allocations, not one of two
    elements: cuBLASLt refuses a scale pointer at a 4-byte offset (``CUBLAS_STATUS_NOT_SUPPORTED``
    from ``torch._scaled_mm`` on an H200)."""
    n = x.numel()
    programs, per_program = amax_programs(n)
    partials = torch.empty(programs, dtype=torch.int32, device=x.device)
    _partial_amax[(programs,)](
        x, partials, n, per_program, BLOCK=AMAX_BLOCK, WIDE=amax_needs_int64(n),
        num_warps=AMAX_WARPS,
    )  # fmt: skip
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    inverse = torch.empty((), dtype=torch.float32, device=x.device)
    _finalize_scale[(1,)](
        partials, programs, scale, inverse, fp8_max, margin_factor, PARTIALS=AMAX_PROGRAMS,
        num_warps=4,
    )  # fmt: skip
    return scale, inverse


def cast_transpose(
    x: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    fp8_max: float,
    ld_t: int | None,
    amax_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y, yt)``: ``x`` [R, C] (contiguous) scaled by ``scale`` (a 0-d fp32 tensor) and
    cast to the FP8 ``dtype``, as it is (``y``) and transposed into ``yt`` [C, ld_t] (zeros past
    R); ``ld_t=None``: ``y`` alone, ``yt`` None. ``amax_out`` (a 0-d fp32 tensor, delayed
    scaling's current amax): raised to ``x``'s largest ``|x|`` in the same pass."""
    rows, cols = x.shape
    if not x.is_contiguous() or (ld_t is not None and ld_t < rows):
        raise ValueError(f"cast_transpose takes a contiguous x and ld_t >= rows ({ld_t} < {rows})")
    mantissa, bias, fnuz = FORMATS[dtype]
    y = torch.empty((rows, cols), dtype=dtype, device=x.device)
    yt = None if ld_t is None else torch.empty((cols, ld_t), dtype=dtype, device=x.device)
    if yt is not None and ld_t > rows:
        yt[:, rows:].view(torch.uint8).zero_()
    if x.numel():
        cast = cast_kind(dtype, x.device)
        tile = cast_tile(cast)
        y_bytes = y.view(torch.uint8)
        record = amax_out is not None
        _cast_transpose[(cdiv(rows, tile.rows), cdiv(cols, tile.cols))](
            x, scale, y_bytes, y_bytes if yt is None else yt.view(torch.uint8),
            (amax_out if record else scale).view(torch.int32), rows, cols,
            rows if ld_t is None else ld_t, fp8_max, MANTISSA=mantissa, BIAS=bias, FNUZ=fnuz,
            BLOCK_R=tile.rows, BLOCK_C=tile.cols, WIDE=needs_int64(rows, cols, ld_t or rows),
            TRANSPOSE=yt is not None, RECORD=record, CAST=cast, num_warps=tile.warps,
        )  # fmt: skip
    return y, yt


def cast_flat(
    x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fp8_max: float, dtype: torch.dtype,
    amax_out: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """``out`` (uint8, ``x.numel()`` contiguous bytes): ``x`` (contiguous) scaled by ``scale``
    (an fp32 tensor; its first element) and cast to the FP8 ``dtype``, in one launch.
    ``amax_out`` (an fp32 element, delayed scaling): raised to ``x``'s largest ``|x|``, NaN
    left out, in the same pass."""
    n = x.numel()
    if (
        out.dtype != torch.uint8
        or out.numel() != n
        or not (x.is_contiguous() and out.is_contiguous())
    ):
        raise ValueError("cast_flat takes a contiguous x and as many contiguous uint8 bytes")
    if n:
        mantissa, bias, fnuz = FORMATS[dtype]
        record = amax_out is not None
        _cast_flat[(cdiv(n, FLAT_BLOCK),)](
            x, scale, out, (amax_out if record else scale).view(torch.int32), n, fp8_max,
            MANTISSA=mantissa, BIAS=bias, FNUZ=fnuz, BLOCK=FLAT_BLOCK, WIDE=flat_needs_int64(n),
            RECORD=record, CAST=cast_kind(dtype, x.device), num_warps=FLAT_WARPS,
        )  # fmt: skip


def flat_needs_int64(n: int) -> bool:
    """Offsets past int32 in ``_cast_flat``, the last program's masked lanes included."""
    return cdiv(n, FLAT_BLOCK) * FLAT_BLOCK >= 2**31


def transpose_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x`` [R, C] (contiguous, one byte an element) transposed into a new contiguous
    [C, R] tensor of its dtype, in one launch (torch's ``.t().contiguous()`` of uint8 took
    several times longer on an H200: ``scripts/bench/fp8_param_gather.py``)."""
    rows, cols = x.shape
    if x.element_size() != 1 or not x.is_contiguous():
        raise ValueError("transpose_bytes takes a contiguous tensor of one byte an element")
    yt = torch.empty((cols, rows), dtype=x.dtype, device=x.device)
    if x.numel():
        tile = BYTES_TILE
        _transpose_bytes[(cdiv(rows, tile.rows), cdiv(cols, tile.cols))](
            x.view(torch.uint8), yt.view(torch.uint8), rows, cols, BLOCK_R=tile.rows,
            BLOCK_C=tile.cols, WIDE=needs_int64(rows, cols, rows), num_warps=tile.warps,
        )  # fmt: skip
    return yt


def delayed_update(
    history: torch.Tensor,
    current: torch.Tensor,
    pos: torch.Tensor,
    scale: torch.Tensor,
    inverse: torch.Tensor,
    fp8_max: float,
    margin_factor: float,
    most_recent: bool,
) -> None:
    """``_delayed_update`` on one tensor's state (``fp8.AmaxHistory``), in place: one launch,
    no host sync."""
    _delayed_update[(1,)](
        history.view(torch.int32), current.view(torch.int32), pos, scale, inverse,
        history.numel(), fp8_max, margin_factor, MOST_RECENT=most_recent, BLOCK=HISTORY_BLOCK,
        num_warps=HISTORY_WARPS,
    )  # fmt: skip


def aot_configs(shapes: aot.Shapes) -> list[aot.Launch]:
    """What ROCm launches: the cast with the integer encode (``CAST=0``, the only cast on ROCm)
    on its tile for every input dtype and FP8 format (the output is bytes: one code per arch
    serves them all), with and without the transpose and the record; int32 and int64 offsets
    (the largest activation: every sequence length x batch x FFN width); the flat cast, the byte
    transpose and the scale kernels."""
    rows = max(shapes.seq_lens) * max(shapes.batch)
    widest = max(shapes.ffn_hiddens + shapes.hiddens)
    encode = cast_tile(0)
    out = []
    for source in shapes.dtypes:
        for wide in sorted({amax_needs_int64(rows * widest), False}):
            out.append(
                aot.launch(
                    _partial_amax,
                    dict(BLOCK=AMAX_BLOCK, WIDE=wide),
                    ptrs=dict(x=source, partials="i32"),
                    i64=("n",) if wide else (),
                    num_warps=AMAX_WARPS,
                    grid=(AMAX_PROGRAMS,),
                )
            )
        for mantissa, bias, fnuz in FORMATS.values():
            for wide in sorted({needs_int64(rows, widest, rows), False}):
                for transpose, record in itertools.product((True, False), repeat=2):
                    consts = dict(MANTISSA=mantissa, BIAS=bias, FNUZ=fnuz,
                                  BLOCK_R=encode.rows, BLOCK_C=encode.cols,
                                  WIDE=wide, TRANSPOSE=transpose, RECORD=record,
                                  CAST=0)  # fmt: skip
                    out.append(
                        aot.launch(
                            _cast_transpose,
                            consts,
                            ptrs=dict(
                                x=source, scale=torch.float32, y="u8", yt="u8", amax_out="i32"
                            ),
                            floats=("fp8_max",),
                            num_warps=encode.warps,
                            grid=(cdiv(rows, encode.rows), cdiv(widest, encode.cols)),
                            neutral=("BIAS",),  # FNUZ changes the code: gfx942 runs True
                        )
                    )
            flat = itertools.product(
                sorted({flat_needs_int64(rows * widest), False}), (True, False)
            )
            for wide, record in flat:
                out.append(
                    aot.launch(
                        _cast_flat,
                        dict(
                            MANTISSA=mantissa,
                            BIAS=bias,
                            FNUZ=fnuz,
                            BLOCK=FLAT_BLOCK,
                            WIDE=wide,
                            RECORD=record,
                            CAST=0,
                        ),
                        ptrs=dict(x=source, scale=torch.float32, y="u8", amax_out="i32"),
                        i64=("n",) if wide else (),
                        floats=("fp8_max",),
                        num_warps=FLAT_WARPS,
                        grid=(cdiv(rows * widest, FLAT_BLOCK),),
                        neutral=("BIAS",),
                    )
                )
    for wide in sorted({needs_int64(rows, widest, rows), False}):
        out.append(
            aot.launch(
                _transpose_bytes,
                dict(BLOCK_R=BYTES_TILE.rows, BLOCK_C=BYTES_TILE.cols, WIDE=wide),
                ptrs=dict(x="u8", yt="u8"),
                num_warps=BYTES_TILE.warps,
                grid=(cdiv(rows, BYTES_TILE.rows), cdiv(widest, BYTES_TILE.cols)),
            )
        )
    out.append(
        aot.launch(
            _finalize_scale,
            dict(PARTIALS=AMAX_PROGRAMS),
            ptrs=dict(partials="i32", scale_out=torch.float32, inverse_out=torch.float32),
            floats=("fp8_max", "margin_factor"),
            num_warps=4,
        )
    )
    for most_recent in (True, False):
        out.append(
            aot.launch(
                _delayed_update,
                dict(MOST_RECENT=most_recent, BLOCK=HISTORY_BLOCK),
                ptrs=dict(
                    history="i32",
                    current="i32",
                    pos="i32",
                    scale=torch.float32,
                    inverse=torch.float32,
                ),  # fmt: skip
                floats=("fp8_max", "margin_factor"),
                num_warps=HISTORY_WARPS,
            )
        )
    return out
