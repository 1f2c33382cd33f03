"""FP8 on this device (``--fp8-format`` without TE): the formats its arch trains in (the
``fnuz`` ones on gfx942, OCP elsewhere), each quantize path's bytes against torch's own cast on
this device (current scaling, with the transpose the GEMMs read, delayed scaling's history),
and the FP8 GEMM against fp32 math on the same operands. A GPU without FP8 GEMMs skips: there
``--fp8-format`` is refused at argument validation."""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rocm.envtools.smoke import refmath
from megatron_rocm.envtools.smoke.checks_kernels import _kernel, _path, _Tally
from megatron_rocm.envtools.smoke.runner import CheckFailed, Context, Skip, register

SHAPES = ((48, 64), (33, 80))  # 33 rows: the transpose's padding to 16
DELAYED_MAGNITUDES = (1.0, 4.0, 0.5)  # growth past the history saturates; a shrink keeps it


def _inputs(ctx: Context, magnitude: float = 1.0) -> list[Tensor]:
    return [
        (torch.randn(shape, device=ctx.device) * magnitude).to(torch.bfloat16) for shape in SHAPES
    ]


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


def _current(k, ctx: Context, check: _Bytes, dtype: torch.dtype) -> None:  # noqa: ANN001
    for x in _inputs(ctx):
        label = f"{dtype} {tuple(x.shape)}"
        scale = refmath.fp8_scale(x.float().abs().amax(), dtype)
        want = refmath.fp8_cast(x, scale, dtype)
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


def _delayed(k, ctx: Context, check: _Bytes, dtype: torch.dtype) -> None:  # noqa: ANN001
    """A history's scale: the first quantize by its own amax, then by the largest earlier one."""
    history = k.AmaxHistory(len(DELAYED_MAGNITUDES), most_recent=False)
    earlier: list[Tensor] = []
    for step, magnitude in enumerate(DELAYED_MAGNITUDES):
        x = _inputs(ctx, magnitude)[0]
        amax = x.float().abs().amax()
        scale = refmath.fp8_scale(max(earlier, key=float) if earlier else amax, dtype)
        got, got_t, inverse = k.quantize_transposed(x, dtype, 0, history)
        label = f"{dtype} delayed step {step + 1}"
        check.same(label, got, refmath.fp8_cast(x, scale, dtype))
        check.same(f"{label} transpose", got_t[:, : x.shape[0]], got.t())
        check.scale(label, inverse, scale)
        earlier.append(amax)


def _gemm(k, ctx: Context, tally: _Tally, a_dtype: torch.dtype, b_dtype: torch.dtype) -> None:  # noqa: ANN001
    """``a @ b^T`` on the FP8 GEMM against fp32 math on the same FP8 operands (the forward's
    E4M3 x E4M3; the input gradient's output gradient x weight under ``hybrid``)."""
    a = torch.randn(64, 128, device=ctx.device).to(torch.bfloat16)
    b = torch.randn(96, 128, device=ctx.device).to(torch.bfloat16)
    a8, a_inv = k.quantize(a, a_dtype)
    b8, b_inv = k.quantize(b, b_dtype)
    got = k.fp8_mm(a8, a_inv, b8.t(), b_inv, torch.bfloat16)
    want = (a8.float() * a_inv) @ (b8.float() * b_inv).t()
    tally.compare(f"{a_dtype} x {b_dtype} GEMM", got, want, torch.bfloat16)


@register("kernels.fp8")
def fp8(ctx: Context) -> str:
    """The run's FP8 formats, quantize bytes against torch's cast, the FP8 GEMM."""
    k = _kernel("fp8")
    reason = k.unsupported_gpu_reason() if ctx.on_gpu else None
    if reason:
        raise Skip(f"{reason}: --fp8-format is refused on this GPU")
    formats = k.formats("hybrid")
    failed_before = k.failed_kernels()
    check, tally = _Bytes(ctx.fault == "fp8"), _Tally()
    for dtype in (formats.forward, formats.backward):
        _current(k, ctx, check, dtype)
        _delayed(k, ctx, check, dtype)
        _gemm(k, ctx, tally, dtype, formats.forward)
    fell_back = k.failed_kernels() - failed_before
    if fell_back:
        raise CheckFailed(
            f"the FP8 Triton kernels failed for {sorted(map(str, fell_back))} and fell back "
            "to torch (the log above says why)"
        )
    sample = torch.empty(1, device=ctx.device, dtype=torch.bfloat16)
    return (
        f"{formats.forward} / {formats.backward}: {check.cases} tensors byte for byte "
        f"torch's cast, GEMM worst rel err {tally.worst:.2e} ({_path(ctx, sample, 'fp8')})"
    )
