"""FP8 block scaling without TransformerEngine: upstream's ``--fp8-recipe blockwise``.

TE's ``Float8BlockScaling`` (the DeepSeek-V3 recipe): activations and output gradients scale
each run of 128 elements along a row by its own amax (1 x 128 blocks), weights each 128 x 128
tile. A GEMM contracts over those blocks, so each operand of a linear comes in the layout of
the GEMM that reads it: the input ``x`` [M, K] in 1 x 128 blocks of its rows for the forward,
and of its columns (stored transposed, [K, M]) for the weight gradient, which contracts over the
tokens; the same for the output gradient. A weight tile's scale serves the weight and its
transpose. Scales are powers of two (TE's default for this recipe,
``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` unset): ``fp8_max / amax`` rounded down, so dequantizing
is exact; a block of zeros, or with an inf, scales by 1 (TE's rule); NaNs are left out of the
amax and stay NaN.

Every function here has its math in torch (the CPU's path and the tests' oracle); on a GPU
``fp8_blockwise_triton`` casts in one read of the tensor. The GEMM takes the scales through
``torch._scaled_mm`` where cuBLASLt has block-scaled kernels (CUDA, Hopper and later), and
through ``fp8_blockwise_triton._block_mm`` where it has none (ROCm: hipBLASLt has no block
scaling), or for a problem (its sizes and dtypes) cuBLASLt computes wrong or refused: its
first product of each problem is checked against the Triton kernel's (``cublaslt_takes``
names the case found on an H200). The CPU dequantizes and multiplies in fp32. The weight
gradient is added into ``main_grad`` by the GEMM itself: cuBLASLt's with ``beta = 1``
(``kernels.fp8_accumulate``) once its problem is checked, the Triton kernel's on ROCm.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_rocm.runtime.kernels.fp8 import (
    _ALIGN,
    _apply,
    _on_device,
    amax_without_nan,
    capturing,
)
from megatron_rocm.runtime.kernels.fp8_accumulate import accumulate
from megatron_rocm.runtime.kernels.launch import (
    cdiv,
    interpreting,
    is_hip,
    log_fallback_once,
    reference_forced,
    use_triton,
)

BLOCK = 128
KERNEL = "fp8_blockwise"  # MEGATRON_ROCM_KERNELS=reference:fp8_blockwise: torch's casts and GEMM


class Blocks(NamedTuple):
    """An FP8 tensor [R, C] (row-major) and the inverses of its block scales (fp32): [R,
    ceil(C/128)] for 1 x 128 blocks, [ceil(R/128), ceil(C/128)] for 128 x 128 tiles."""

    data: torch.Tensor
    inv: torch.Tensor


def _power_of_two(scale: torch.Tensor) -> torch.Tensor:
    """Positive normal fp32 ``scale`` rounded down to a power of two (its mantissa cleared)."""
    return (scale.view(torch.int32) & 0x7F800000).view(torch.float32)


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x`` in fp32 with zeros up to ``rows`` x ``cols``: zeros raise no amax."""
    x = x.float()
    return torch.nn.functional.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def scales_of(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """The power-of-two scales of blocks with these fp32 amaxes: TE's
    ``compute_scale_from_amax`` (``fp8_max / amax`` correctly rounded, at most fp32's largest
    value, 1 where the amax is zero or inf) rounded down."""
    usable = (amax > 0) & torch.isfinite(amax)
    quotient = torch.full_like(amax, fp8_max) / torch.where(usable, amax, 1.0)
    scale = torch.where(usable, quotient, 1.0).clamp(max=torch.finfo(torch.float32).max)
    return _power_of_two(scale.contiguous())


def quantize_rows_reference(x: torch.Tensor, dtype: torch.dtype) -> Blocks:
    """1 x 128 blocks along the rows of a 2-D ``x``, in torch."""
    rows, cols = x.shape
    fp8_max = float(torch.finfo(dtype).max)
    nb = cdiv(cols, BLOCK)
    blocks = _padded(x, rows, nb * BLOCK).view(rows, nb, BLOCK)
    scale = scales_of(amax_without_nan(blocks, (2,)), fp8_max)
    data = _apply(blocks, scale[..., None], dtype, fp8_max).view(rows, nb * BLOCK)[:, :cols]
    return Blocks(data.contiguous(), scale.reciprocal())


def quantize_tiles_reference(x: torch.Tensor, dtype: torch.dtype) -> Blocks:
    """128 x 128 tiles of a 2-D ``x``, in torch."""
    rows, cols = x.shape
    fp8_max = float(torch.finfo(dtype).max)
    tr, tc = cdiv(rows, BLOCK), cdiv(cols, BLOCK)
    tiles = _padded(x, tr * BLOCK, tc * BLOCK).view(tr, BLOCK, tc, BLOCK)
    scale = scales_of(amax_without_nan(tiles, (1, 3)), fp8_max)
    data = _apply(tiles, scale[:, None, :, None], dtype, fp8_max).view(tr * BLOCK, tc * BLOCK)
    return Blocks(data[:rows, :cols].contiguous(), scale.reciprocal())


def padded_tokens(rows: int) -> int:
    """The transposed operands' row length: the tokens up to a multiple of 16 (zeros), the
    weight gradient's inner dimension as ``torch._scaled_mm`` takes it (``fp8.pad_rows``)."""
    return cdiv(rows, _ALIGN) * _ALIGN


def _pad_columns(t: Blocks, width: int) -> Blocks:
    extra = width - t.data.shape[1]
    if extra == 0:
        return t
    data = torch.nn.functional.pad(t.data.view(torch.uint8), (0, extra)).view(t.data.dtype)
    return Blocks(data, t.inv)


def _triton_takes(x: torch.Tensor) -> bool:
    return x.numel() > 0 and x.dim() == 2 and use_triton(x, kernel=KERNEL)


def _cast(
    x: torch.Tensor, dtype: torch.dtype, rows: bool, cols: bool, tiles: bool
) -> tuple[Blocks | None, Blocks | None]:
    """(row-major blocks or tiles, transposed blocks or tiles) of a 2-D ``x``, as asked."""
    width = padded_tokens(x.shape[0])
    if _triton_takes(x):
        from megatron_rocm.runtime.kernels import fp8_blockwise_triton as kernels

        with torch.no_grad(), _on_device(x):
            y, inv, yt, inv_t = kernels.cast_blocks(
                x.detach().contiguous(), dtype, rows, cols, tiles, width
            )
        direct = Blocks(y, inv) if y is not None else None
        if yt is None:
            return direct, None
        return direct, Blocks(yt, inv.t() if tiles else inv_t)
    with torch.no_grad():
        if tiles:
            t = quantize_tiles_reference(x, dtype)
            turned = Blocks(t.data.t().contiguous(), t.inv.t()) if cols else None
            return t, None if turned is None else _pad_columns(turned, width)
        direct = quantize_rows_reference(x, dtype) if rows else None
        turned = _pad_columns(quantize_rows_reference(x.t(), dtype), width) if cols else None
        return direct, turned


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, transposed: bool) -> tuple:
    """``(Blocks of x's rows, Blocks of its columns transposed or None)``: the 1 x 128 blocks
    an activation or output gradient [M, K] needs; the transposed one is [K, M16] (the tokens
    zero-padded to 16) with scales [K, ceil(M/128)]."""
    return _cast(x, dtype, rows=True, cols=transposed, tiles=False)


