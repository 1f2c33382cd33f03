"""Delayed scaling's batched amax all-reduces (``kernels.fp8_amax_reduction``).

On one process the group is a stand-in and ``torch.distributed.all_reduce`` a recorder that
plays a second rank whose amaxes are twice these (a max over the two doubles each slot), so a
scale shows whether its amax was reduced before the history used it. On two gloo ranks the
batched run is checked against the same steps reduced after every quantize (the path outside a
forward region), bit for bit.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from triton_interpreter import TRITON_DEVICE, triton_test  # noqa: E402
from two_gloo_ranks import join  # noqa: E402
from two_gloo_ranks import two_ranks as _two_ranks  # noqa: E402

from megatron_rocm.runtime.backend import fp8 as backend_fp8  # noqa: E402
from megatron_rocm.runtime.kernels import fp8, fp8_amax_reduction  # noqa: E402

pytestmark = pytest.mark.torch
TRITON_SKIPS_ALLOWED = False
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


LAYOUT = 2  # the first flush's check of the ranks' slot counts: one all-reduce of 2 numbers
SLOTS = fp8_amax_reduction.SLOTS


class _Recorder:
    """``all_reduce`` against a second rank holding twice this rank's amaxes (and, for the
    first flush's check, as many amax slots: ``[n, -n]`` doubled still says n on both)."""

    def __init__(self) -> None:
        self.calls: list[int] = []  # each call's element count

    def __call__(self, tensor, op=None, group=None) -> None:  # noqa: ANN001 - torch's signature
        assert op == torch.distributed.ReduceOp.MAX
        self.calls.append(tensor.numel())
        tensor.mul_(2)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    record = _Recorder()
    monkeypatch.setattr(torch.distributed, "all_reduce", record)
    return record


_GROUP = [object()]  # a stand-in for a two-rank amax reduction group


@pytest.fixture(autouse=True)
def _fresh_group() -> None:
    """Each test's own group: its reduction's buffers and first-flush check start anew."""
    _GROUP[0] = object()


def _history() -> fp8.AmaxHistory:
    return fp8.AmaxHistory(4, most_recent=False, group=_GROUP[0])


def _quantize(history: fp8.AmaxHistory, amax: float) -> float:
    """One delayed quantize of a tensor whose amax is ``amax``; its inverse scale."""
    x = torch.full((4, 16), amax)
    return fp8.quantize(x, E4M3, history=history, triton=False)[1].item()


def test_outside_a_scope_each_quantize_reduces_its_own_amax(recorder) -> None:
    histories = [_history() for _ in range(3)]
    for h in histories:
        _quantize(h, 1.0)
    assert recorder.calls == [1, 1, 1]


def test_a_scope_reduces_its_amaxes_in_one_all_reduce_at_its_end(recorder) -> None:
    histories = [_history() for _ in range(5)]
    scope = fp8_amax_reduction.Scope()
    with fp8_amax_reduction.active(scope):
        for i, h in enumerate(histories):
            _quantize(h, 1.0 + i)
    assert recorder.calls == []
    assert [h.current.item() for h in histories] == [1.0, 2.0, 3.0, 4.0, 5.0]
    scope.flush()
    assert recorder.calls == [LAYOUT, SLOTS]
    assert [h.current.item() for h in histories] == [2.0, 4.0, 6.0, 8.0, 10.0]
    scope.flush()  # nothing left: no collective
    assert recorder.calls == [LAYOUT, SLOTS]


def test_a_history_advancing_with_its_amax_unreduced_reduces_it_first(recorder) -> None:
    """Its next scale comes from the group's amax (the second rank's 2.0), not its own 1.0."""
    history = _history()
    with fp8_amax_reduction.active(fp8_amax_reduction.Scope()):
        _quantize(history, 1.0)
        assert recorder.calls == []
        inverse = _quantize(history, 1.0)
    assert recorder.calls == [LAYOUT, SLOTS]
    assert inverse == pytest.approx(2.0 / E4M3_MAX)


def test_histories_past_one_buffer_take_another(recorder) -> None:
    histories = [_history() for _ in range(fp8_amax_reduction.SLOTS + 1)]
    scope = fp8_amax_reduction.Scope()
    with fp8_amax_reduction.active(scope):
        for h in histories:
            _quantize(h, 1.0)
    scope.flush()
    assert recorder.calls == [LAYOUT, SLOTS, SLOTS]
    assert histories[-1].current.item() == 2.0


def test_while_capturing_a_quantize_reduces_at_once(recorder, monkeypatch) -> None:
    """A graph's replay runs no Python, so no flush: the all-reduce goes into the graph."""
    history = _history()
    _quantize(history, 1.0)  # the first quantize is never captured
    monkeypatch.setattr(fp8, "capturing", lambda x: True)
    scope = fp8_amax_reduction.Scope()
    with fp8_amax_reduction.active(scope):
        _quantize(history, 1.0)
    assert recorder.calls == [1, 1]
    assert not scope.reductions


