"""FP8 on this device (``--fp8-format`` without TE): the formats its arch trains in (the
``fnuz`` ones on gfx942, OCP elsewhere); the bytes of every quantize a training step makes
(current scaling with the padded transpose the GEMMs read, delayed scaling's history under
both amax algorithms, a shard cast into a byte buffer at an odd offset, the byte transpose,
the MoE experts' segments each by its own amax), each against torch's own cast on this device;
and the FP8 linear's and the MoE experts' GEMMs, called as training calls them, against fp32
math on the same FP8 operands, the linear's weight gradient also added into a ``main_grad``
(by the GPU's BLAS-Lt GEMM where it serves, ``kernels.fp8_accumulate``); block scaling's casts
and GEMMs (``--fp8-recipe blockwise``). Inputs are finite bf16, as
the linears quantize. A GPU without FP8 GEMMs skips: there ``--fp8-format`` is refused at
argument validation."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from megatron_rocm.envtools.smoke import refmath
from megatron_rocm.envtools.smoke.checks_kernels import _kernel, _path, _Tally
from megatron_rocm.envtools.smoke.runner import CheckFailed, Context, Skip, register

SHAPES = ((48, 64), (33, 80))  # 33 rows: the transpose's padding to 16
# delayed scaling over a history of 2: growth past it saturates, and the largest amax leaves
# the window (max) where the newest alone decides (most_recent)
DELAYED = (2, (1.0, 4.0, 0.5, 1.0, 0.25, 2.0))


def _randn(ctx: Context, shape: tuple[int, ...], seed: int, magnitude: float = 1.0) -> Tensor:
    """Seeded bf16 on the device: a failure repeats."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * magnitude
    return x.to(device=ctx.device, dtype=torch.bfloat16)


