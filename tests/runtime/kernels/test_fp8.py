"""FP8 current scaling on the CPU: formats per GPU, quantization against a float64 reference,
the GEMM's argument plumbing, and the FP8 linear's forward/backward against full precision."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from megatron_rocm.runtime.backend import fp8 as backend_fp8  # noqa: E402
from megatron_rocm.runtime.kernels import fp8, launch  # noqa: E402

pytestmark = pytest.mark.torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E4M3_FNUZ, E5M2_FNUZ = torch.float8_e4m3fnuz, torch.float8_e5m2fnuz


# -- which FP8 ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hip", "arch", "forward", "backward"),
    [
        (None, None, E4M3, E5M2),  # CUDA
        ("6.4", "gfx942", E4M3_FNUZ, E5M2_FNUZ),  # MI300
        ("6.4", "gfx950", E4M3, E5M2),  # MI355: OCP
    ],
)
def test_hybrid_formats_follow_the_gpu(monkeypatch, hip, arch, forward, backward) -> None:
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(fp8, "gpu_arch", lambda: arch)
    got = fp8.formats("hybrid")
    assert (got.forward, got.backward) == (forward, backward)
    assert fp8.formats("e4m3").backward == forward  # e4m3: gradients in E4M3 too


def test_the_arch_is_read_only_on_rocm(monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(fp8, "gpu_arch", lambda: "gfx942")  # a CUDA build never asks
    assert fp8.formats("hybrid").forward == E4M3


def test_unknown_format_is_one_line() -> None:
    with pytest.raises(ValueError, match="expected e4m3 or hybrid"):
        fp8.formats("e5m2")


def test_fnuz_e4m3_tops_out_at_240_ocp_at_448() -> None:
    assert torch.finfo(E4M3_FNUZ).max == 240.0
    assert torch.finfo(E4M3).max == 448.0


# -- quantization against float64 ---------------------------------------------------------------


def _reference_scale(x: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> float:
    amax = x.double().abs().max().item()
    return torch.finfo(dtype).max / amax / 2.0**margin


@pytest.mark.parametrize(("dtype", "mantissa"), [(E4M3, 3), (E5M2, 2), (E4M3_FNUZ, 3)])
def test_quantize_matches_a_float64_reference(dtype, mantissa) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 48, dtype=torch.float64).clamp(-4, 4) * 3
    x[0, 16] = 16.0  # the amax
    info = torch.finfo(dtype)
    tiny = 16.0 * info.smallest_normal / info.max  # what lands on the smallest normal
    x[0, :16] = torch.linspace(0.05, 0.95, 16, dtype=torch.float64) * tiny  # subnormal there
    x_fp8, inv = fp8.quantize(x.to(torch.bfloat16), dtype)
    xb = x.to(torch.bfloat16).double()
    scale = _reference_scale(xb, dtype)
    assert x_fp8.dtype == dtype
    assert inv.dtype == torch.float32
    assert inv.item() == pytest.approx(1 / scale, rel=1e-6)
    # the amax lands on the format's largest value
    assert x_fp8.float().abs().max().item() == torch.finfo(dtype).max
    back = fp8.dequantize(x_fp8, inv).double()
    # normal range: round-to-nearest with `mantissa` bits, error <= 2^-(m+1) relative
    normal = xb.abs() * scale >= torch.finfo(dtype).smallest_normal
    rel = ((back - xb).abs() / xb.abs())[normal]
    assert rel.max().item() <= 2.0 ** -(mantissa + 1) + 1e-6
    # subnormals: absolute error at most half the smallest subnormal step, in x's units
    step = torch.finfo(dtype).smallest_normal / 2.0**mantissa / scale
    assert (~normal).sum() >= 16
    assert (back - xb).abs()[~normal].max().item() <= step / 2 + 1e-12


@pytest.mark.parametrize("dtype", [E4M3, E4M3_FNUZ, E5M2])
def test_quantize_saturates_instead_of_overflowing(dtype) -> None:
    x = torch.tensor([[1.0, -4.0, 0.5, 4.0]])
    x_fp8, inv = fp8.quantize(x, dtype, margin=-2)  # scale 4x too large: the top saturates
    top = torch.finfo(dtype).max
    values = x_fp8.float()
    assert torch.isfinite(values).all()
    assert values.abs().max().item() == top
    assert values[0, 1].item() == -top
    assert inv.item() == pytest.approx(4.0 / top / 4.0)


def test_margin_keeps_headroom() -> None:
    x = torch.randn(16, 16)
    x_fp8, _ = fp8.quantize(x, E4M3, margin=1)
    assert x_fp8.float().abs().max().item() == 224.0  # 448 / 2


def test_all_zeros_scale_is_one() -> None:
    x_fp8, inv = fp8.quantize(torch.zeros(16, 16), E4M3)
    assert inv.item() == 1.0 and not x_fp8.float().any()


@pytest.mark.parametrize("dtype", [E4M3, E5M2, E4M3_FNUZ])
def test_a_tiny_amax_caps_the_scale_instead_of_overflowing(dtype) -> None:
    """448 / 1e-37 overflows fp32: uncapped, zeros became NaN (0 * inf) and the inverse scale
    0. Capped at fp32's largest value, zeros stay zero and the values stay finite."""
    x = torch.tensor([0.0, 1e-37, -1e-37, 5e-38, 0.0, 0.0, 0.0, 0.0] * 2)
    x_fp8, inv = fp8.quantize(x, dtype, triton=False)
    cap = torch.tensor(torch.finfo(torch.float32).max)
    assert inv.item() == cap.reciprocal().item() > 0
    values = x_fp8.float()
    assert torch.isfinite(values).all() and (values[x == 0] == 0).all()
    assert (values[x != 0].sign() == x[x != 0].sign()).all()


