"""SwiGLU behind upstream's ``bias_swiglu_impl``: routing (CPU) and Triton parity.

The routing tests use a stand-in for upstream's functions that records its calls, so each
case proves which path ran. The ``triton`` cases count kernel launches, so they cannot pass on
the fallback; on CPU-only machines they run under the interpreter
(``test_triton_interpreter_runs.py``).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import TRITON_DEVICE, quick_few, triton_test

from megatron_rocm.runtime.kernels import swiglu

TRITON_SKIPS_ALLOWED = False  # under the interpreter every Triton case runs

DEVICE = TRITON_DEVICE or "cpu"


def reference(y: torch.Tensor) -> torch.Tensor:
    a, b = torch.chunk(y.float(), 2, -1)
    return F.silu(a) * b


class Upstream:
    """Upstream's three functions, in fp32 math, counting how often each ran."""

    def __init__(self) -> None:
        self.calls = {"impl": 0, "swiglu": 0, "swiglu_back": 0}

    def impl(self, input, bias, *options, **keywords):  # noqa: A002, ANN001, ANN002, ANN003, ANN201
        self.calls["impl"] += 1
        return reference(input if bias is None else input + bias).to(input.dtype)

    def swiglu(self, y: torch.Tensor) -> torch.Tensor:
        self.calls["swiglu"] += 1
        return reference(y).to(y.dtype)

    def swiglu_back(self, g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls["swiglu_back"] += 1
        with torch.enable_grad():  # runs inside autograd's backward, where grad mode is off
            y32 = y.float().requires_grad_()
            (grad,) = torch.autograd.grad(reference(y32), y32, g.float())
        return grad.to(y.dtype)

    def wrapped(self):  # noqa: ANN201
        return swiglu.native_swiglu(self.impl, self.swiglu, self.swiglu_back)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((torch.ones(10),), {}),  # a bias
        ((None, True), {}),  # fp8_input_store
        ((None, False, True), {}),  # cpu_offload_input
        ((None,), {"clamp_value": 7.0}),
        ((None,), {"clamp_value": 0.0}),  # falsy, still an option that changes the math
        ((None,), {"some_future_option": "on"}),
    ],
)
def test_anything_but_the_plain_case_runs_upstream(args: tuple, kwargs: dict) -> None:
    up = Upstream()
    y = torch.randn(3, 2, 10)
    out = up.wrapped()(y, *args, **kwargs)
    assert up.calls == {"impl": 1, "swiglu": 0, "swiglu_back": 0}
    assert out.shape == (3, 2, 5)


@pytest.mark.parametrize("shape", [(4, 10), (3, 2, 10)])
def test_plain_case_runs_native_swiglu_with_upstreams_math_off_the_gpu(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...]
) -> None:
    """On the CPU (no interpreter) the native function defers to upstream's two functions,
    one call each way, and keeps upstream's output shape (2-D stays 2-D)."""
    monkeypatch.setattr(swiglu, "use_triton", lambda *tensors, kernel=None: False)
    up = Upstream()
    y = torch.randn(shape, requires_grad=True)
    out = up.wrapped()(y, None, False, False, None)
    out.backward(torch.ones_like(out))
    assert up.calls == {"impl": 0, "swiglu": 1, "swiglu_back": 1}
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    y_ref = y.detach().requires_grad_()
    reference(y_ref).sum().backward()
    torch.testing.assert_close(y.grad, y_ref.grad)


def test_other_ranks_of_input_go_to_upstream_and_its_assertion() -> None:
    up = Upstream()
    up.wrapped()(torch.randn(2, 2, 2, 10), None)
    assert up.calls["impl"] == 1


def test_wrapper_keeps_upstreams_name_and_reference() -> None:
    up = Upstream()
    wrapped = up.wrapped()
    assert wrapped.__wrapped__ == up.impl and wrapped.__name__ == "impl"


def test_kernels_setting_forces_upstreams_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_rocm.runtime.kernels import launch as _runtime

    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "reference:swiglu")
    monkeypatch.setattr(_runtime, "triton_available", lambda: True)
    monkeypatch.setattr(_runtime, "interpreting", lambda: True)
    up = Upstream()
    up.wrapped()(torch.randn(4, 10), None)
    assert up.calls["swiglu"] == 1


@pytest.mark.parametrize(
    ("y", "g", "reason"),
    [
        (torch.randn(4, 10, dtype=torch.float64), None, "dtype torch.float64"),
        (torch.randn(4, 9), None, "not even"),
        (torch.randn(10, 4).t(), None, "not contiguous"),
        (torch.randn(4, 10), torch.randn(4, 5, dtype=torch.float64), "gradient dtype"),
        (torch.randn(4, 10), torch.randn(5, 4).t(), "gradient is not a contiguous"),
    ],
)
def test_unsupported_tensors_are_named(
    y: torch.Tensor, g: torch.Tensor | None, reason: str
) -> None:
    pytest.importorskip("triton")
    assert reason in swiglu._unsupported(y, g)


