"""Triton kernel of the FP8 cast with its transpose (TE's ``cast_transpose``), one pass.

Imported lazily by :mod:`megatron_rocm.runtime.kernels.fp8`. ``torch._scaled_mm`` takes its
first operand row-major and its second column-major, so of the three GEMMs of a linear two need
an operand transposed: the weight for the input gradient, the output gradient and the input for
the weight gradient. Copying FP8 tensors into those layouts with torch was half of an FP8
linear's GPU time on an H200 (``aten::copy_``, 32768 x 1536 x 1536). Here each program reads a
``BLOCK_R x BLOCK_C`` tile of ``x`` once and writes it scaled, clamped and cast both ways:
``y`` [R, C] and ``yt`` [C, ld_t] (``ld_t >= R``; the columns past R, zero-padding for the
GEMM's 16-multiple, are the caller's).

Math as ``fp8._apply``: ``x`` in fp32 times the scale, clamped to the format's largest value
(NaN kept), rounded to nearest even. The rounding and the FP8 encoding are integer arithmetic on
the fp32 bits (``_encode``), the same on every GPU and under Triton's CPU interpreter (whose own
FP8 casts drop the carry of a rounding, 31.98 -> 16, so they cannot be what the tests check);
the outputs are the FP8 tensors' bytes. Bitwise torch's conversion, NaN and signed zero
included: OCP formats keep the sign of zero and encode NaN as 0x7F, ``fnuz`` ones have one
zero and NaN at 0x80.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_rocm.runtime.kernels import aot

BLOCK_R = 64
BLOCK_C = 64
NUM_WARPS = 4

# (mantissa bits, exponent bias, fnuz) of each FP8 dtype
FORMATS = {
    torch.float8_e4m3fn: (3, 7, False),
    torch.float8_e5m2: (2, 15, False),
    torch.float8_e4m3fnuz: (3, 8, True),
    torch.float8_e5m2fnuz: (2, 16, True),
}


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
def _cast_transpose(
    x,
    scale,
    y,
    yt,
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
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    if WIDE:
        r = r.to(tl.int64)
        c = c.to(tl.int64)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    s = tl.load(scale)
    v = tl.load(x + r[:, None] * cols + c[None, :], mask=mask, other=0.0).to(tl.float32) * s
    v = tl.minimum(tl.maximum(v, -fp8_max, propagate_nan=tl.PropagateNan.ALL), fp8_max,
                   propagate_nan=tl.PropagateNan.ALL)  # fmt: skip
    q = _encode(v, MANTISSA, BIAS, FNUZ).to(tl.uint8)
    tl.store(y + r[:, None] * cols + c[None, :], q, mask=mask)
    tl.store(yt + c[:, None] * ld_t + r[None, :], tl.trans(q), mask=tl.trans(mask))


def needs_int64(rows: int, cols: int, ld_t: int) -> bool:
    """Offsets past int32 in either output, the last tile's masked lanes included."""
    return max((rows + BLOCK_R) * (cols + BLOCK_C), (cols + BLOCK_C) * (ld_t + BLOCK_R)) >= 2**31


def cast_transpose(
    x: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    fp8_max: float,
    ld_t: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, yt)``: ``x`` [R, C] (contiguous) scaled by the 0-d fp32 ``scale`` and cast to the
    FP8 ``dtype``, as it is (``y``) and transposed into ``yt`` [C, ld_t] (zeros past R)."""
    rows, cols = x.shape
    if not x.is_contiguous() or ld_t < rows:
        raise ValueError(f"cast_transpose takes a contiguous x and ld_t >= rows ({ld_t} < {rows})")
    mantissa, bias, fnuz = FORMATS[dtype]
    y = torch.empty((rows, cols), dtype=dtype, device=x.device)
    yt = torch.empty((cols, ld_t), dtype=dtype, device=x.device)
    if ld_t > rows:
        yt[:, rows:].view(torch.uint8).zero_()
    if x.numel():
        grid = (triton.cdiv(rows, BLOCK_R), triton.cdiv(cols, BLOCK_C))
        _cast_transpose[grid](
            x, scale, y.view(torch.uint8), yt.view(torch.uint8), rows, cols, ld_t, fp8_max,
            MANTISSA=mantissa, BIAS=bias, FNUZ=fnuz,
            BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, WIDE=needs_int64(rows, cols, ld_t),
            num_warps=NUM_WARPS,
        )  # fmt: skip
    return y, yt


def aot_configs(shapes: aot.Shapes) -> list[aot.Launch]:
    """The one tile for every input dtype and FP8 format (the output is bytes: one code per
    arch serves them all); int32 and int64 offsets (the largest activation: every sequence
    length x batch x FFN width)."""
    rows = max(shapes.seq_lens) * max(shapes.batch)
    widest = max(shapes.ffn_hiddens + shapes.hiddens)
    out = []
    for source in shapes.dtypes:
        for mantissa, bias, fnuz in FORMATS.values():
            for wide in sorted({needs_int64(rows, widest, rows), False}):
                consts = dict(MANTISSA=mantissa, BIAS=bias, FNUZ=fnuz, BLOCK_R=BLOCK_R,
                              BLOCK_C=BLOCK_C, WIDE=wide)  # fmt: skip
                out.append(
                    aot.launch(
                        _cast_transpose,
                        consts,
                        ptrs=dict(x=source, scale=torch.float32, y="u8", yt="u8"),
                        floats=("fp8_max",),
                        num_warps=NUM_WARPS,
                        grid=(triton.cdiv(rows, BLOCK_R), triton.cdiv(widest, BLOCK_C)),
                        neutral=("BIAS",),  # FNUZ changes the code: gfx942 runs True
                    )
                )
    return out
