"""The FP8 cast-transpose kernel and the linears' operands it writes.

The oracle is torch's own FP8 conversion (``Tensor.to``), not our code: the kernel must give
its bytes for every FP8 value, every midpoint between two of them (ties to even), their fp32
neighbours, NaN, signed zeros and values under the smallest subnormal, in all four formats.
The ``triton`` cases run the kernel (on a GPU, or under the interpreter in a child pytest on a
CPU box: ``test_triton_interpreter_runs.py``); the others run torch's path.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import TRITON_DEVICE, triton_test

from megatron_rocm.runtime.backend import fp8 as backend_fp8
from megatron_rocm.runtime.kernels import fp8

TRITON_SKIPS_ALLOWED = False  # under the interpreter every Triton case runs

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
DEVICE = TRITON_DEVICE or "cpu"


def _every_value_and_tie(dtype: torch.dtype) -> torch.Tensor:
    """Each finite FP8 value, each midpoint of two, their fp32 neighbours, and specials."""
    fp8_max = torch.finfo(dtype).max
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    codes = codes[torch.isfinite(codes)]
    mids = ((codes[:, None] + codes[None, :]) / 2).flatten()
    nan, inf = float("nan"), float("inf")
    specials = [nan, -nan, -0.0, 0.0, 1e-30, -1e-30, 1e-45, -1e-45, fp8_max, -fp8_max]
    base = torch.cat([codes, mids, torch.tensor(specials)])
    up, down = (torch.nextafter(base, torch.tensor(v)) for v in (inf, -inf))
    beyond = torch.tensor([inf, -inf, 2 * fp8_max, -1e30])  # saturate at the clamp
    return torch.cat([base, up, down, beyond])


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Records each cast-transpose launch (its input's shape): a case that ran torch's path
    instead cannot pass."""
    from megatron_rocm.runtime.kernels import fp8_triton

    calls: list[tuple[int, int]] = []
    real = fp8_triton.cast_transpose

    def spy(x, *args):  # noqa: ANN001, ANN202
        calls.append(tuple(x.shape))
        return real(x, *args)

    monkeypatch.setattr(fp8_triton, "cast_transpose", spy)
    return calls


@triton_test
@pytest.mark.parametrize("dtype", FORMATS, ids=lambda d: str(d).removeprefix("torch.float8_"))
def test_every_value_and_tie_is_torchs_byte(dtype: torch.dtype) -> None:
    from megatron_rocm.runtime.kernels import fp8_triton

    values = _every_value_and_tie(dtype)
    cols = 64
    rows = -(-values.numel() // cols)
    x = torch.zeros(rows * cols)
    x[: values.numel()] = values
    x = x.view(rows, cols)
    fp8_max = float(torch.finfo(dtype).max)
    want = x.clamp(-fp8_max, fp8_max).to(dtype).view(torch.uint8)  # clamp keeps NaN
    y, yt = fp8_triton.cast_transpose(
        x.to(DEVICE), torch.ones((), device=DEVICE), dtype, fp8_max, rows + 5
    )
    wrong = (y.cpu().view(torch.uint8) != want).nonzero()
    assert wrong.numel() == 0, [(x[i, j].item(), want[i, j].item()) for i, j in wrong[:5].tolist()]
    assert torch.equal(yt.cpu()[:, :rows].view(torch.uint8), want.t())
    assert not yt.cpu()[:, rows:].view(torch.uint8).any()  # the padding columns are zero


@triton_test
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("rows", "cols", "margin"), [(70, 48, 0), (33, 80, 1), (128, 16, 0)])
def test_quantize_transposed_is_quantize_and_its_padded_transpose(
    monkeypatch: pytest.MonkeyPatch, source: torch.dtype, rows: int, cols: int, margin: int
) -> None:
    calls = _spy(monkeypatch)
    torch.manual_seed(rows)
    x = (torch.randn(rows, cols) * 3).to(source)
    for dtype in FORMATS:
        want, want_inv = fp8.quantize(x, dtype, margin, compiled=False)
        got, got_t, inv = fp8.quantize_transposed(x.to(DEVICE), dtype, margin)
        padded = -(-rows // 16) * 16
        assert got_t.shape == (cols, padded) and got_t.is_contiguous()
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(got_t.cpu()[:, :rows].view(torch.uint8), want.t().view(torch.uint8))
        assert not got_t.cpu()[:, rows:].view(torch.uint8).any()
        assert torch.equal(inv.cpu(), want_inv)
    assert calls == [(rows, cols)] * len(FORMATS)


@triton_test
def test_int64_offsets_give_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's WIDE branch (offsets past int32), forced on a small tensor."""
    from megatron_rocm.runtime.kernels import fp8_triton

    x = torch.randn(40, 48) * 4
    narrow = fp8_triton.cast_transpose(
        x.to(DEVICE), torch.ones((), device=DEVICE), FORMATS[0], 448.0, 48
    )
    monkeypatch.setattr(fp8_triton, "needs_int64", lambda *a: True)
    wide = fp8_triton.cast_transpose(
        x.to(DEVICE), torch.ones((), device=DEVICE), FORMATS[0], 448.0, 48
    )
    for a, b in zip(narrow, wide, strict=True):
        assert torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


@triton_test
def test_a_transposed_view_is_read_as_its_values(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch)
    x = torch.randn(48, 32).t()  # [32, 48], not contiguous
    want, _ = fp8.quantize(x, torch.float8_e4m3fn, compiled=False)
    got, got_t, _ = fp8.quantize_transposed(x.to(DEVICE), torch.float8_e4m3fn)
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got_t.cpu().view(torch.uint8), want.t().contiguous().view(torch.uint8))
    assert calls == [(32, 48)]