def test_unsupported_tensor_falls_back_with_the_reason_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("triton")
    monkeypatch.setattr(swiglu, "use_triton", lambda *tensors, kernel=None: True)
    monkeypatch.setattr("megatron_rocm.runtime.kernels.launch._logged", set())
    up = Upstream()
    with caplog.at_level(logging.INFO, logger="megatron_rocm.runtime.kernels"):
        up.wrapped()(torch.randn(4, 10, dtype=torch.float64), None)
    assert up.calls["swiglu"] == 1
    assert "float64" in caplog.text


# ---------------------------------------------------------------------------- Triton parity

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the Triton launches, so a case cannot pass on the fallback."""
    from megatron_rocm.runtime.kernels import swiglu_triton as _swiglu_triton

    calls = {"forward": 0, "backward": 0}
    for name, key in (("swiglu_forward", "forward"), ("swiglu_backward", "backward")):
        original = getattr(_swiglu_triton, name)

        def counted(*args, _original=original, _key=key):  # noqa: ANN002, ANN202
            calls[_key] += 1
            return _original(*args)

        monkeypatch.setattr(_swiglu_triton, name, counted)
    return calls


@triton_test
@pytest.mark.parametrize("dtype", quick_few(list(TOLERANCES)))
@pytest.mark.parametrize("shape", [(1, 2), (5, 14), (3, 2, 600), (7, 2050), (2, 3, 5000)])
def test_triton_parity(launches: dict[str, int], dtype: torch.dtype, shape: tuple) -> None:
    """Forward and backward against fp32 autograd, odd widths, 2-D and 3-D, widths below,
    between and above the block sizes (F = 1, 7, 300, 1025, 2500)."""
    torch.manual_seed(0)
    up = Upstream()
    y = (torch.randn(shape, device=DEVICE) * 3).to(dtype).requires_grad_()
    out = up.wrapped()(y, None)
    g = torch.randn(out.shape, device=DEVICE).to(dtype)
    out.backward(g)
    assert launches == {"forward": 1, "backward": 1}
    assert up.calls == {"impl": 0, "swiglu": 0, "swiglu_back": 0}
    y32 = y.detach().float().requires_grad_()
    ref = reference(y32)
    ref.backward(g.float())
    tol = TOLERANCES[dtype]
    assert out.dtype == dtype and y.grad.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(y.grad.float(), y32.grad, atol=tol * 2, rtol=tol * 2)


@triton_test
def test_triton_matches_upstreams_rounding_to_one_ulp() -> None:
    """bf16: both round an fp32 result once; they may differ by one ulp (sigmoid's last bits),
    never more."""
    torch.manual_seed(1)
    y = (torch.randn(64, 512, device=DEVICE) * 4).to(torch.bfloat16)
    g = torch.randn(64, 256, device=DEVICE).to(torch.bfloat16)
    up = Upstream()
    for ours, theirs in (
        (swiglu.forward(y, up.swiglu), reference(y).to(torch.bfloat16)),
        (swiglu.backward(g, y, up.swiglu_back), up.swiglu_back(g, y)),
    ):
        ulp = torch.finfo(torch.bfloat16).eps * theirs.float().abs().clamp_min(1e-30)
        assert ((ours.float() - theirs.float()).abs() <= ulp * 1.01 + 1e-38).all()
    assert up.calls["swiglu"] == 0 and up.calls["swiglu_back"] == 1  # the reference only


@triton_test
def test_triton_int64_offsets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The int64-offset variant (outputs of 2**30 elements and more) computes the same."""
    from megatron_rocm.runtime.kernels import swiglu_triton as _swiglu_triton

    assert _swiglu_triton.needs_int64(2**30) and not _swiglu_triton.needs_int64(2**29)
    monkeypatch.setattr(_swiglu_triton, "needs_int64", lambda n: True)
    torch.manual_seed(3)
    y = torch.randn(5, 2, 600, device=DEVICE)
    g = torch.randn(5, 2, 300, device=DEVICE)
    up = Upstream()
    torch.testing.assert_close(swiglu.forward(y, up.swiglu), reference(y))
    torch.testing.assert_close(swiglu.backward(g, y, up.swiglu_back), up.swiglu_back(g, y))


@triton_test
def test_triton_kernels_refuse_strided_tensors() -> None:
    """The entry points route these to upstream; the kernels themselves refuse them too."""
    from megatron_rocm.runtime.kernels import swiglu_triton as _swiglu_triton

    y = torch.randn(6, 40, device=DEVICE)[:, :20]
    with pytest.raises(ValueError, match="contiguous"):
        _swiglu_triton.swiglu_forward(y)
    with pytest.raises(ValueError, match="contiguous"):
        _swiglu_triton.swiglu_backward(torch.randn(10, 6, device=DEVICE).t(), y.contiguous())


@triton_test
def test_triton_empty_input() -> None:
    up = Upstream()
    y = torch.empty(0, 2, 8, device=DEVICE, requires_grad=True)
    out = up.wrapped()(y, None)
    out.sum().backward()
    assert out.shape == (0, 2, 4) and y.grad.shape == y.shape