def test_ranks_holding_different_slot_counts_stop_at_the_first_flush(monkeypatch) -> None:
    """A max pairs slots by position: a rank with one more history would mix amaxes."""

    def another_rank_has_more(tensor, op=None, group=None) -> None:  # noqa: ANN001
        if tensor.numel() == LAYOUT:
            tensor[0] += 1  # the largest count is one more than this rank's

    monkeypatch.setattr(torch.distributed, "all_reduce", another_rank_has_more)
    scope = fp8_amax_reduction.Scope()
    with fp8_amax_reduction.active(scope):
        _quantize(_history(), 1.0)
    with pytest.raises(RuntimeError, match="hold 1 to 2 amax histories"):
        scope.flush()


def test_an_unreduced_amax_is_settled_outside_the_kernels_fallback(recorder, monkeypatch) -> None:
    """The fallback catches a failing launch and retries on torch: a collective inside it
    would be caught as a kernel failure and issued again on this rank only."""
    history = _history()
    with fp8_amax_reduction.active(fp8_amax_reduction.Scope()):
        _quantize(history, 1.0)
    settled_before_launch = []

    def launch(key, run):  # noqa: ANN001, ANN202
        settled_before_launch.append(history.reduction.settled(history.deferred_at))
        return None  # as a failed launch: torch's update runs

    monkeypatch.setattr(fp8, "_launch_or_none", launch)
    fp8.advance_history(history, torch.ones(4, 16), E4M3, 0, triton=True)
    assert settled_before_launch == [True]
    assert recorder.calls == [LAYOUT, SLOTS]


def _delayed_recipe() -> backend_fp8.Fp8Recipe:
    histories = backend_fp8.DelayedScaling(
        input=_history(), weight=fp8.AmaxHistory(4, most_recent=False), grad_output=_history()
    )
    return backend_fp8.Fp8Recipe(formats=fp8.formats("hybrid"), delayed=histories)


def _two_linears(recipes: list[backend_fp8.Fp8Recipe], seed: int = 0):  # noqa: ANN202
    """Two FP8 linears in a row: ``(output, input)``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 64, generator=gen).requires_grad_()
    h = x
    for recipe in recipes:
        w = (torch.randn(64, 64, generator=gen) / 8).requires_grad_()
        h = backend_fp8.fp8_linear(h, w, False, recipe)
    return h, x


def test_a_forward_region_reduces_its_forward_at_its_end_and_its_backward_at_the_first_linear(
    recorder,
) -> None:
    recipes = [_delayed_recipe(), _delayed_recipe()]
    with backend_fp8.forward_region():
        with backend_fp8.forward_region():  # nested: the outermost one counts
            y, _ = _two_linears(recipes)
        assert recorder.calls == []
    assert recorder.calls == [LAYOUT, SLOTS]
    forward_amaxes = [r.history("input").current.item() for r in recipes]
    seen: list[int] = []
    first = recipes[0].history("grad_output")
    original = backend_fp8.Fp8LinearFunction.backward

    def backward(ctx, grad):  # noqa: ANN001, ANN202
        out = original(ctx, grad)
        seen.append(len(recorder.calls))
        return out

    backend_fp8.Fp8LinearFunction.backward = staticmethod(backward)
    try:
        y.backward(torch.ones_like(y))
    finally:
        backend_fp8.Fp8LinearFunction.backward = staticmethod(original)
    assert seen == [2, 3]  # the second linear's backward defers; the first's flushes
    assert first.current.item() > 0 and forward_amaxes[0] > 0
    assert not any(r.unreduced for r in fp8_amax_reduction._reductions.values())


def test_an_exception_inside_a_region_reduces_nothing(recorder) -> None:
    """The other ranks may not have reached the region's end: no collective here."""
    recipes = [_delayed_recipe()]
    with pytest.raises(RuntimeError, match="stop"):
        with backend_fp8.forward_region():
            _two_linears(recipes)
            raise RuntimeError("stop")
    assert recorder.calls == []
    assert backend_fp8._open_regions == []


def _steps(recipes: list[backend_fp8.Fp8Recipe], rank: int, regions: bool) -> list[float]:
    """Three forward + backward steps; each step's inverse scales as the histories hold them."""
    import contextlib

    scales = []
    for step in range(3):
        region = backend_fp8.forward_region() if regions else contextlib.nullcontext()
        with region:
            y, x = _two_linears(recipes, seed=10 * step + rank)  # each rank its own data
        (y * (1.0 + rank + step)).sum().backward()
        for recipe in recipes:
            for name in ("input", "grad_output"):
                scales.append(recipe.history(name).scale.item())
                scales.append(recipe.history(name).current.item())
    return scales


