"""The CP block kernels' log-sum-exp base probe: a kernel returning base 2 (AOTriton <= 0.10,
ROCm torch <= 2.8) is converted before blocks merge; any other scale is refused in one line.

Stand-in kernels on the CPU wrap the math kernel and rescale its lse, as AOTriton's does."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from megatron_rocm.runtime.backend.cp import block_attention as cpb  # noqa: E402


class _Rescaled(cpb.MathKernel):
    """The math kernel with its lse reported times ``factor`` (its backward takes it back)."""

    def __init__(self, name: str, factor: float) -> None:
        self.name, self.factor = name, factor

    def _fwd(self, q, k, v, causal, scale, p):  # noqa: ANN001, ANN202
        out, lse, state = super()._fwd(q, k, v, causal, scale, p)
        return out, lse * self.factor, state

    def _bwd(self, do, q, k, v, out, lse, state, causal, scale, p):  # noqa: ANN001, ANN202
        return super()._bwd(do, q, k, v, out, lse / self.factor, state, causal, scale, p)


@pytest.fixture(autouse=True)
def _fresh_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpb, "_lse_factors", {})


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, 3, 8, 16, generator=g, dtype=torch.float64) for _ in range(4))


@pytest.mark.parametrize("factor", [1.0, 1.0 / math.log(2.0)], ids=["base-e", "base-2"])
def test_blocks_give_natural_lse_and_exact_gradients(factor: float) -> None:
    q, k, v, do = _inputs()
    math_kernel, kernel = cpb.MathKernel(), _Rescaled(f"stand-in-{factor}", factor)
    kw = dict(causal=True, scale=0.25, dropout_p=0.0)
    out, lse, state = kernel.forward(q, k, v, **kw)
    ref_out, ref_lse, ref_state = math_kernel.forward(q, k, v, **kw)
    torch.testing.assert_close(lse, ref_lse)
    torch.testing.assert_close(out, ref_out)
    grads = kernel.backward(do, q, k, v, out, lse, state, **kw)
    ref = math_kernel.backward(do, q, k, v, ref_out, ref_lse, ref_state, **kw)
    for got, want in zip(grads, ref, strict=True):
        torch.testing.assert_close(got, want)


def test_another_scale_is_refused_in_one_line() -> None:
    q, k, v, _ = _inputs()
    with pytest.raises(RuntimeError) as info:
        _Rescaled("odd", 3.0).forward(q, k, v, causal=False, scale=0.25, dropout_p=0.0)
    message = str(info.value)
    assert "\n" not in message and "neither base e nor base 2" in message


def test_the_probe_runs_once_per_kernel_and_input_kind() -> None:
    q, k, v, _ = _inputs()
    kernel = _Rescaled("counted", 2.0)
    calls = []
    real = kernel._fwd
    kernel._fwd = lambda *a: calls.append(a[0].shape) or real(*a)  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        kernel.forward(q, k, v, causal=False, scale=0.25, dropout_p=0.0)
    cpb._lse_factors[("counted", "cpu", torch.float64, 16)] = 2.0  # as if probed before
    kernel.forward(q, k, v, causal=False, scale=0.25, dropout_p=0.0)
    probe = torch.Size([1, 1, 16, 16])
    assert calls == [q.shape, probe, q.shape]  # the second forward probes no more