def quantize_tiles(w: torch.Tensor, dtype: torch.dtype, transposed: bool) -> tuple:
    """``(Blocks of w's 128 x 128 tiles, the same transposed or None)``: a weight [N, K]."""
    return _cast(w, dtype, rows=False, cols=transposed, tiles=True)


def quantize_transposed_rows(x: torch.Tensor, dtype: torch.dtype) -> Blocks:
    """Only the transposed 1 x 128 blocks of ``x`` (see :func:`quantize_rows`)."""
    return _cast(x, dtype, rows=False, cols=True, tiles=False)[1]


def dequantize_rows(t: Blocks) -> torch.Tensor:
    """fp32 values of 1 x 128 blocks (columns past the scales' reach are padding)."""
    cols = t.data.shape[1]
    inv = t.inv.repeat_interleave(BLOCK, dim=1)[:, :cols]
    return t.data.float() * inv


def dequantize_tiles(t: Blocks) -> torch.Tensor:
    """fp32 values of 128 x 128 tiles."""
    rows, cols = t.data.shape
    inv = t.inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return t.data.float() * inv


# what raised in this process: "triton", or a problem (``_problem``) cuBLASLt refused or
# computed wrong; and the cuBLASLt problems whose first product passed its check
_failed: set[object] = set()
_checked: set[tuple] = set()