def _rank_batched_vs_at_once(rank: int, port: int, results) -> None:  # noqa: ANN001
    import torch.distributed as dist

    join(rank, port)

    def run(regions: bool) -> tuple[list[float], int]:
        calls = []
        real = dist.all_reduce

        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls.append(1)
            return real(*args, **kwargs)

        dist.all_reduce = counted
        try:
            recipes = []
            for _ in range(2):
                histories = backend_fp8.DelayedScaling(
                    input=fp8.AmaxHistory(4, False, dist.group.WORLD),
                    weight=fp8.AmaxHistory(4, False),
                    grad_output=fp8.AmaxHistory(4, False, dist.group.WORLD),
                )
                recipes.append(
                    backend_fp8.Fp8Recipe(formats=fp8.formats("hybrid"), delayed=histories)
                )
            return _steps(recipes, rank, regions), len(calls)
        finally:
            dist.all_reduce = real

    batched, batched_calls = run(True)
    at_once, at_once_calls = run(False)
    results.put((rank, batched == at_once, batched_calls, at_once_calls, batched[:4]))
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_scale_bitwise_alike_with_one_all_reduce_per_region_end() -> None:
    """Three steps of two linears: 12 all-reduces one by one (an input and an output
    gradient a linear a step), 7 batched (each step's forward end and backward end, and the
    first flush's check of the slot counts), and the same scales and running amaxes on both
    ranks either way."""
    got = _two_ranks(_rank_batched_vs_at_once)
    assert [g[:4] for g in got] == [(0, True, 7, 12), (1, True, 7, 12)]
    assert got[0][4] == got[1][4]  # the group's amaxes, the same on both ranks


@pytest.mark.parametrize(("recipe", "region"), [("delayed", True), ("tensorwise", False)])
def test_upstreams_forward_context_is_a_region_under_delayed_scaling(recipe, region) -> None:
    """``get_fp8_context(config)`` without TE: current scaling has no amaxes to batch."""
    from types import SimpleNamespace

    config = SimpleNamespace(fp8="hybrid", fp8_recipe=recipe)
    with backend_fp8.layer_context(config, 0, is_init=False):
        assert bool(backend_fp8._open_regions) is region
    assert backend_fp8._open_regions == []


@triton_test
def test_the_kernels_run_on_a_slot_of_a_shared_buffer(monkeypatch) -> None:
    """The update and the cast-transpose read and raise ``current`` through a 0-d view at an
    offset in the buffer: bit for bit a history of its own, and the neighbouring slot left
    alone (one rank: the all-reduce changes nothing)."""
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None, group=None: None)
    from megatron_rocm.runtime.kernels import fp8_triton

    launches = []
    for name in ("cast_transpose", "delayed_update"):
        real = getattr(fp8_triton, name)
        monkeypatch.setattr(
            fp8_triton, name, lambda *a, _r=real, _n=name, **k: launches.append(_n) or _r(*a, **k)
        )
    device = TRITON_DEVICE or "cpu"
    gen = torch.Generator().manual_seed(2)
    xs = [
        (torch.randn(70, 200, generator=gen) * m).to(torch.bfloat16).to(device)
        for m in (1, 3, 0.5, 8)
    ]
    neighbour, slotted = _history(), _history()
    alone = fp8.AmaxHistory(4, most_recent=False)
    scope = fp8_amax_reduction.Scope()
    with fp8_amax_reduction.active(scope):
        fp8.quantize(torch.full((4, 16), 7.0, device=device), E4M3, history=neighbour)
    scope.flush()
    assert slotted.current is None or slotted.current.data_ptr() != neighbour.current.data_ptr()
    for x in xs:
        with fp8_amax_reduction.active(scope):
            got = fp8.quantize_transposed(x, E4M3, 0, slotted)
        want = fp8.quantize_transposed(x, E4M3, 0, alone)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(
                g.view(torch.uint8) if g.dtype == E4M3 else g,
                w.view(torch.uint8) if w.dtype == E4M3 else w,
            )
    scope.flush()
    assert slotted.current.data_ptr() == neighbour.current.data_ptr() + 4
    for name in ("history", "current", "pos", "scale"):
        assert torch.equal(getattr(slotted, name), getattr(alone, name)), name
    assert neighbour.current.item() == 7.0
    assert launches.count("cast_transpose") == 1 + 2 * len(xs)  # every quantize on the kernels
    assert launches.count("delayed_update") == 2 * (len(xs) - 1)  # both, after their first
