"""Triton kernels of FP8 block scaling (``--fp8-recipe blockwise``): the block casts and the
block-scaled GEMM.

Imported lazily by :mod:`megatron_rocm.runtime.kernels.fp8_blockwise`, which holds the math in
torch. ``_cast_blocks`` reads a 128 x 128 tile once and writes what the linear needs of it: the
tile scaled by one scale (a weight's 128 x 128 block, ``TILES``), or each row's 128 elements by
their own scale (``ROWS``) and each column's 128 elements by theirs, stored transposed
(``COLS``): the operand of the weight gradient, whose GEMM contracts over the tokens. Scales
are powers of two (TE's default for this recipe): ``fp8_max / amax`` with its mantissa
cleared, so dequantizing is exact. The bytes are
``fp8_triton._scaled_byte``'s, bitwise torch's cast.

``_block_mm`` is ``a @ b^T`` for ``a`` [M, K] with a scale per row and 128 columns and ``b``
[N, K] with a scale per 128 x 128 tile (``B_TILES``) or per row and 128 columns: each 128-deep
step of K is one ``tl.dot`` in fp32, scaled, and added to the accumulator (the scales differ
from one step to the next, so the partial sums cannot share an accumulator). It serves GPUs
whose ``torch._scaled_mm`` takes no block scales (ROCm's hipBLASLt), and ``ACCUMULATE`` adds the
product into ``c`` (the weight gradient into ``main_grad``).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from megatron_rocm.runtime.kernels import aot
from megatron_rocm.runtime.kernels.fp8_triton import (
    FLT_MAX,
    FORMATS,
    _abs_bits_without_nan,
    _scaled_byte,
    _tile,
    cast_kind,
)
from megatron_rocm.runtime.kernels.launch import cdiv, is_hip

BLOCK = 128  # the recipe's block: 1 x 128 for activations and gradients, 128 x 128 for weights
CAST_WARPS = 8


class GemmConfig(NamedTuple):
    """A launch of ``_block_mm``: rows per program, warps, pipeline stages."""

    block_m: int
    warps: int
    stages: int


# the GEMM's tiles, 128 columns wide (a weight tile's width: one scale per step of K), the
# fastest of ten on an H200 at Llama-3 8B's and the 0.85B's shapes (a probe, 2026-11-30:
# 128 x 128 on 8 warps 676-794 TFLOP/s against 64 x 128 on 4 warps' 612-672 with tiles; with
# 1 x 128 blocks on both sides 64 x 128 on 4 warps stays ahead). On ROCm one stage of 64 x
# 128 (32 KiB of LDS; two stages spill registers on gfx950, the AMD compile gate), untimed there
GEMM_BLOCK_N = 128
GEMM_TILES = GemmConfig(block_m=128, warps=8, stages=3)
GEMM_BLOCKS = GemmConfig(block_m=64, warps=4, stages=3)
GEMM_HIP = GemmConfig(block_m=64, warps=4, stages=1)
GEMM_GROUP_M = 8


@triton.jit
def _power_of_two(scale):
    """``scale`` (positive, normal) rounded down to a power of two: its mantissa cleared."""
    return (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _block_scale(bits, fp8_max):
    """The power-of-two scale of a block whose amax has the fp32 ``bits``: TE's
    ``compute_scale_from_amax``, ``fp8_max / amax`` correctly rounded, at most fp32's largest
    value, 1 for an all-zero block or one with an inf, then rounded down."""
    usable = (bits > 0) & (bits < 0x7F800000)
    amax = tl.where(usable, bits, 0x3F800000).to(tl.float32, bitcast=True)
    scale = tl.where(usable, tl.math.div_rn(amax * 0.0 + fp8_max, amax), 1.0)
    return _power_of_two(tl.minimum(scale, FLT_MAX))


@triton.jit
def _inverse(scale):
    """``1 / scale`` of a power of two from its exponent bits, exact where the result is
    subnormal (2^-127, the inverse of the largest scale) on any GPU's flush-to-zero."""
    e = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
    bits = tl.where(e <= 253, (254 - e) << 23, 1 << 22)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _cast_blocks(
    x, y, inv, yt, inv_t, rows, cols, ld_t, fp8_max,
    MANTISSA: tl.constexpr, BIAS: tl.constexpr, FNUZ: tl.constexpr, CAST: tl.constexpr,
    ROWS: tl.constexpr, COLS: tl.constexpr, TILES: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    r, c, mask = _tile(rows, cols, 128, 128, WIDE)
    v = tl.load(x + r[:, None] * cols + c[None, :], mask=mask, other=0.0).to(tl.float32)
    bits = _abs_bits_without_nan(v)
    tile_r = tl.program_id(0)
    tile_c = tl.program_id(1)
    blocks_c = tl.cdiv(cols, 128)
    if TILES:  # one scale for the tile; its transpose is the same bytes transposed
        s = _block_scale(tl.max(tl.max(bits, axis=1), axis=0), fp8_max)
        q = _scaled_byte(v, s, fp8_max, MANTISSA, BIAS, FNUZ, CAST)
        tl.store(y + r[:, None] * cols + c[None, :], q, mask=mask)
        if COLS:
            tl.store(yt + c[:, None] * ld_t + r[None, :], tl.trans(q), mask=tl.trans(mask))
        tl.store(inv + tile_r * blocks_c + tile_c, _inverse(s))
    else:
        if ROWS:  # each row's 128 elements by their own scale
            s_r = _block_scale(tl.max(bits, axis=1), fp8_max)
            q = _scaled_byte(v, s_r[:, None], fp8_max, MANTISSA, BIAS, FNUZ, CAST)
            tl.store(y + r[:, None] * cols + c[None, :], q, mask=mask)
            tl.store(inv + r * blocks_c + tile_c, _inverse(s_r), mask=r < rows)
        if COLS:  # each column's 128 elements by theirs, stored transposed
            s_c = _block_scale(tl.max(bits, axis=0), fp8_max)
            q = _scaled_byte(v, s_c[None, :], fp8_max, MANTISSA, BIAS, FNUZ, CAST)
            tl.store(yt + c[:, None] * ld_t + r[None, :], tl.trans(q), mask=tl.trans(mask))
            blocks_r = tl.cdiv(rows, 128)
            tl.store(inv_t + c * blocks_r + tile_r, _inverse(s_c), mask=c < cols)


def needs_int64(rows: int, cols: int, ld_t: int) -> bool:
    """Offsets past int32 in ``_cast_blocks``' outputs, the last 128 x 128 tile's masked lanes
    included."""
    return max((rows + BLOCK) * (cols + BLOCK), (cols + BLOCK) * (ld_t + BLOCK)) >= 2**31


def cast_blocks(
    x: torch.Tensor, dtype: torch.dtype, rows_out: bool, cols_out: bool, tiles: bool, ld_t: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(y, inv, yt, inv_t)`` of a contiguous 2-D ``x`` [R, C] in one launch, as
    ``fp8_blockwise``'s torch functions compute them (``None`` where not asked): ``tiles`` the
    128 x 128 blocks (``inv`` [ceil(R/128), ceil(C/128)], ``yt`` their transposed bytes with
    ``cols_out``), else ``rows_out`` the 1 x 128 blocks of rows (``inv`` [R, ceil(C/128)]) and
    ``cols_out`` those of columns, transposed (``yt`` [C, ld_t], zeros past R; ``inv_t`` [C,
    ceil(R/128)])."""
    rows, cols = x.shape
    mantissa, bias, fnuz = FORMATS[dtype]
    fp8_max = float(torch.finfo(dtype).max)
    dev = x.device
    blocks_r, blocks_c = cdiv(rows, BLOCK), cdiv(cols, BLOCK)
    y = inv = yt = inv_t = None
    if rows_out or tiles:
        y = torch.empty((rows, cols), dtype=dtype, device=dev)
        shape = (blocks_r, blocks_c) if tiles else (rows, blocks_c)
        inv = torch.empty(shape, dtype=torch.float32, device=dev)
    if cols_out:
        yt = torch.empty((cols, ld_t), dtype=dtype, device=dev)
        if ld_t > rows:
            yt[:, rows:].view(torch.uint8).zero_()
        if not tiles:
            inv_t = torch.empty((cols, blocks_r), dtype=torch.float32, device=dev)
    if x.numel():
        placeholder = (y if y is not None else yt).view(torch.uint8)
        scales = inv if inv is not None else inv_t
        _cast_blocks[(blocks_r, blocks_c)](
            x, placeholder, scales, placeholder if yt is None else yt.view(torch.uint8),
            scales if inv_t is None else inv_t, rows, cols, ld_t, fp8_max, MANTISSA=mantissa,
            BIAS=bias, FNUZ=fnuz, CAST=cast_kind(dtype, dev), ROWS=rows_out, COLS=cols_out,
            TILES=tiles, WIDE=needs_int64(rows, cols, ld_t), num_warps=CAST_WARPS,
        )  # fmt: skip
    return y, inv, yt, inv_t


@triton.jit
def _block_mm(
    a, b, c, sa, sb, M, N, K,
    s_am, s_ak, s_bn, s_bk, s_cm, s_cn, s_sam, s_sak, s_sbn, s_sbk,
    B_TILES: tl.constexpr, ACCUMULATE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    programs_m = tl.cdiv(M, BLOCK_M)
    programs_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * programs_n  # grouped order: neighbours share rows of a in the cache
    first_m = (pid // width) * GROUP_M
    group = min(programs_m - first_m, GROUP_M)
    pm = first_m + (pid % width) % group
    pn = (pid % width) // group
    om = (pm * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    on = (pn * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    # loads wrap past the last row and column (in bounds, unmasked); the store is masked
    lm = om % M
    ln = on % N
    ok = tl.arange(0, 128)
    a_ptr = a + lm[:, None] * s_am + ok[None, :] * s_ak
    b_ptr = b + ok[:, None] * s_bk + ln[None, :] * s_bn
    sa_ptr = sa + lm * s_sam
    if B_TILES:  # one 128-wide tile column per program: one scale per step of K
        tl.static_assert(BLOCK_N == 128)
        sb_ptr = sb + pn * s_sbn
    else:
        sb_ptr = sb + ln * s_sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, 128)):
        if EVEN_K:
            av = tl.load(a_ptr)
            bv = tl.load(b_ptr)
        else:
            left = K - kb * 128
            av = tl.load(a_ptr, mask=ok[None, :] < left, other=0.0)
            bv = tl.load(b_ptr, mask=ok[:, None] < left, other=0.0)
        a_s = tl.load(sa_ptr + kb * s_sak)
        b_s = tl.load(sb_ptr + kb * s_sbk)
        if B_TILES:  # the row scales times the tile's: one multiply of the product, not two
            # (the two powers of two multiplied first: below fp32's range only for block
            # maxima whose product is under about 1e-30, far below any gradient's)
            acc += tl.dot(av, bv) * (a_s * b_s)[:, None]
        else:
            acc += tl.dot(av, bv) * a_s[:, None] * b_s[None, :]
        a_ptr += 128 * s_ak
        b_ptr += 128 * s_bk
    c_ptr = c + om[:, None] * s_cm + on[None, :] * s_cn
    mask = (om < M)[:, None] & (on < N)[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr, acc.to(c.dtype.element_ty), mask=mask)


def gemm_config(b_tiles: bool, hip: bool) -> GemmConfig:
    """The GEMM's tile for its right operand's scales and the platform."""
    if hip:
        return GEMM_HIP
    return GEMM_TILES if b_tiles else GEMM_BLOCKS


def block_mm(
    a: torch.Tensor,
    a_inv: torch.Tensor,
    b: torch.Tensor,
    b_inv: torch.Tensor,
    b_tiles: bool,
    out: torch.Tensor,
    accumulate: bool,
) -> torch.Tensor:
    """``out = a @ b^T`` (``accumulate``: ``out +=``) in one launch; the operands and scales as
    ``fp8_blockwise.block_mm`` documents them, any strides."""
    m, k = a.shape
    n = b.shape[0]
    cfg = gemm_config(b_tiles, is_hip())
    grid = (cdiv(m, cfg.block_m) * cdiv(n, GEMM_BLOCK_N),)
    _block_mm[grid](
        a, b, out, a_inv, b_inv, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), a_inv.stride(0), a_inv.stride(1), b_inv.stride(0),
        b_inv.stride(1), B_TILES=b_tiles, ACCUMULATE=accumulate, EVEN_K=k % BLOCK == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=GEMM_BLOCK_N, GROUP_M=GEMM_GROUP_M,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return out


# each ROCm arch's FP8 GEMM operands (gfx942: the fnuz formats, gfx950: OCP), as Triton names
# them: the forward's E4M3 x E4M3, the gradients' E5M2 (``hybrid``) or E4M3 times E4M3
_ARCH_FORMATS = {"gfx942": ("fp8e4b8", "fp8e5b16"), "gfx950": ("fp8e4nv", "fp8e5")}


def aot_configs(shapes: aot.Shapes) -> list[aot.Launch]:
    """What ROCm launches: the casts with the integer encode (``CAST=0``) for every input dtype
    and FP8 format, in each of their modes, int32 and int64 offsets; the GEMM with its arch's
    formats (gfx90a has no FP8 GEMM: FP8 is refused there) into every output dtype, with tiles
    or 1 x 128 blocks on the right, added into an fp32 or bf16 ``main_grad`` or not, with K a
    multiple of 128 (no masks) or not."""
    rows = max(shapes.seq_lens) * max(shapes.batch)
    widest = max(shapes.ffn_hiddens + shapes.hiddens)
    modes = ((True, True, False), (True, False, False), (False, True, False),
             (False, False, True), (False, True, True))  # fmt: skip
    out = []
    for source, (mantissa, bias, fnuz) in itertools.product(shapes.dtypes, FORMATS.values()):
        for wide, (rows_out, cols_out, tiles) in itertools.product(
            sorted({needs_int64(rows, widest, rows), False}), modes
        ):
            consts = dict(MANTISSA=mantissa, BIAS=bias, FNUZ=fnuz, CAST=0, ROWS=rows_out,
                          COLS=cols_out, TILES=tiles, WIDE=wide)  # fmt: skip
            out.append(
                aot.launch(
                    _cast_blocks,
                    consts,
                    ptrs=dict(x=source, y="u8", inv=torch.float32, yt="u8", inv_t=torch.float32),
                    floats=("fp8_max",),
                    num_warps=CAST_WARPS,
                    grid=(cdiv(rows, BLOCK), cdiv(widest, BLOCK)),
                    neutral=("BIAS",),
                )  # fmt: skip
            )
    for arch, (e4m3, e5m2) in _ARCH_FORMATS.items():
        for (a, b), out_type, b_tiles, accumulate, even_k in itertools.product(
            ((e4m3, e4m3), (e5m2, e4m3)), (torch.bfloat16, torch.float32), (True, False),
            (False, True), (True, False),
        ):  # fmt: skip
            consts = dict(B_TILES=b_tiles, ACCUMULATE=accumulate, EVEN_K=even_k,
                          BLOCK_M=GEMM_HIP.block_m, BLOCK_N=GEMM_BLOCK_N, GROUP_M=GEMM_GROUP_M)  # fmt: skip
            out.append(
                aot.launch(
                    _block_mm,
                    consts,
                    ptrs=dict(a=a, b=b, c=out_type, sa=torch.float32, sb=torch.float32),
                    num_warps=GEMM_HIP.warps,
                    num_stages=GEMM_HIP.stages,
                    archs=(arch,),
                    grid=(cdiv(8192, GEMM_HIP.block_m) * cdiv(widest, GEMM_BLOCK_N),),
                )  # fmt: skip
            )
    return out
