"""Parity of kernels.grouped_gemm: every implementation against the fp64 per-expert loop.

Forward, input gradient, per-expert weight gradients and the fused accumulation into
``main_grad``, in fp32/bf16/fp16, with uneven splits, experts without tokens and odd sizes.
``loop`` and ``torch`` (``torch._grouped_mm``, whose CPU build loops) run on the CPU; the
``triton`` cases need ``TRITON_INTERPRET=1`` on CPU (the driver test at the bottom runs them
in a child pytest) or a GPU. ``gpu`` tests run the real kernels at MoE-like sizes.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import pytest
from triton_interpreter import run_triton_tests_under_interpreter

torch = pytest.importorskip("torch")

from megatron_rocm.runtime.kernels import _runtime  # noqa: E402
from megatron_rocm.runtime.kernels import grouped_gemm as gg  # noqa: E402

pytestmark = pytest.mark.torch

TOL = {  # (atol relative to the largest expected value, rtol): one rounding to the dtype
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 5e-3),
    torch.bfloat16: (1e-2, 2e-2),
}
DTYPES = list(TOL)
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else ("cpu" if INTERPRETING else None)

triton_case = [
    pytest.mark.triton,
    pytest.mark.skipif(
        not HAS_TRITON or TRITON_DEVICE is None, reason="needs a GPU, or TRITON_INTERPRET=1"
    ),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]
IMPLS = [
    pytest.param("loop", id="loop"),
    pytest.param(
        "torch",
        id="torch",
        marks=pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="no torch._grouped_mm"),
    ),
    pytest.param("triton", id="triton", marks=triton_case),
]
# (rows per expert, in, out): uneven, empty experts, one expert, sizes off every tile edge.
CASES = [
    ([5, 0, 17, 3], 24, 40),
    ([0, 9, 0, 2, 0], 16, 8),
    ([33], 8, 24),
]
ODD_CASES = [([7, 0, 4], 19, 13), ([2, 11], 5, 21)]  # not 16-byte rows: loop and Triton only


def device_for(impl: str) -> str:
    return TRITON_DEVICE if impl == "triton" else "cpu"


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    scale = max(expected.detach().abs().max().item(), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.detach().float().cpu(), expected.detach().float().cpu(), atol=atol * scale, rtol=rtol
    )


def make_weights(
    n: int, out_f: int, in_f: int, dtype: torch.dtype, device: str, layout: str
) -> list[torch.Tensor]:
    """Expert weights ``[out, in]``: separate tensors, or views of one buffer in expert order
    ("buffer", how TEGroupedLinear allocates) or in reverse ("reversed", DDP's order)."""
    data = torch.randn(n, out_f, in_f, dtype=torch.float64) * in_f**-0.5
    data = data.to(dtype=dtype, device=device)
    if layout == "separate":
        return [data[i].clone().requires_grad_() for i in range(n)]
    buf = data.flip(0).contiguous() if layout == "reversed" else data
    rows = [buf[n - 1 - i] if layout == "reversed" else buf[i] for i in range(n)]
    return [torch.nn.Parameter(r) for r in rows]


def exact(t: torch.Tensor) -> torch.Tensor:
    """An fp64 leaf copy: the reference's gradients are then exact, never rounded."""
    return t.detach().double().requires_grad_()


def run(impl, splits, in_f, out_f, dtype, layout="separate", bias=False, fuse=None):  # noqa: ANN001, ANN201
    """Forward + backward of ``impl`` and of the fp64 reference on the same inputs."""
    device = device_for(impl)
    torch.manual_seed(0)
    x = torch.randn(sum(splits), in_f, dtype=dtype, device=device, requires_grad=True)
    weights = make_weights(len(splits), out_f, in_f, dtype, device, layout)
    biases = [torch.randn(out_f, dtype=dtype, device=device, requires_grad=True) for _ in splits]
    if fuse is not None:
        for w, g in zip(weights, fuse):
            w.main_grad = g
    y = gg.grouped_mm(
        x,
        weights,
        splits,
        bias=biases if bias else None,
        fuse_wgrad_accumulation=fuse is not None,
        implementation=impl,
    )
    grad = torch.randn_like(y)
    y.backward(grad)
    ref_x, ref_w, ref_b = exact(x), [exact(w) for w in weights], [exact(b) for b in biases]
    ref = gg.grouped_linear_reference(ref_x, ref_w, splits, ref_b if bias else None)
    ref.backward(grad.double())
    return (x, weights, biases, y), (ref_x, ref_w, ref_b, ref)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_and_backward_match_the_per_expert_loop(impl, dtype, case) -> None:
    (x, weights, _, y), (ref_x, ref_w, _, ref) = run(impl, *case, dtype)
    assert y.dtype == dtype and y.shape == ref.shape
    assert_close(y, ref, dtype)
    assert_close(x.grad, ref_x.grad, dtype)
    for w, r, rows in zip(weights, ref_w, case[0]):
        assert_close(w.grad, r.grad, dtype)
        if rows == 0:
            assert not w.grad.any()  # an expert without tokens gets exactly zero


@pytest.mark.parametrize("impl", [p for p in IMPLS if p.id != "torch"])
@pytest.mark.parametrize("case", ODD_CASES, ids=str)
def test_odd_feature_sizes(impl, case) -> None:
    (x, weights, _, y), (ref_x, ref_w, _, ref) = run(impl, *case, torch.float32)
    assert_close(y, ref, torch.float32)
    assert_close(x.grad, ref_x.grad, torch.float32)
    for w, r in zip(weights, ref_w):
        assert_close(w.grad, r.grad, torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["separate", "buffer", "reversed"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_wgrad_accumulates_into_main_grad(impl, layout, grad_dtype) -> None:
    """``main_grad += dW`` in place, whatever the main grads' layout (separate, one buffer,
    DDP's reversed buffer); Megatron's DDP then sees flagged placeholder gradients."""
    splits, in_f, out_f = [6, 0, 3], 16, 24
    dtype, device = torch.bfloat16, device_for(impl)
    start = torch.randn(3, out_f, in_f, dtype=torch.float64)
    mains = make_weights(3, out_f, in_f, grad_dtype, device, layout)
    mains = [m.detach() for m in mains]
    for m, s in zip(mains, start):
        m.copy_(s)
    before = [m.clone() for m in mains]
    (x, weights, _, _), (_, ref_w, _, _) = run(impl, splits, in_f, out_f, dtype, fuse=mains)
    for w in weights:
        assert w.grad is None  # no grad_added_to_main_grad attribute: nothing for autograd
    # torch._grouped_mm writes dW in the inputs' dtype before the add (what Megatron does
    # without the fusion); loop and Triton accumulate in fp32.
    tol = dtype if impl == "torch" else grad_dtype
    for m, b, r in zip(mains, before, ref_w):
        assert_close(m, b.double() + r.grad, tol)
    assert torch.equal(mains[1], before[1])  # no tokens: untouched


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_wgrad_hands_megatron_ddp_flagged_placeholders(impl) -> None:
    device = device_for(impl)
    splits = [4, 0, 5]
    x = torch.randn(9, 16, dtype=torch.bfloat16, device=device, requires_grad=True)
    weights = make_weights(3, 8, 16, torch.bfloat16, device, "buffer")
    for w in weights:
        w.main_grad = torch.zeros(8, 16, device=device)
        w.grad_added_to_main_grad = False
    gg.grouped_mm(
        x, weights, splits, fuse_wgrad_accumulation=True, implementation=impl
    ).sum().backward()
    assert all(w.grad_added_to_main_grad for w in weights)
    assert all(w.grad is not None and w.grad.shape == w.shape for w in weights)
    # one allocation for all experts, not one weight-sized buffer per expert
    assert len({w.grad.untyped_storage().data_ptr() for w in weights}) == 1
    assert weights[0].main_grad.abs().sum() > 0 and not weights[1].main_grad.any()


def test_fused_wgrad_without_main_grad_says_what_is_missing() -> None:
    x = torch.randn(3, 8, requires_grad=True)
    w = [torch.randn(8, 8, requires_grad=True)]
    y = gg.grouped_mm(x, w, [3], fuse_wgrad_accumulation=True, implementation="loop")
    with pytest.raises(RuntimeError, match="main_grad"):
        y.sum().backward()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_forward_and_backward(impl, dtype) -> None:
    splits = [3, 0, 5]
    (x, weights, biases, y), (ref_x, ref_w, ref_b, ref) = run(impl, splits, 16, 8, dtype, bias=True)
    assert_close(y, ref, dtype)
    assert_close(x.grad, ref_x.grad, dtype)
    for b, r in zip(biases, ref_b):
        assert_close(b.grad, r.grad, dtype)
    assert not biases[1].grad.any()


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_three_d_weights(impl) -> None:
    device = device_for(impl)
    splits = [2, 0, 6]
    x = torch.randn(8, 16, device=device, requires_grad=True)
    w = (torch.randn(3, 24, 16, device=device) / 4).requires_grad_()
    y = gg.grouped_mm(x, w, splits, implementation=impl)
    y.backward(torch.ones_like(y))
    rx, rw = exact(x), exact(w)
    ref = gg.grouped_linear_reference(rx, list(rw.unbind(0)), splits)
    ref.backward(torch.ones_like(ref))
    assert_close(y, ref, x.dtype)
    assert w.grad.shape == w.shape
    assert_close(w.grad, rw.grad, x.dtype)
    assert_close(x.grad, rx.grad, x.dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_tokens_at_all(impl) -> None:
    """An EP rank can receive no tokens: empty output, zero weight gradients."""
    device = device_for(impl)
    x = torch.randn(0, 16, device=device, requires_grad=True)
    weights = make_weights(2, 8, 16, torch.float32, device, "separate")
    y = gg.grouped_mm(x, weights, [0, 0], implementation=impl)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert all(w.grad is not None and not w.grad.any() for w in weights)


def test_leading_dims_are_flattened_and_restored() -> None:
    x = torch.randn(2, 3, 16, requires_grad=True)
    weights = make_weights(2, 8, 16, torch.float32, "cpu", "separate")
    y = gg.grouped_mm(x, weights, [4, 2], implementation="loop")
    assert y.shape == (2, 3, 8)
    assert_close(y, gg.grouped_linear_reference(x, weights, [4, 2]), torch.float32)
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize(
    ("impl", "layout", "expected"),
    [
        pytest.param("torch", "buffer", "strided view", marks=IMPLS[1].marks),
        pytest.param("torch", "reversed", "stacked", marks=IMPLS[1].marks),
        pytest.param("torch", "separate", "stacked", marks=IMPLS[1].marks),
        pytest.param("triton", "reversed", "in place", marks=triton_case),
        pytest.param("triton", "separate", "stacked", marks=triton_case),
        ("loop", "buffer", "per expert"),
    ],
)
def test_last_run_reports_implementation_and_weight_access(impl, layout, expected) -> None:
    device = device_for(impl)
    weights = make_weights(3, 8, 16, torch.float32, device, layout)
    gg.grouped_mm(torch.randn(5, 16, device=device), weights, [2, 0, 3], implementation=impl)
    assert gg.last_run() == gg.RunInfo(impl, expected)


# -- choosing an implementation ---------------------------------------------------------------


def test_unknown_request_is_a_usage_error(monkeypatch) -> None:
    monkeypatch.setenv(gg.ENV, "cutlass")
    with pytest.raises(ValueError, match="'cutlass' is not one of auto, torch, triton, loop"):
        gg.choose(torch.randn(2, 8), (8, 8))
    monkeypatch.delenv(gg.ENV)
    with pytest.raises(ValueError, match="'cutlass' is not one of auto, torch, triton, loop"):
        gg.choose(torch.randn(2, 8), (8, 8), requested="cutlass")


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="no torch._grouped_mm")
def test_explicit_torch_with_unaligned_rows_fails_loudly(monkeypatch) -> None:
    monkeypatch.setenv(gg.ENV, "torch")
    x = torch.randn(4, 19)
    with pytest.raises(RuntimeError, match="'torch' was requested but cannot run: .*16 bytes"):
        gg.grouped_mm(x, [torch.randn(13, 19)], [4])


@pytest.mark.skipif(INTERPRETING or torch.cuda.is_available(), reason="Triton can run here")
def test_explicit_triton_on_cpu_fails_loudly() -> None:
    with pytest.raises(RuntimeError, match="'triton' was requested but cannot run"):
        gg.choose(torch.randn(2, 8), (8, 8), "triton")


@pytest.mark.skipif(INTERPRETING or torch.cuda.is_available(), reason="needs a CPU-only run")
def test_automatic_choice_on_cpu_is_the_loop_and_says_why_once(monkeypatch, caplog) -> None:
    monkeypatch.delenv(gg.ENV, raising=False)
    monkeypatch.setattr(_runtime, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="megatron_rocm.runtime.kernels"):
        for _ in range(3):
            assert gg.choose(torch.randn(2, 8, dtype=torch.bfloat16), (8, 8)) == "loop"
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2  # one per skipped implementation, not one per call
    assert any("not torch" in m for m in messages) and any("not triton" in m for m in messages)


def test_reference_kernels_setting_selects_the_loop(monkeypatch) -> None:
    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "reference")
    monkeypatch.delenv(gg.ENV, raising=False)
    assert gg.choose(torch.randn(2, 8), (8, 8)) == "loop"


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="no torch._grouped_mm")
def test_rocm_builds_do_not_pick_torch_automatically(simulate_rocm) -> None:
    problem = gg._torch_problem(torch.randn(2, 8, dtype=torch.bfloat16), (8, 8), automatic=True)
    assert problem is not None and "ROCm" in problem
    assert gg._torch_problem(torch.randn(2, 8), (8, 8), automatic=False) is None


@pytest.mark.parametrize(
    ("splits", "match"),
    [
        ([3], "1 splits for 2 experts"),
        ([3, 1], "sum to 4, the input has 3 rows"),
        ([4, -1], "negative"),
    ],
)
def test_bad_splits_are_rejected(splits, match) -> None:
    weights = [torch.randn(8, 8), torch.randn(8, 8)]
    with pytest.raises(ValueError, match=match):
        gg.grouped_mm(torch.randn(3, 8), weights, splits, implementation="loop")


def test_splits_may_be_a_tensor() -> None:
    weights = make_weights(2, 8, 8, torch.float32, "cpu", "separate")
    x = torch.randn(5, 8)
    y = gg.grouped_mm(x, weights, torch.tensor([2, 3]), implementation="loop")
    assert_close(y, gg.grouped_linear_reference(x, weights, [2, 3]), torch.float32)


# -- GPU: the real kernels at MoE-like sizes ----------------------------------------------------


def _gpu_impls() -> list[str]:
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    found = []
    for impl in ("torch", "triton", "loop"):
        try:
            gg.choose(x, (64, 64), impl)
            found.append(impl)
        except RuntimeError:
            pass
    return found


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("layout", ["buffer", "reversed"])
def test_gpu_implementations_agree_at_moe_sizes(layout) -> None:
    splits = [301, 0, 517, 77, 1, 0, 260, 128]
    in_f, out_f, dtype = 512, 768, torch.bfloat16
    for impl in _gpu_impls():
        torch.manual_seed(0)
        x = torch.randn(sum(splits), in_f, device="cuda", dtype=dtype, requires_grad=True)
        weights = make_weights(len(splits), out_f, in_f, dtype, "cuda", layout)
        mains = [torch.zeros(out_f, in_f, device="cuda") for _ in splits]
        for w, m in zip(weights, mains):
            w.main_grad = m
        y = gg.grouped_mm(x, weights, splits, fuse_wgrad_accumulation=True, implementation=impl)
        grad = torch.randn_like(y)
        y.backward(grad)
        ref_x, ref_w = exact(x), [exact(w) for w in weights]
        ref = gg.grouped_linear_reference(ref_x, ref_w, splits)
        ref.backward(grad.double())
        assert_close(y, ref, dtype)
        assert_close(x.grad, ref_x.grad, dtype)
        for m, r in zip(mains, ref_w):
            assert_close(m, r.grad, dtype)
        assert not mains[1].any() and not mains[5].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_gpu_automatic_choice_is_grouped() -> None:
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    impl = gg.choose(x, (64, 64))
    assert impl in ("torch", "triton")
    major, _ = torch.cuda.get_device_capability()
    if not _runtime.is_hip() and major in (9, 10) and hasattr(torch, "_grouped_mm"):
        assert impl == "torch"


# -- the Triton cases under the interpreter, on CPU-only machines -----------------------------


@pytest.mark.triton
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.skipif(INTERPRETING or torch.cuda.is_available(), reason="Triton runs in-process")
def test_triton_cases_under_the_interpreter() -> None:
    run_triton_tests_under_interpreter(Path(__file__), "-k", "triton")