def _problem(a: Blocks, b: Blocks, b_tiles: bool, out_dtype: torch.dtype) -> tuple:
    """What decides whether cuBLASLt takes a GEMM: K and N (the scales' shapes follow them),
    whether M is a multiple of 4 (the 1 x 128 scales' row stride is M), the layouts and
    dtypes."""
    k, n, m = a.data.shape[1], b.data.shape[0], a.data.shape[0]
    return (k, n, b_tiles, a.data.dtype, b.data.dtype, out_dtype, m % 4 == 0)


def gemm_path(a: torch.Tensor, problem: tuple | None = None) -> str:
    """Which GEMM serves ``a``'s device: ``scaled_mm`` (cuBLASLt's block-scaled kernels:
    CUDA), ``triton`` (ROCm, the interpreter, or a ``problem`` cuBLASLt refused) or
    ``emulated`` (the CPU, the reference switch)."""
    if a.device.type == "cuda" and not reference_forced(KERNEL):
        suits = problem is None or (problem not in _failed and cublaslt_takes(problem))
        if not is_hip() and suits:
            return "scaled_mm"
        if "triton" not in _failed and use_triton(a, kernel=KERNEL):
            return "triton"
        return "emulated"
    if a.device.type == "cpu" and interpreting() and "triton" not in _failed:
        return "triton" if use_triton(a, kernel=KERNEL) else "emulated"
    return "emulated"


def _fail(key: object, exc: Exception) -> None:
    _failed.add(key)
    reason = (str(exc).strip().splitlines() or [""])[0][:200]
    where = "Triton" if key == "triton" else f"cuBLASLt (K, N, tiles, dtypes: {key})"
    log_fallback_once(
        f"fp8-blockwise-{key}",
        f"FP8 block-scaled GEMM on {where} failed ({type(exc).__name__}: {reason}); "
        "using the next path",
    )


def _emulated(a: Blocks, b: Blocks, b_tiles: bool) -> torch.Tensor:
    rhs = dequantize_tiles(b) if b_tiles else dequantize_rows(b)
    return dequantize_rows(a) @ rhs.t()


