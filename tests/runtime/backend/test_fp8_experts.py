"""The FP8 MoE experts in one autograd function (``backend.fp8_experts``) against each expert
through the dense FP8 linear (``backend.fp8.fp8_linear``, current scaling) on its rows alone.

Both quantize each expert's tokens, weight and output gradient by their own amax with the same
bytes (``test_fp8_segments.py``), so on the CPU (the GEMMs emulated in fp32, row by row) the
output and the input gradient are the dense linear's bit for bit and the weight gradients
agree to fp32 rounding (the grouped one sums over more zero rows). On a GPU cuBLASLt may pick
another algorithm for a bucket's shape: there they agree to bf16 rounding. The experts'
buckets make each GEMM run past its expert's rows: a wrong order or offset would hand one
expert's rows another's output.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rocm.runtime.backend import fp8 as backend_fp8
from megatron_rocm.runtime.backend import fp8_experts
from megatron_rocm.runtime.backend.fp8_experts import ExpertsCall, ExpertWeightCache
from megatron_rocm.runtime.kernels import fp8
from megatron_rocm.runtime.kernels.fp8_segments import Segments

GPU = torch.cuda.is_available() and fp8.unsupported_gpu_reason() is None
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
HIDDEN, OUT = 64, 48
COUNTS = (5, 0, 130, 64, 1)  # an empty expert, one past a bucket, a bucket's worth, one row


def _device(name: str) -> torch.device:
    if name == "cuda" and not GPU:
        pytest.skip("needs a GPU with FP8 GEMMs")
    return torch.device(name)


def _recipe(**fields) -> backend_fp8.Fp8Recipe:  # noqa: ANN003
    return backend_fp8.Fp8Recipe(formats=fp8.formats("hybrid"), **fields)


def _weights(device: torch.device, experts: int = len(COUNTS)) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(7)
    scales = [2.0 ** (-10 * (e % 2)) for e in range(experts)]  # each expert a scale of its own
    return [
        torch.nn.Parameter((torch.randn(OUT, HIDDEN, generator=gen) * s).bfloat16().to(device))
        for s in scales
    ]


def _inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    rows = sum(COUNTS)
    scale = torch.cat([torch.full((c, 1), 2.0 ** (-12 * (e % 2))) for e, c in enumerate(COUNTS)])
    x = (torch.randn(rows, HIDDEN, generator=gen) * scale).bfloat16().to(device)
    dy = (torch.randn(rows, OUT, generator=gen) * scale).bfloat16().to(device)
    return x, dy


def _call(fuse: bool = False, reuse: bool | None = None, **recipe) -> ExpertsCall:  # noqa: ANN003
    return ExpertsCall(
        Segments(COUNTS, fp8_experts.EXPERT_ROW_BUCKET),
        _recipe(**recipe),
        fuse,
        ExpertWeightCache(),
        reuse,
    )


def _dense(x: torch.Tensor, dy: torch.Tensor, weights, wgrad_in_fp8: bool = True):  # noqa: ANN001, ANN202
    """Each expert through the dense FP8 linear on its rows alone: out, dx, weight grads."""
    outs, dxs, grads = [], [], []
    for rows, dy_rows, weight in zip(x.split(COUNTS), dy.split(COUNTS), weights, strict=True):
        w = weight.detach().clone().requires_grad_()
        xr = rows.detach().clone().requires_grad_()
        if rows.shape[0] == 0:
            outs.append(rows.new_zeros(0, OUT))
            dxs.append(rows.new_zeros(0, HIDDEN))
            grads.append(torch.zeros_like(w))
            continue
        out = backend_fp8.fp8_linear(xr, w, False, _recipe(wgrad_in_fp8=wgrad_in_fp8))
        out.backward(dy_rows)
        outs.append(out.detach())
        dxs.append(xr.grad)
        grads.append(w.grad)
    return torch.cat(outs), torch.cat(dxs), grads


def _close(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    if exact:
        assert torch.equal(got, want)
        return
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    fp32 = got.dtype == want.dtype == torch.float32
    assert err < (1e-5 if fp32 else 1e-2), err  # else one side was rounded to bf16


@pytest.mark.parametrize("device_name", DEVICES)
@pytest.mark.parametrize("wgrad_in_fp8", [True, False], ids=["fp8-wgrad", "no-fp8-wgrad"])
def test_the_experts_compute_what_each_dense_fp8_linear_computes(
    device_name: str, wgrad_in_fp8: bool
) -> None:
    device = _device(device_name)
    weights = _weights(device)
    x, dy = _inputs(device)
    want_out, want_dx, want_grads = _dense(x, dy, weights, wgrad_in_fp8)
    xg = x.clone().requires_grad_()
    out = fp8_experts.fp8_experts(xg, tuple(weights), _call(wgrad_in_fp8=wgrad_in_fp8))
    assert out.shape == (sum(COUNTS), OUT)
    out.backward(dy)
    cpu = device.type == "cpu"
    _close(out, want_out, exact=cpu)
    _close(xg.grad, want_dx, exact=cpu)
    for e, (weight, want) in enumerate(zip(weights, want_grads, strict=True)):
        if COUNTS[e] == 0:
            assert torch.equal(weight.grad, torch.zeros_like(weight)), e
        else:
            _close(weight.grad, want, exact=False)


@pytest.mark.parametrize("device_name", DEVICES)
def test_fused_weight_gradients_go_into_main_grad(device_name: str) -> None:
    """Two micro-batches accumulate; an expert without tokens keeps what it held."""
    device = _device(device_name)
    weights = _weights(device)
    for e, w in enumerate(weights):
        w.main_grad = torch.full(w.shape, 0.5 if COUNTS[e] == 0 else 0.0, device=device)
        w.grad_added_to_main_grad = False
    x, dy = _inputs(device)
    _, _, want = _dense(x, dy, weights)
    for _ in range(2):
        out = fp8_experts.fp8_experts(x.clone().requires_grad_(), tuple(weights), _call(True))
        out.backward(dy)
    for e, w in enumerate(weights):
        assert w.grad_added_to_main_grad and w.grad is not None  # Megatron's placeholder
        if COUNTS[e] == 0:
            assert (w.main_grad == 0.5).all()
        else:
            _close(w.main_grad / 2, want[e], exact=False)


@pytest.mark.parametrize("device_name", DEVICES)
def test_a_steps_later_micro_batches_reuse_the_quantized_weights(
    device_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = _device(device_name)
    weights = _weights(device)
    x, _ = _inputs(device)
    quantized: list[int] = []
    real = fp8_experts.quantize_weights

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        quantized.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8_experts, "quantize_weights", spy)
    cache = ExpertWeightCache()
    segs = Segments(COUNTS, fp8_experts.EXPERT_ROW_BUCKET)

    def forward(reuse: bool | None) -> torch.Tensor:
        call = ExpertsCall(segs, _recipe(), False, cache, reuse)
        return fp8_experts.fp8_experts(x.clone().requires_grad_(), tuple(weights), call)

    first = forward(False)
    again = forward(True)
    assert len(quantized) == 1 and torch.equal(first, again)
    with torch.no_grad():
        weights[0].mul_(2)  # the optimizer step: a new step quantizes again (reuse False)
    forward(False)
    assert len(quantized) == 2
    weights[1].data = weights[1].data.clone()  # the storage moved: the cache refreshes
    forward(True)
    assert len(quantized) == 3
    forward(None)  # the cache turned off: quantized, not kept
    forward(True)
    assert len(quantized) == 4


def test_evaluation_keeps_no_transposes(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[bool] = []
    real = fp8_experts.quantize_segments

    def spy(x, segs, dtype, margin=0, transpose=True):  # noqa: ANN001, ANN202
        asked.append(transpose)
        return real(x, segs, dtype, margin, transpose)

    monkeypatch.setattr(fp8_experts, "quantize_segments", spy)
    weights = _weights(torch.device("cpu"))
    x, _ = _inputs(torch.device("cpu"))
    with torch.no_grad():
        fp8_experts.fp8_experts(x, tuple(weights), _call())
    assert asked == [False, False]  # the tokens, then the weights: no transposes


def test_a_rank_whose_experts_got_no_tokens_runs_forward_and_backward() -> None:
    """Expert parallelism can leave a rank without any routed token."""
    weights = _weights(torch.device("cpu"), experts=2)
    x = torch.zeros(0, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    call = ExpertsCall(Segments((0, 0), 128), _recipe(), False, ExpertWeightCache(), None)
    out = fp8_experts.fp8_experts(x, tuple(weights), call)
    assert out.shape == (0, OUT)
    out.sum().backward()
    assert x.grad.shape == (0, HIDDEN)
    assert all(torch.equal(w.grad, torch.zeros_like(w)) for w in weights)


def test_the_output_may_be_changed_in_place_and_holds_only_its_rows() -> None:
    """As the per-expert path's ``torch.cat``: no autograd view of the padded buffer."""
    weights = _weights(torch.device("cpu"))
    x, dy = _inputs(torch.device("cpu"))
    xg = x.clone().requires_grad_()
    out = fp8_experts.fp8_experts(xg, tuple(weights), _call())
    assert out._base is None and out.shape == (sum(COUNTS), OUT)
    out.mul_(2)  # autograd refuses this on a view created inside a custom function
    out.backward(dy)
    want = fp8_experts.fp8_experts(x.clone().requires_grad_(), tuple(weights), _call())
    assert torch.equal(out, 2 * want.detach())