def test_an_infinite_amax_scales_by_one_and_saturates() -> None:
    """TE's rule: a scale from a non-finite amax is not used (1 instead); inf saturates."""
    x = torch.tensor([1.0, float("inf"), -float("inf"), 1000.0])
    x_fp8, inv = fp8.quantize(x, E4M3, triton=False)
    assert inv.item() == 1.0
    assert x_fp8.float().tolist() == [1.0, 448.0, -448.0, 448.0]


# -- the GEMM --------------------------------------------------------------------------------


def test_scaled_mm_plumbing_matches_the_emulation() -> None:
    """The GPU path's layouts and inverse scales, on torch's CPU ``_scaled_mm`` (OCP dtypes):
    ``b`` given row-major as the weight gradient's is, ``a`` transposed as dgrad's is."""
    torch.manual_seed(1)
    a, a_inv = fp8.quantize(torch.randn(32, 64), E4M3)
    b, b_inv = fp8.quantize(torch.randn(64, 48), E5M2)  # row-major [K, N]
    want = fp8._emulated_mm(a, a_inv, b, b_inv, torch.float32)
    got = fp8.scaled_mm(a, a_inv, b, b_inv, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got_t = fp8.scaled_mm(a.t().contiguous().t(), a_inv, b, b_inv, torch.float32)
    torch.testing.assert_close(got_t, want, rtol=1e-5, atol=1e-5)
    ref = (a.double() * a_inv.double()) @ (b.double() * b_inv.double())
    torch.testing.assert_close(want.double(), ref, rtol=1e-5, atol=1e-5)


def test_pad_rows_rounds_the_token_dimension_up_to_16() -> None:
    x = torch.ones(20, 16).to(E4M3)
    padded = fp8.pad_rows(x)
    assert padded.shape == (32, 16) and padded.dtype == E4M3
    assert padded[20:].float().abs().sum() == 0 and fp8.pad_rows(padded) is padded


def test_gemm_dims_are_checked_in_one_line() -> None:
    fp8.check_gemm_dims("X", 4096, 14336)
    with pytest.raises(ValueError, match=r"divisible by 16.*in=4100") as info:
        fp8.check_gemm_dims("X", 4100, 64)
    assert "\n" not in str(info.value)


# -- the FP8 linear ------------------------------------------------------------------------


def _recipe(fmt: str = "hybrid", wgrad_in_fp8: bool = True) -> backend_fp8.Fp8Recipe:
    return backend_fp8.Fp8Recipe(formats=fp8.formats(fmt), wgrad_in_fp8=wgrad_in_fp8)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("wgrad_in_fp8", [True, False])
def test_fp8_linear_is_close_to_full_precision(fmt, wgrad_in_fp8) -> None:
    torch.manual_seed(2)
    x = torch.randn(2, 10, 64, dtype=torch.bfloat16, requires_grad=True)  # 20 tokens: padded
    w = (torch.randn(48, 64) / 8).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(2, 10, 48, dtype=torch.bfloat16)
    y = backend_fp8.fp8_linear(x, w, False, _recipe(fmt, wgrad_in_fp8))
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = x64 @ w64.t()
    y64.backward(dy.double())
    assert y.dtype == torch.bfloat16 and y.shape == (2, 10, 48)
    assert w.grad.dtype == torch.bfloat16 and x.grad.shape == x.shape
    # E4M3 operands: ~2^-4 relative each, averaged over K; E5M2 gradients ~2^-3
    assert _rel(y, y64) < 0.05
    assert _rel(x.grad, x64.grad) < (0.08 if fmt == "hybrid" else 0.05)
    assert _rel(w.grad, w64.grad) < (0.08 if fmt == "hybrid" else 0.05)
    assert _rel(y, y64) > 1e-3  # it did quantize (bf16 alone would be ~4e-3 / sqrt(K))


def test_fp8_linear_adds_the_weight_gradient_into_main_grad() -> None:
    """Megatron's DDP contract: with fusion the fp32 gradient goes into ``main_grad`` and
    autograd gets a placeholder flagged ``grad_added_to_main_grad``."""
    torch.manual_seed(3)
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    w.main_grad = torch.full((16, 32), 1.0)
    w.grad_added_to_main_grad = False
    dy = torch.randn(16, 16, dtype=torch.bfloat16)
    backend_fp8.fp8_linear(x, w, True, _recipe()).backward(dy)
    unfused = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        unfused.copy_(w)
    backend_fp8.fp8_linear(x.detach(), unfused, False, _recipe()).backward(dy)
    assert w.grad_added_to_main_grad is True
    assert w.grad is not None and w.grad.shape == w.shape  # the placeholder
    torch.testing.assert_close(w.main_grad - 1.0, unfused.grad.float(), rtol=1e-2, atol=1e-2)


def test_frozen_weight_gets_no_gradient() -> None:
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(16, 32)
    backend_fp8.fp8_linear(x, w, True, _recipe()).sum().backward()
    assert x.grad is not None and w.grad is None


def test_gpu_tensors_take_the_triton_quantize_unless_reference(monkeypatch) -> None:
    """The kernels themselves: ``test_fp8_cast_transpose.py`` (interpreter and GPU)."""
    calls = []

    def spy(x, dtype, margin, ld_t):  # noqa: ANN001, ANN202
        calls.append((tuple(x.shape), dtype, margin, ld_t))

    monkeypatch.setattr(fp8, "_quantize_triton", spy)  # returns None: eager finishes the job
    cuda_like, cuda_like_f64 = torch.ones(2, 3, 4), torch.ones(4, 4, dtype=torch.float64)
    gpu = property(lambda self: self is cuda_like or self is cuda_like_f64)
    monkeypatch.setattr(torch.Tensor, "is_cuda", gpu)
    monkeypatch.setattr(launch, "triton_available", lambda: True)
    got, _ = fp8.quantize(cuda_like, E4M3, 1)
    assert calls == [((6, 4), E4M3, 1, None)] and got.shape == (2, 3, 4)  # rows, no transpose
    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "reference:fp8")
    fp8.quantize(cuda_like, E4M3)
    monkeypatch.delenv("MEGATRON_ROCM_KERNELS")
    fp8.quantize(torch.ones(4, 4), E4M3)  # the CPU: eager
    fp8.quantize(cuda_like_f64, E4M3)  # a GPU tensor of a dtype the kernels do not read
    assert len(calls) == 1