def _scaled_mm(a: Blocks, b: Blocks, b_tiles: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLASLt through ``torch._scaled_mm``: ``a`` row-major with its 1 x 128 scales
    M-major, ``b`` column-major ([K, N] view of the row-major [N, K]) with its tile scales
    as [ceil(K/128), ceil(N/128)] over row-major tiles, or its 1 x 128 scales N-major."""
    scale_a = a.inv.t().contiguous().t()
    scale_b = b.inv.contiguous().t() if b_tiles else b.inv.t().contiguous()
    return torch._scaled_mm(a.data, b.data.t(), scale_a=scale_a, scale_b=scale_b,
                            out_dtype=out_dtype)  # fmt: skip


def cublaslt_takes(problem: tuple) -> bool:
    """Whether cuBLASLt computes this problem right: with 128 x 128 tiles only where the
    contraction has a multiple of 4 blocks (K a multiple of 512). With another count torch
    accepts the scales and the product is wrong (relative errors of 0.5 to 1,000 on an H200,
    torch 2.11; a scale row padded to 16 bytes is refused). The 1 x 128 scales' row stride is
    M, which must be 16-byte aligned as well (M a multiple of 4; TE pads it)."""
    k, _, tiles = problem[:3]
    m_aligned = problem[-1]  # TE pads the 1 x 128 scales to a 16-byte row stride; torch cannot
    return m_aligned and (not tiles or cdiv(k, BLOCK) % 4 == 0)


_CHECK_TOLERANCE = 1e-2  # of the largest |value|: FP8 accumulation differs by about 2e-4


def _checked_scaled_mm(
    a: Blocks, b: Blocks, b_tiles: bool, dtype: torch.dtype, problem: tuple
) -> torch.Tensor | None:
    """cuBLASLt's product, checked against the next path on the first call of each problem
    (a wrong kernel is silent, as ``cublaslt_takes`` says); None where it raised or differed
    (logged once, the problem goes to the next path from then on)."""
    try:
        out = _scaled_mm(a, b, b_tiles, dtype)
    except (RuntimeError, ValueError) as exc:  # no block-scaled kernel for this GPU or shape
        _fail(problem, exc)
        return None
    if problem in _checked:
        return out
    want = torch.empty(out.shape, dtype=torch.float32, device=out.device)
    if not _on_triton(a, b, b_tiles, want, accumulate=False):
        want = _emulated(a, b, b_tiles)
    verdict = _verdict(out.float(), want)
    if verdict is None:  # nothing to judge by (zeros, inf or NaN): the next path's product
        return want.to(dtype)
    if not verdict:
        _fail(problem, ValueError("its product differs from the Triton kernel's"))
        return None
    _checked.add(problem)
    return out


def _verdict(got: torch.Tensor, want: torch.Tensor) -> bool | None:
    """Whether ``got`` matches ``want`` row by row (each row within ``_CHECK_TOLERANCE`` of its
    own largest value, so a wrong scale on small rows shows; a row of zeros exactly), or None
    where ``want`` cannot judge: empty, not finite, or zeros only."""
    if want.numel() == 0 or not bool(torch.isfinite(want).all()):
        return None
    largest = want.abs().amax(dim=1, keepdim=True)
    if not bool((largest > 0).any()):
        return None
    return bool(((got - want).abs() <= _CHECK_TOLERANCE * largest).all())


def _on_triton(a: Blocks, b: Blocks, b_tiles: bool, out: torch.Tensor, accumulate: bool) -> bool:
    """``out (+)= a @ b^T`` by the Triton kernel; False where it is unusable or failed
    (logged once; a compile failure comes before any write)."""
    if "triton" in _failed or not use_triton(a.data, kernel=KERNEL):
        return False
    from megatron_rocm.runtime.kernels import fp8_blockwise_triton as kernels

    try:
        with _on_device(a.data):
            kernels.block_mm(a.data, a.inv, b.data, b.inv, b_tiles, out, accumulate)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - the emulation still works
        _fail("triton", exc)
        return False
    return True


def _accumulated(a: Blocks, b: Blocks, into: torch.Tensor) -> bool:
    """``into += a @ b^T`` of two operands in 1 x 128 blocks (the weight gradient) by cuBLASLt's
    GEMM with ``beta = 1`` (``kernels.fp8_accumulate``): no fp32 product, no separate add.
    False where it cannot. Taken only for a problem whose ``torch._scaled_mm`` product passed
    its check against the Triton kernel; ``fp8_accumulate`` checks each of its own plans
    against ``torch._scaled_mm`` on first use."""
    return accumulate(
        into, a.data, a.inv.t().contiguous(), b.data.t(), b.inv.t().contiguous(), blocks=True
    )


def block_mm(
    a: Blocks,
    b: Blocks,
    b_tiles: bool,
    out_dtype: torch.dtype,
    add_into: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``a @ b^T`` of ``a`` [M, K] in 1 x 128 blocks and ``b`` [N, K] in 128 x 128 tiles
    (``b_tiles``) or 1 x 128 blocks, both row-major, in ``out_dtype``; with ``add_into`` (a
    contiguous [M, N] tensor) the product is added into it and None returned: on CUDA by the
    GEMM itself once its problem is checked (``_accumulated``), by the Triton kernel on ROCm."""
    dtype = torch.float32 if add_into is not None else out_dtype
    problem = _problem(a, b, b_tiles, dtype)
    path = gemm_path(a.data, problem)
    if path == "scaled_mm" and problem not in _checked and capturing(a.data):
        # the first-use check reads its verdict on the host, which a graph capture cannot
        path = "triton" if "triton" not in _failed else "emulated"
    if path == "scaled_mm":
        checked_wgrad = add_into is not None and not b_tiles and problem in _checked
        if checked_wgrad and _accumulated(a, b, add_into):
            return None
        out = _checked_scaled_mm(a, b, b_tiles, dtype, problem)
        if out is None:
            return block_mm(a, b, b_tiles, out_dtype, add_into)
        if add_into is None:
            return out
        add_into.add_(out)
        return None
    if path == "triton":
        out = add_into
        if out is None:
            out = torch.empty(a.data.shape[0], b.data.shape[0], dtype=out_dtype,
                              device=a.data.device)  # fmt: skip
        if _on_triton(a, b, b_tiles, out, accumulate=add_into is not None):
            return None if add_into is not None else out
    product = _emulated(a, b, b_tiles)
    if add_into is None:
        return product.to(out_dtype)
    add_into.add_(product)
    return None