def test_the_forward_keeps_only_what_its_backward_reads() -> None:
    """The transposes and scales, not the row-major FP8 copies (the weights' are in the step's
    cache when it is on; here it is off)."""
    weights = _weights(torch.device("cpu"))
    x, _ = _inputs(torch.device("cpu"))
    out = fp8_experts.fp8_experts(x.clone().requires_grad_(), tuple(weights), _call())
    saved = [t for t in out.grad_fn.saved_tensors if t is not None]
    fp8_bytes = sum(t.numel() for t in saved if t.element_size() == 1)
    segs = Segments(COUNTS, fp8_experts.EXPERT_ROW_BUCKET)
    assert fp8_bytes == segs.t_starts[-1] * HIDDEN + len(COUNTS) * OUT * HIDDEN


def test_a_frozen_expert_gets_no_gradient_and_the_others_still_fuse() -> None:
    weights = _weights(torch.device("cpu"))
    weights[2].requires_grad_(False)
    for w in weights:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    x, dy = _inputs(torch.device("cpu"))
    fp8_experts.fp8_experts(x.clone().requires_grad_(), tuple(weights), _call(True)).backward(dy)
    assert not weights[2].main_grad.any() and weights[2].grad is None
    assert weights[0].main_grad.any() and weights[3].main_grad.any()