@pytest.mark.parametrize("shape", [(0, 16), (4, 0), (0,)])
def test_an_empty_tensor_quantizes_with_scale_one(shape) -> None:
    x_fp8, inv = fp8.quantize(torch.empty(shape), E4M3)
    assert x_fp8.shape == shape and x_fp8.dtype == E4M3 and inv.item() == 1.0


@pytest.mark.parametrize("shape", [(0, 16), (4, 0)])
def test_an_empty_tensor_quantizes_transposed_with_scale_one(shape) -> None:
    x_fp8, x_t, inv = fp8.quantize_transposed(torch.empty(shape), E4M3)
    assert x_fp8.shape == shape and x_t.shape == (shape[1], 16 * -(-shape[0] // 16))
    assert inv.item() == 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_gpu_fp8_linear_matches_the_cpu_emulation(cuda_device: torch.device, fmt: str) -> None:
    """The GPU path (``fp8_triton``'s quantize, ``torch._scaled_mm`` with its layouts) against the
    CPU's (eager quantize, fp32 GEMM of the dequantized operands), forward and backward,
    on the dtypes this GPU uses; 20 tokens exercise the weight gradient's padding."""
    torch.manual_seed(4)
    recipe = _recipe(fmt)
    x = torch.randn(20, 64, dtype=torch.bfloat16)
    w = (torch.randn(48, 64) / 8).to(torch.bfloat16)
    dy = torch.randn(20, 48, dtype=torch.bfloat16)
    results = []
    for device in ("cuda", "cpu"):
        xd = x.to(device).requires_grad_()
        wd = w.to(device).requires_grad_()
        backend_fp8.fp8_linear(xd, wd, False, recipe).backward(dy.to(device))
        y = backend_fp8.fp8_linear(xd.detach(), wd.detach(), False, recipe)
        results.append([t.float().cpu() for t in (y, xd.grad, wd.grad)])
        if device == "cuda":
            q_gpu = fp8.quantize(x.cuda(), recipe.formats.forward)
    q_cpu = fp8.quantize(x, recipe.formats.forward)
    assert torch.equal(q_gpu[0].cpu().view(torch.uint8), q_cpu[0].view(torch.uint8))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