class _Bytes:
    """Counts byte-for-byte comparisons; fails on the first FP8 tensor that is not torch's."""

    def __init__(self, fault: bool) -> None:
        self.cases = 0
        self.fault = fault

    def same(self, label: str, got: Tensor, want: Tensor) -> None:
        got, want = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
        if self.fault:  # MEGATRON_ROCM_SMOKE_FAULT=fp8: break the kernel's result
            got = got.clone()
            got.view(-1)[0] ^= 1
        if got.shape != want.shape:
            raise CheckFailed(f"{label}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        wrong = (got != want).flatten().nonzero()
        if wrong.numel():
            raise CheckFailed(
                f"{label}: {wrong.numel()} of {want.numel()} bytes differ from torch's cast "
                f"(first at flat index {wrong[0].item()})"
            )
        self.cases += 1

    def scale(self, label: str, got: Tensor, scale: Tensor) -> None:
        if not torch.equal(got.detach().float(), scale.reciprocal()):
            raise CheckFailed(f"{label}: inverse scale {got.item()!r} != 1/{scale.item()!r}")


def _current(k: ModuleType, ctx: Context, check: _Bytes, dtype: torch.dtype) -> None:
    for seed, shape in enumerate(SHAPES):
        x = _randn(ctx, shape, seed)
        label = f"{dtype} {shape}"
        want, scale = refmath.fp8_quantize(x, dtype)
        got, inverse = k.quantize(x, dtype)
        check.same(f"{label} quantize", got, want)
        check.scale(f"{label} quantize", inverse, scale)
        got, got_t, inverse = k.quantize_transposed(x, dtype)
        rows = x.shape[0]
        check.same(f"{label} quantize_transposed", got, want)
        check.same(f"{label} transpose", got_t[:, :rows], want.t())
        if got_t[:, rows:].view(torch.uint8).any():
            raise CheckFailed(f"{label} transpose: its padding past row {rows} is not zero")
        check.scale(f"{label} quantize_transposed", inverse, scale)
        check.same(f"{label} transpose_fp8", k.transpose_fp8(want), want.t())
        buffer = torch.zeros(x.numel() + 7, dtype=torch.uint8, device=ctx.device)
        k.cast_into(x, scale, buffer[3 : 3 + x.numel()], dtype)  # a shard at an odd offset
        check.same(f"{label} cast_into", buffer[3 : 3 + x.numel()], want.reshape(-1))


def _delayed(k: ModuleType, ctx: Context, check: _Bytes, dtype: torch.dtype) -> None:
    """A history's scales: the first quantize by its own amax, then by the largest of the
    last ``length`` amaxes (``max``) or by the newest (``most_recent``)."""
    length, magnitudes = DELAYED
    for most_recent in (False, True):
        history = k.AmaxHistory(length, most_recent=most_recent)
        earlier: list[Tensor] = []
        for step, magnitude in enumerate(magnitudes):
            x = _randn(ctx, SHAPES[step % 2], 10 + step, magnitude)
            amax = x.float().abs().amax()
            window = earlier[-1:] if most_recent else earlier[-length:]
            scale = refmath.fp8_scale(max(window, key=float) if earlier else amax, dtype)
            got, got_t, inverse = k.quantize_transposed(x, dtype, 0, history)
            label = f"{dtype} delayed ({'most_recent' if most_recent else 'max'}) step {step + 1}"
            check.same(label, got, refmath.fp8_cast(x, scale, dtype))
            check.same(f"{label} transpose", got_t[:, : x.shape[0]], got.t())
            check.scale(label, inverse, scale)
            earlier.append(amax)


def _dequantized(t: Tensor, dtype: torch.dtype) -> Tensor:
    """The FP8 operand refmath quantizes from ``t``, in fp32: what the GEMMs multiply."""
    t_fp8, scale = refmath.fp8_quantize(t, dtype)
    return t_fp8.float() / scale


# the MoE experts' rows: an expert without tokens, one past a 16-row bucket, one of a single row
EXPERT_ROWS = (20, 0, 1)


def _segments(ctx: Context, check: _Bytes, dtype: torch.dtype) -> None:
    """Each expert's rows quantized by its own amax (``fp8_segments``, as the FP8 experts
    quantize their tokens): the rows and their zero-padded transpose."""
    from megatron_rocm.runtime.kernels.fp8_segments import Segments, quantize_segments

    segs = Segments(EXPERT_ROWS, 16)
    x = torch.cat([_randn(ctx, (rows, 48), 30 + e, 4.0**-e) for e, rows in enumerate(EXPERT_ROWS)])
    got = quantize_segments(x, segs, dtype)
    for e in segs.nonempty():
        start, rows = segs.starts[e], segs.counts[e]
        want, scale = refmath.fp8_quantize(x[start : start + rows], dtype)
        label = f"{dtype} expert {e} of {len(EXPERT_ROWS)}"
        check.same(label, got.data[start : start + rows], want)
        check.same(f"{label} transpose", got.t(e)[:, :rows], want.t())
        if got.t(e)[:, rows:].view(torch.uint8).any():
            raise CheckFailed(f"{label} transpose: its padding past row {rows} is not zero")
        check.scale(label, got.inv(e), scale)


def _experts(ctx: Context, tally: _Tally, formats: object) -> None:
    """The FP8 MoE experts' function (``backend.fp8_experts``: every expert's GEMMs over its
    bucket, written into one output) against fp32 math on each expert's operands quantized
    as refmath quantizes them."""
    from megatron_rocm.runtime.backend import fp8 as backend_fp8
    from megatron_rocm.runtime.backend import fp8_experts
    from megatron_rocm.runtime.kernels.fp8_segments import Segments

    segs = Segments(EXPERT_ROWS, fp8_experts.EXPERT_ROW_BUCKET)
    x = _randn(ctx, (segs.rows, 64), 40).requires_grad_()
    weights = [_randn(ctx, (32, 64), 41 + e, 0.1).requires_grad_() for e in range(len(EXPERT_ROWS))]
    dy = _randn(ctx, (segs.rows, 32), 45)
    call = fp8_experts.ExpertsCall(
        segs, backend_fp8.Fp8Recipe(formats=formats), False, fp8_experts.ExpertWeightCache(), None
    )
    y = fp8_experts.fp8_experts(x, tuple(weights), call)
    y.backward(dy)

    for e in segs.nonempty():
        rows = slice(segs.starts[e], segs.starts[e + 1])
        xq, wq = _dequantized(x[rows], formats.forward), _dequantized(weights[e], formats.forward)
        dyq = _dequantized(dy[rows], formats.backward)
        label = f"FP8 expert {e}"
        tally.compare(f"{label} forward", y[rows], xq @ wq.t(), torch.bfloat16)
        tally.compare(f"{label} input gradient", x.grad[rows], dyq @ wq, torch.bfloat16)
        tally.compare(f"{label} weight gradient", weights[e].grad, dyq.t() @ xq, torch.bfloat16)
    if weights[EXPERT_ROWS.index(0)].grad.any():
        raise CheckFailed("FP8 experts: the expert without tokens got a weight gradient")


def _linear(ctx: Context, tally: _Tally, formats: object) -> None:
    """The FP8 linear's forward, input gradient and weight gradient (``backend.fp8``: its
    GEMM calls, fast accumulation and the padded token dimension included) against fp32
    math on the operands quantized as refmath quantizes them."""
    from megatron_rocm.runtime.backend import fp8 as backend_fp8

    x = _randn(ctx, (33, 64), 20).requires_grad_()
    w = _randn(ctx, (96, 64), 21, 0.1).requires_grad_()
    dy = _randn(ctx, (33, 96), 22)
    recipe = backend_fp8.Fp8Recipe(formats=formats)
    y = backend_fp8.fp8_linear(x, w, False, recipe)
    y.backward(dy)

    xq, wq = _dequantized(x, formats.forward), _dequantized(w, formats.forward)
    dyq = _dequantized(dy, formats.backward)
    tally.compare("FP8 linear forward", y, xq @ wq.t(), torch.bfloat16)
    tally.compare("FP8 linear input gradient", x.grad, dyq @ wq, torch.bfloat16)
    tally.compare("FP8 linear weight gradient", w.grad, dyq.t() @ xq, torch.bfloat16)


def _accumulated(ctx: Context, tally: _Tally, formats: object) -> str:
    """The FP8 linear's weight gradient under gradient-accumulation fusion, added into an fp32
    and a bf16 ``main_grad`` that already hold a gradient, against that gradient plus fp32 math;
    says whether the GPU's BLAS added it in the GEMM (``kernels.fp8_accumulate``) or the add
    ran separately (its first-use check failed, or the CPU: the log says why)."""
    from megatron_rocm.runtime.backend import fp8 as backend_fp8
    from megatron_rocm.runtime.kernels import fp8_accumulate

    x = _randn(ctx, (33, 64), 24).requires_grad_()
    dy = _randn(ctx, (33, 96), 25)
    xq, dyq = _dequantized(x, formats.forward), _dequantized(dy, formats.backward)
    recipe = backend_fp8.Fp8Recipe(formats=formats)
    served = []
    for grad_dtype in (torch.float32, torch.bfloat16):
        w = _randn(ctx, (96, 64), 26, 0.1).requires_grad_()
        start = _randn(ctx, (96, 64), 27).to(grad_dtype)
        w.main_grad = start.clone()
        backend_fp8.fp8_linear(x, w, True, recipe).backward(dy)
        want = start.float() + dyq.t() @ xq
        label = (
            f"FP8 linear weight gradient into a {str(grad_dtype).removeprefix('torch.')} main_grad"
        )
        tally.compare(label, w.main_grad, want, torch.bfloat16)
        if fp8_accumulate.served(w.device, formats.backward, formats.forward, grad_dtype):
            served.append(str(grad_dtype).removeprefix("torch."))
    if not served:
        return "weight gradients added into main_grad separately"
    return f"weight gradients added into a {' and '.join(served)} main_grad by {fp8_accumulate.library_name()}'s GEMM"


def _blockwise(ctx: Context, check: _Bytes, tally: _Tally, formats: object) -> str:
    """Block scaling (``--fp8-recipe blockwise``): the device's casts of 1 x 128 blocks (with
    their transpose) and 128 x 128 tiles (with theirs), bytes and inverse scales, against the
    torch path's, and the linear's three GEMMs against fp32 math on those operands. The sizes
    put the forward and the weight gradient on cuBLASLt where it serves (each checked against
    the Triton GEMM on its first call) and the input gradient on the Triton GEMM; ROCm runs
    Triton throughout. The weight gradient is then added twice into a ``main_grad`` that holds
    one (cuBLASLt's GEMM adds it where it serves, the Triton GEMM on ROCm). Says which ran, and
    any shape cuBLASLt failed or got wrong here."""
    from megatron_rocm.runtime.backend import fp8 as backend_fp8
    from megatron_rocm.runtime.kernels import fp8_accumulate
    from megatron_rocm.runtime.kernels import fp8_blockwise as bw

    x = _randn(ctx, (64, 512), 30).requires_grad_()
    w = _randn(ctx, (256, 512), 31, 0.1).requires_grad_()
    dy = _randn(ctx, (64, 256), 32)
    for dtype in (formats.forward, formats.backward):
        got = (*bw.quantize_rows(x.detach(), dtype, transposed=True),
               *bw.quantize_tiles(w.detach(), dtype, transposed=True))  # fmt: skip
        turned = bw.quantize_rows_reference(x.detach().t(), dtype)
        tiles = bw.quantize_tiles_reference(w.detach(), dtype)
        want = (bw.quantize_rows_reference(x.detach(), dtype), turned, tiles,
                bw.Blocks(tiles.data.t(), tiles.inv.t()))  # fmt: skip
        for label, mine, theirs in zip(("rows", "columns", "tiles", "tiles transposed"), got,
                                       want, strict=True):  # fmt: skip
            check.same(f"blockwise {label} {dtype}", mine.data, theirs.data)
            if not torch.equal(mine.inv, theirs.inv):
                raise CheckFailed(f"blockwise {label} {dtype}: inverse scales differ from torch's")
    before = set(bw._failed)
    recipe = backend_fp8.Fp8Recipe(formats=formats, blockwise=True)
    backend_fp8.fp8_linear(x, w, False, recipe).backward(dy)
    y = backend_fp8.fp8_linear(x.detach(), w.detach(), False, recipe)
    xq = bw.dequantize_rows(bw.quantize_rows_reference(x.detach(), formats.forward))
    wq = bw.dequantize_tiles(bw.quantize_tiles_reference(w.detach(), formats.forward))
    dyq = bw.dequantize_rows(bw.quantize_rows_reference(dy, formats.backward))
    dy_t = bw.dequantize_rows(bw.quantize_rows_reference(dy.t(), formats.backward))
    x_t = bw.dequantize_rows(bw.quantize_rows_reference(x.detach().t(), formats.forward))
    tally.compare("blockwise linear forward", y, xq @ wq.t(), torch.bfloat16)
    tally.compare("blockwise linear input gradient", x.grad, dyq @ wq, torch.bfloat16)
    tally.compare("blockwise linear weight gradient", w.grad, dy_t @ x_t.t(), torch.bfloat16)
    start = _randn(ctx, (256, 512), 33).float()
    w.main_grad = start.clone()
    for _ in range(2):  # added by cuBLASLt's GEMM itself where it serves (the problem is checked)
        backend_fp8.fp8_linear(x.detach(), w, True, recipe).backward(dy)
    want = start + 2 * (dy_t @ x_t.t())
    tally.compare("blockwise weight gradient into main_grad", w.main_grad, want, torch.bfloat16)
    if "triton" in bw._failed:
        raise CheckFailed("the FP8 block-scaled Triton GEMM failed (the log says why)")
    names = {"scaled_mm": "cuBLASLt and Triton", "triton": "Triton", "emulated": "fp32 emulation"}
    path = names[bw.gemm_path(x.detach())]
    failed = len(bw._failed - before)
    if failed:
        path += f" (cuBLASLt failed or disagreed on {failed} shape(s): Triton serves them)"
    if fp8_accumulate.plans_served(w.device, blocks=True):
        path += ", the weight gradient added into main_grad by cuBLASLt's GEMM"
    return f"block scaling's GEMMs on {path}"


def skip_without_fp8_gemms(ctx: Context) -> None:
    """Skip an FP8 check on a GPU without FP8 GEMMs (the CPU emulates them)."""
    reason = _kernel("fp8").unsupported_gpu_reason() if ctx.on_gpu else None
    if reason:
        raise Skip(f"{reason}: --fp8-format is refused on this GPU")


@register("kernels.fp8")
def fp8(ctx: Context) -> str:
    """The run's FP8 formats, quantize bytes against torch's cast, the FP8 linear's GEMMs."""
    skip_without_fp8_gemms(ctx)
    k = _kernel("fp8")
    formats = k.formats("hybrid")
    check, tally = _Bytes(ctx.fault == "fp8"), _Tally()
    for dtype in (formats.forward, formats.backward):
        _current(k, ctx, check, dtype)
        _delayed(k, ctx, check, dtype)
        _segments(ctx, check, dtype)
    _linear(ctx, tally, formats)
    added = _accumulated(ctx, tally, formats)
    _experts(ctx, tally, formats)
    blockwise = _blockwise(ctx, check, tally, formats)
    failed = k.failed_kernels()
    if failed:  # then torch's path answered: the comparisons above proved nothing of Triton
        raise CheckFailed(
            f"the FP8 Triton kernels failed for {sorted(map(str, failed))} and fell back to "
            "torch (the log says why)"
        )
    sample = torch.empty(1, device=ctx.device, dtype=torch.bfloat16)
    return (
        f"{formats.forward} / {formats.backward}: {check.cases} tensors byte for byte "
        f"torch's cast, the FP8 linear's and experts' GEMMs worst rel err {tally.worst:.2e} "
        f"({_path(ctx, sample, 'fp8')}); {added}; {blockwise}"
    )
