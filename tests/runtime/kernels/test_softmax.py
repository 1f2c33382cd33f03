"""Parity of kernels.softmax: reference vs float64 math, Triton vs reference (fwd and bwd).

CPU CI: the reference tests always run; ``-m triton`` tests need ``TRITON_INTERPRET=1`` (they
run the real kernels in Triton's interpreter on small shapes). On a GPU box the same tests run
on the GPU, plus the ``gpu`` tests at full size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
from collections.abc import Callable, Iterator

import pytest

torch = pytest.importorskip("torch")

from triton_interpreter import TRITON_DEVICE, quick_few  # noqa: E402
from triton_interpreter import triton_test as shared_triton_test  # noqa: E402

from megatron_rocm.runtime.kernels import softmax, softmax_reference  # noqa: E402

pytestmark = pytest.mark.torch

TOL = {  # (atol, rtol) for one rounding of an fp32 result to the dtype, with margin
    torch.float16: (1e-3, 1e-2),
    torch.bfloat16: (8e-3, 2e-2),
    torch.float32: (1e-5, 1e-4),
}
DTYPES = list(TOL)
SCALE = 1 / math.sqrt(96)  # not representable in fp16/bf16: exercises the forward rounding


def triton_test(fn: Callable[..., None]) -> Callable[..., None]:
    """The shared marker, and silence for the interpreter's NaN warnings in padding rows that
    are never stored."""
    return shared_triton_test(pytest.mark.filterwarnings("ignore::RuntimeWarning")(fn))


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")


@pytest.fixture
def reference_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "reference")


@contextlib.contextmanager
def _tuning(looped: bool, sk: int) -> Iterator[None]:
    """With ``looped``, shrink the register-resident limit so ``sk`` takes the two-pass loop
    kernel in about four tiles (enough to exercise the online max/sum, few enough for the
    interpreter)."""
    from megatron_rocm.runtime.kernels import softmax_triton as tri

    old = tri.get_tuning()
    if looped:
        tile = max(16, tri.triton.next_power_of_2(sk) // 4)
        t = dataclasses.replace(
            old, max_block=tile, causal_bwd_max_block=tile, loop_block=tile, loop_programs_per_sm=1
        )
        tri.set_tuning(t)  # and a persistent grid: programs loop over rows
        assert sk <= 16 or tri.plan(1, sk, tri.CAUSAL, backward=True).looped
    try:
        yield
    finally:
        tri.set_tuning(old)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def _f64_softmax(z: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
    """Direct formula exp(z - max) / sum over the non-excluded entries, in float64."""
    z = z.masked_fill(excluded, -math.inf)
    e = torch.exp(z - z.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 4).to(dtype).to(device)
    dy = torch.randn(shape, generator=g).to(dtype).to(device)
    return x, dy


def _padding_mask(b: int, sq: int, sk: int, device: str = "cpu") -> torch.Tensor:
    """Random mask with row 0 of batch 0 fully masked and row 1 fully visible."""
    g = torch.Generator().manual_seed(1)
    mask = torch.rand((b, 1, sq, sk), generator=g) < 0.3
    mask[0, 0, 0] = True
    if sq > 1:
        mask[0, 0, 1] = False
    return mask.to(device)


# -- the reference against float64 math -----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk", [(1, 1), (7, 7), (5, 33)])
def test_reference_matches_float64(dtype: torch.dtype, sq: int, sk: int) -> None:
    x, dy = _inputs((2, 3, sq, sk), dtype)
    s64 = softmax_reference.forward_scale(SCALE, dtype)
    z = x.double() * s64
    rows = torch.arange(sq)[:, None]
    above = torch.arange(sk)[None, :] > rows  # independent of torch.triu
    none = torch.zeros_like(above)
    mask = _padding_mask(2, sq, sk)

    _close(softmax_reference.scaled_softmax(x, SCALE), _f64_softmax(z, none).to(dtype), dtype)
    y = softmax_reference.scaled_upper_triang_masked_softmax(x, SCALE)
    _close(y, _f64_softmax(z, above).to(dtype), dtype)
    expected = _f64_softmax(z.masked_fill(mask, -10000.0), none)
    expected = expected.masked_fill(mask.all(dim=-1, keepdim=True), 0.0)
    _close(softmax_reference.scaled_masked_softmax(x, mask, SCALE), expected.to(dtype), dtype)

    y64 = y.double()
    gy = dy.double() * y64
    dx64 = SCALE * (gy - y64 * gy.sum(dim=-1, keepdim=True))
    _close(softmax_reference.softmax_backward(dy, y, SCALE, causal=True), dx64.to(dtype), dtype)


def test_forward_scale_is_rounded_like_apex() -> None:
    assert softmax_reference.forward_scale(SCALE, torch.float32) == SCALE
    for dtype in (torch.float16, torch.bfloat16):
        rounded = softmax_reference.forward_scale(SCALE, dtype)
        assert rounded != SCALE and rounded == torch.tensor(SCALE, dtype=dtype).item()
    assert softmax_reference.scale_value(torch.tensor([2.5])[0]) == 2.5


def test_fully_masked_rows_are_zero_not_uniform() -> None:
    x, _ = _inputs((2, 2, 4, 9), torch.float32)
    y = softmax_reference.scaled_masked_softmax(x, _padding_mask(2, 4, 9), 1.0)
    assert torch.all(y[0, :, 0] == 0)
    torch.testing.assert_close(y[0, :, 1].sum(-1), torch.ones(2))


def test_causal_backward_never_reads_the_upper_triangle() -> None:
    _, dy = _inputs((3, 6, 6), torch.float32)
    y = softmax_reference.scaled_upper_triang_masked_softmax(torch.randn(3, 6, 6), 1.0)
    dy = dy.masked_fill(softmax_reference.causal_mask(6, 6), float("nan"))
    dx = softmax_reference.softmax_backward(dy, y, 0.5, causal=True)
    assert torch.isfinite(dx).all() and torch.all(dx.triu(1) == 0)


@pytest.mark.usefixtures("reference_only")
@pytest.mark.parametrize("kind", ["causal", "masked", "plain"])
def test_autograd_classes_on_reference_path(kind: str) -> None:
    x, dy = _inputs((2, 3, 5, 5), torch.bfloat16)
    x.requires_grad_(True)
    scale_t = torch.tensor([SCALE])
    mask = _padding_mask(1, 5, 5)
    if kind == "causal":
        y = softmax.ScaledUpperTriangMaskedSoftmax.apply(x.view(-1, 5, 5), scale_t[0]).view(x.shape)
        y_ref = softmax_reference.scaled_upper_triang_masked_softmax(x.detach(), SCALE)
    elif kind == "masked":
        y = softmax.ScaledMaskedSoftmax.apply(x, mask, scale_t[0])
        y_ref = softmax_reference.scaled_masked_softmax(x.detach(), mask, SCALE)
    else:
        y = softmax.scaled_softmax(x, SCALE)
        y_ref = softmax_reference.scaled_softmax(x.detach(), SCALE)
    y.backward(dy)
    # Apex: fp32 scale (not rounded) in backward.
    dx_ref = softmax_reference.softmax_backward(dy, y_ref, scale_t[0], causal=kind == "causal")
    assert torch.equal(y.detach(), y_ref) and torch.equal(x.grad, dx_ref)


def test_is_kernel_available_for_every_length() -> None:
    for sk in (1, 17, 4097, 16384, 32768, 65536):
        assert softmax.is_kernel_available(torch.bfloat16, sk, sk)
    assert not softmax.is_kernel_available(torch.float64, 8, 8)
    assert not softmax.is_kernel_available(torch.float16, 0, 8)
    assert softmax.get_batch_per_block(8, 8, 2, 4) == 1


def test_bad_mask_shape_raises() -> None:
    with pytest.raises(ValueError, match="mask must be"):
        softmax.masked_forward(
            torch.zeros(2, 3, 4, 4), torch.zeros(2, 3, 4, 4, dtype=torch.bool), 1
        )


# -- Triton against the reference ------------------------------------------------------------

CAUSAL_SHAPES = [(1, 1, 1), (2, 17, 17), (3, 5, 33), (1, 3, 4097)]  # (attn_batches, sq, sk)
MASKED_SHAPES = [(2, 3, 1, 1), (2, 2, 5, 17), (1, 3, 4, 200), (2, 1, 3, 4097)]  # b, np, sq, sk


def _on_triton(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(TRITON_DEVICE) for t in tensors]


@triton_test
@pytest.mark.parametrize("looped", [False, True], ids=["rows", "loop"])
@pytest.mark.parametrize("dtype", quick_few(DTYPES))
@pytest.mark.parametrize("shape", quick_few(CAUSAL_SHAPES, keep=2), ids=str)
def test_triton_causal(shape: tuple[int, int, int], dtype: torch.dtype, looped: bool) -> None:
    x, dy = _inputs(shape, dtype)
    above = softmax_reference.causal_mask(shape[1], shape[2])
    # NaN where the kernel must not look: a read would poison the row or its gradient.
    x_dev, dy_dev = _on_triton(x.masked_fill(above, math.nan), dy.masked_fill(above, math.nan))
    with _tuning(looped, shape[-1]):
        y = softmax.upper_triang_forward(x_dev, SCALE)
        dx = softmax.upper_triang_backward(dy_dev, y, SCALE)
    y_ref = softmax_reference.scaled_upper_triang_masked_softmax(x, SCALE)
    _close(y.cpu(), y_ref, dtype)
    _close(dx.cpu(), softmax_reference.softmax_backward(dy, y.cpu(), SCALE, True), dtype)
    assert torch.all(y.cpu()[:, above] == 0) and torch.all(dx.cpu()[:, above] == 0)


@triton_test
@pytest.mark.parametrize("looped", [False, True], ids=["rows", "loop"])
@pytest.mark.parametrize("dtype", quick_few(DTYPES))
@pytest.mark.parametrize("shape", quick_few(MASKED_SHAPES, keep=2), ids=str)
def test_triton_masked_and_plain(shape: tuple[int, ...], dtype: torch.dtype, looped: bool) -> None:
    b, _, sq, sk = shape
    x, dy = _on_triton(*_inputs(shape, dtype))
    mask = _padding_mask(b, sq, sk)
    with _tuning(looped, shape[-1]):
        y = softmax.masked_forward(x, mask.to(x.device), SCALE)
        y_plain = softmax.softmax_forward(x, SCALE)
        dx = softmax.masked_backward(dy, y, SCALE)
    _close(y.cpu(), softmax_reference.scaled_masked_softmax(x.cpu(), mask, SCALE), dtype)
    assert torch.all(y[0, :, 0] == 0)  # the fully masked row
    _close(y_plain.cpu(), softmax_reference.scaled_softmax(x.cpu(), SCALE), dtype)
    _close(dx.cpu(), softmax_reference.softmax_backward(dy.cpu(), y.cpu(), SCALE), dtype)


@triton_test
def test_triton_broadcast_mask_and_noncontiguous_input() -> None:
    base, dy = _inputs((3, 2, 6, 40), torch.float16)
    x = base.to(TRITON_DEVICE).transpose(0, 1)  # [2, 3, 6, 40], not contiguous
    assert not x.is_contiguous()
    for mask in (_padding_mask(1, 6, 40), _padding_mask(1, 1, 40).expand(1, 1, 6, 40)):
        y = softmax.scaled_masked_softmax(x, mask.to(x.device), SCALE)
        expected = softmax_reference.scaled_masked_softmax(x.cpu(), mask, SCALE)
        _close(y.cpu(), expected, torch.float16)
        assert y.is_contiguous()


@triton_test
def test_triton_autograd_with_tensor_scale() -> None:
    x, dy = _on_triton(*_inputs((4, 9, 9), torch.bfloat16))
    x.requires_grad_(True)
    scale_t = torch.tensor([SCALE])
    y = softmax.ScaledUpperTriangMaskedSoftmax.apply(x, scale_t[0])
    (dx,) = torch.autograd.grad(y, x, dy)
    y_ref = softmax_reference.scaled_upper_triang_masked_softmax(x.detach().cpu(), SCALE)
    _close(y.detach().cpu(), y_ref, torch.bfloat16)
    dx_ref = softmax_reference.softmax_backward(dy.cpu(), y.detach().cpu(), SCALE, causal=True)
    _close(dx.cpu(), dx_ref, torch.bfloat16)
    assert torch.all(dx.triu(1) == 0)


@pytest.mark.triton
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_plan_heuristics(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_rocm.runtime.kernels import softmax_triton as tri

    t = tri.Tuning()
    assert tri.plan(1000, 1, tuning=t).rows == t.min_tile // 16  # short rows are packed
    assert not tri.plan(10, t.max_block, tuning=t).looped
    assert tri.plan(10, t.max_block + 1, tuning=t).looped
    bwd = {"mode": tri.CAUSAL, "tuning": t, "backward": True}
    assert tri.plan(10, t.causal_bwd_max_block + 1, **bwd).looped
    assert tri.plan(10_000, 1 << 20, sms=100, tuning=t).grid == 100 * t.loop_programs_per_sm
    assert tri.plan(8, t.head_fastest_min_sk, tri.MASKED, tuning=t).head_fastest
    assert not tri.plan(8, t.head_fastest_min_sk // 2, tri.MASKED, tuning=t).head_fastest
    assert not tri.plan(8, t.head_fastest_min_sk, tri.CAUSAL, tuning=t).head_fastest
    long_fwd = tri.plan(8, 16384, tri.CAUSAL, tuning=t)
    assert long_fwd.num_warps < tri.plan(8, 16384, **bwd).num_warps
    monkeypatch.setattr(tri, "is_hip", lambda: True)
    assert tri.plan(10, t.max_block, tuning=t).num_warps <= 16  # 64-wide: 1024 threads max


# -- full size on a GPU ----------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("sk", [2048, 16384, 32768])
def test_gpu_full_size_causal(sk: int) -> None:
    """One full [sk, sk] matrix: 32k rows exercise the two-pass loop kernel."""
    x, dy = _inputs((1, sk, sk), torch.bfloat16, "cuda")
    y = softmax.upper_triang_forward(x, SCALE)
    _close(y, softmax_reference.scaled_upper_triang_masked_softmax(x, SCALE), torch.bfloat16)
    dx = softmax.upper_triang_backward(dy, y, SCALE)
    _close(dx, softmax_reference.softmax_backward(dy, y, SCALE, causal=True), torch.bfloat16)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("sk", [4096, 16384, 20000])
def test_gpu_full_size_masked(sk: int) -> None:
    x, dy = _inputs((2, 4, 8, sk), torch.float16, "cuda")
    mask = _padding_mask(2, 8, sk, "cuda")
    y = softmax.masked_forward(x, mask, SCALE)
    dx = softmax.masked_backward(dy, y, SCALE)
    _close(y, softmax_reference.scaled_masked_softmax(x, mask, SCALE), torch.float16)
    _close(dx, softmax_reference.softmax_backward(dy, y, SCALE), torch.float16)
