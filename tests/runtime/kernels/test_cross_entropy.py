"""The Triton vocab-parallel cross entropy against upstream's formula, and its routing.

The routing tests always run. ``triton`` tests run the kernels through the public wrapper on a
GPU, or on the CPU under the Triton interpreter (``test_triton_interpreter_runs.py`` runs
them in a child pytest); the tensor-parallel case runs two gloo ranks, each holding half the
vocabulary. ``gpu`` tests run at the benchmark model's size.
"""

from __future__ import annotations

import socket

import pytest

torch = pytest.importorskip("torch")

from triton_interpreter import TRITON_DEVICE, quick_few, triton_test  # noqa: E402

from megatron_rocm.runtime.kernels import cross_entropy as ce  # noqa: E402

TRITON_SKIPS_ALLOWED = False  # under the interpreter every Triton case runs

DEVICE = TRITON_DEVICE or "cpu"


def upstream_formula(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Upstream's ``_VocabParallelCrossEntropy`` at TP=1, op by op (fp32 copy, max-shifted
    exp, sum, log), written out here as the oracle."""
    x = logits.float()
    x = x - x.max(dim=-1, keepdim=True).values
    predicted = x.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return torch.log(x.exp().sum(dim=-1)) - predicted


class _Recorder:
    """Stands in for upstream's function: records how it was called."""

    def __init__(self, signature: str) -> None:
        self.calls: list[tuple] = []
        if signature == "smoothing":

            def upstream(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
                self.calls.append((label_smoothing, tp_group))
                return upstream_formula(vocab_parallel_logits, target)
        else:

            def upstream(vocab_parallel_logits, target, tp_group):
                self.calls.append((0.0, tp_group))
                return upstream_formula(vocab_parallel_logits, target)

        self.fn = upstream


def _batch(s: int, b: int, vocab: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(s, b, vocab, generator=g) * 3).to(dtype).to(device)
    target = torch.randint(0, vocab, (s, b), generator=g).to(device)
    return logits, target


# ---------------------------------------------------------------------------- routing (CPU)


def test_cpu_without_interpreter_keeps_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "reference")
    rec = _Recorder("smoothing")
    wrapped = ce.native_cross_entropy(rec.fn)
    logits, target = _batch(3, 2, 11, torch.float32, "cpu")
    torch.testing.assert_close(wrapped(logits, target), upstream_formula(logits, target))
    assert rec.calls == [(0.0, None)]
    assert wrapped.__wrapped__ is rec.fn and wrapped.__name__ == "upstream"


@pytest.mark.parametrize("how", ["positional", "keyword"])
def test_label_smoothing_goes_to_upstream(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    monkeypatch.setattr(
        ce, "use_triton", lambda *t, kernel=None: True
    )  # would take Triton otherwise
    rec = _Recorder("smoothing")
    wrapped = ce.native_cross_entropy(rec.fn)
    logits, target = _batch(3, 2, 11, torch.float32, "cpu")
    if how == "positional":
        wrapped(logits, target, 0.1, "group")
    else:
        wrapped(logits, target, label_smoothing=0.1, tp_group="group")
    assert rec.calls == [(0.1, "group")]


def test_group_comes_from_the_call_or_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list = []
    monkeypatch.setattr(ce, "use_triton", lambda *t, kernel=None: True)
    monkeypatch.setattr(ce, "triton_cross_entropy", lambda x, t, g: seen.append(g) or x.sum(-1))
    logits, target = _batch(2, 1, 5, torch.float32, "cpu")
    ce.native_cross_entropy(_Recorder("smoothing").fn, lambda: "default")(logits, target)
    ce.native_cross_entropy(_Recorder("smoothing").fn, lambda: "default")(
        logits, target, tp_group="given"
    )
    ce.native_cross_entropy(_Recorder("fused").fn)(logits, target, "positional")
    assert seen == ["default", "given", "positional"]


def test_unsupported_calls_go_to_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ce, "use_triton", lambda *t, kernel=None: True)
    rec = _Recorder("fused")
    wrapped = ce.native_cross_entropy(rec.fn)
    logits, target = _batch(3, 2, 11, torch.float64, "cpu")
    wrapped(logits, target, None)  # float64 logits
    assert rec.calls == [(0.0, None)]