@triton_test
@pytest.mark.parametrize("wgrad_in_fp8", [True, False])
def test_the_linear_on_the_kernel_is_the_linear_on_torch(
    monkeypatch: pytest.MonkeyPatch, wgrad_in_fp8: bool
) -> None:
    """Forward and both gradients of the FP8 linear, the kernel's operands against torch's
    (``MEGATRON_ROCM_KERNELS=reference:fp8``): the same bytes, so the same numbers."""
    recipe = backend_fp8.Fp8Recipe(formats=fp8.formats("hybrid"), wgrad_in_fp8=wgrad_in_fp8)
    torch.manual_seed(3)
    x = torch.randn(2, 21, 64, dtype=torch.bfloat16)  # 42 tokens: the padding path
    w = (torch.randn(48, 64) / 8).to(torch.bfloat16)
    dy = torch.randn(2, 21, 48, dtype=torch.bfloat16)

    def run() -> list[torch.Tensor]:
        xd, wd = (t.to(DEVICE, copy=True).requires_grad_() for t in (x, w))
        y = backend_fp8.fp8_linear(xd, wd, False, recipe)
        y.backward(dy.to(DEVICE))
        return [t.float().cpu() for t in (y, xd.grad, wd.grad)]

    calls = _spy(monkeypatch)
    ours = run()
    assert len(calls) == (3 if wgrad_in_fp8 else 1)  # x, W and dy; or W alone
    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "reference:fp8")
    torchs = run()
    assert len(calls) == (3 if wgrad_in_fp8 else 1)  # the reference path launched nothing
    for got, want in zip(ours, torchs, strict=True):
        assert torch.equal(got, want)


def test_torchs_path_pads_and_transposes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the kernel (``reference:fp8``): the same layouts from torch."""
    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "reference:fp8")
    x = torch.randn(20, 32, dtype=torch.bfloat16)
    got, got_t, inv = fp8.quantize_transposed(x, torch.float8_e5m2, 1)
    want, want_inv = fp8.quantize(x, torch.float8_e5m2, 1, compiled=False)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got_t.shape == (32, 32) and torch.equal(inv, want_inv)
    assert torch.equal(got_t[:, :20].view(torch.uint8), want.t().view(torch.uint8))
    assert not got_t[:, 20:].view(torch.uint8).any()


def test_a_kernel_that_fails_falls_back_to_torch_once(monkeypatch, caplog) -> None:
    """A kernel failure costs speed, logged once, never the training step."""
    pytest.importorskip("triton")
    from megatron_rocm.runtime.kernels import fp8_triton, launch

    monkeypatch.setattr(fp8, "_eager_keys", set())
    monkeypatch.setattr(launch, "_logged", set())
    monkeypatch.setattr(fp8, "use_triton", lambda *a, **k: True)
    attempts = []

    def broken(*args):  # noqa: ANN002, ANN202
        attempts.append(args[0].shape)
        raise RuntimeError("no HIP device code for this arch\nsecond line")

    monkeypatch.setattr(fp8_triton, "cast_transpose", broken)
    caplog.set_level("WARNING", logger="megatron_rocm.runtime.kernels")
    x = torch.randn(20, 32, dtype=torch.bfloat16)
    want, want_inv = fp8.quantize(x, torch.float8_e4m3fn, compiled=False)
    for _ in range(3):
        got, got_t, inv = fp8.quantize_transposed(x, torch.float8_e4m3fn)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(got_t[:, :20].view(torch.uint8), want.t().view(torch.uint8))
        assert torch.equal(inv, want_inv)
    assert len(attempts) == 1  # not retried every step
    (record,) = caplog.records
    assert (
        "cast-transpose kernel" in record.getMessage()
        and "no HIP device code" in record.getMessage()
    )
    assert "second line" not in record.getMessage()


def test_offsets_widen_to_int64_past_int32() -> None:
    pytest.importorskip("triton")
    from megatron_rocm.runtime.kernels import fp8_triton

    assert not fp8_triton.needs_int64(32768, 14336, 32768)
    assert fp8_triton.needs_int64(2**17, 16384, 2**17)
    assert fp8_triton.needs_int64(2**31 // 4096 - 32, 4096, 2**31 // 4096 - 32)  # masked lanes