def test_reference_is_upstreams_formula() -> None:
    logits, target = _batch(4, 3, 17, torch.float32, "cpu")
    torch.testing.assert_close(
        ce.cross_entropy_reference(logits, target), upstream_formula(logits, target)
    )


# ---------------------------------------------------------------------------- Triton


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@triton_test
@pytest.mark.parametrize("dtype", quick_few([torch.float32, torch.bfloat16, torch.float16]))
@pytest.mark.parametrize("vocab", [7, 100, 8192 + 37])  # one block, odd, two blocks
def test_triton_matches_upstream_forward_and_backward(dtype: torch.dtype, vocab: int) -> None:
    s, b = (3, 2) if vocab > 8192 else (5, 3)
    logits, target = _batch(s, b, vocab, dtype, DEVICE)
    target[0, 0], target[-1, -1] = 0, vocab - 1  # first and last column
    ours_in = logits.clone().requires_grad_()
    ref_in = logits.clone().requires_grad_()
    ours = ce.triton_cross_entropy(ours_in, target)
    ref = upstream_formula(ref_in, target)
    assert ours.dtype == torch.float32 and ours.shape == (s, b)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-5)
    grad = torch.randn(s, b, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ours.backward(grad)
    ref.backward(grad)
    assert ours_in.grad.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(ours_in.grad, ref_in.grad, atol=tol, rtol=tol)


@triton_test
def test_triton_is_stable_for_huge_logits_and_catches_a_wrong_target() -> None:
    logits = torch.tensor([[[1e4, -1e4, 0.0, 1e4 - 1]]], device=DEVICE)
    target = torch.tensor([[3]], device=DEVICE)
    loss = ce.triton_cross_entropy(logits, target)
    torch.testing.assert_close(loss, upstream_formula(logits, target))
    assert torch.isfinite(loss).all()
    wrong = ce.triton_cross_entropy(logits, torch.tensor([[0]], device=DEVICE))
    assert not torch.allclose(wrong, loss)  # the oracle would notice a mixed-up target


@triton_test
def test_triton_wrapper_routes_to_the_kernel() -> None:
    rec = _Recorder("smoothing")
    logits, target = _batch(4, 2, 33, torch.float32, DEVICE)
    loss = ce.native_cross_entropy(rec.fn)(logits, target)
    assert rec.calls == []  # upstream never ran
    torch.testing.assert_close(loss, upstream_formula(logits, target))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tp_rank(rank: int, port: int, results: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    logits, target = _batch(3, 2, 40, torch.float32, "cpu", seed=3)
    shard = logits[..., rank * 20 : (rank + 1) * 20].clone().requires_grad_()
    loss = ce.triton_cross_entropy(shard, target, dist.group.WORLD)
    loss.backward(torch.ones_like(loss))
    results[rank] = (loss.detach(), shard.grad)
    dist.destroy_process_group()


@pytest.mark.full  # a gloo world of two ranks
@triton_test
def test_triton_tensor_parallel_two_ranks_match_the_whole_vocabulary() -> None:
    """Each rank holds half the vocabulary: same loss, and each rank's slice of the gradient."""
    if DEVICE != "cpu":
        pytest.skip("two gloo ranks on the CPU (the interpreter run)")
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_tp_rank, args=(_free_port(), results), nprocs=2)
        got = dict(results)
    logits, target = _batch(3, 2, 40, torch.float32, "cpu", seed=3)
    whole = logits.clone().requires_grad_()
    ref = upstream_formula(whole, target)
    ref.backward(torch.ones_like(ref))
    for rank in (0, 1):
        loss, grad = got[rank]
        torch.testing.assert_close(loss, ref.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad, whole.grad[..., rank * 20 : (rank + 1) * 20])


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_benchmark_shape(cuda_device: torch.device) -> None:
    """The 0.85B benchmark's loss shape (32k vocabulary) in bf16, against the fp32 oracle."""
    logits, target = _batch(512, 4, 32000, torch.bfloat16, "cuda")
    ours_in, ref_in = (logits.clone().requires_grad_() for _ in range(2))
    ours = ce.native_cross_entropy(_Recorder("smoothing").fn)(ours_in, target)
    ref = upstream_formula(ref_in, target)
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-5)
    ours.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad, atol=1e-2, rtol=2e-2)
