"""FP8 delayed scaling (``fp8.AmaxHistory``, upstream's ``--fp8-recipe delayed``).

The oracle is TE's rule written out here in float64 (``_reference_scales``): the scale of a
tensor's quantize number t comes from the nonzero amaxes of its earlier quantizes, the last
``length`` of them (their largest under ``max``, the newest under ``most_recent``); a zero amax
changes nothing, NaN elements are left out of an amax, an infinite amax keeps the scale, and
the first quantize (no history yet) scales by its own amax. The ``triton`` cases run the
kernels (on a GPU, or under the interpreter in a child pytest) against torch's path bit for
bit, with the launches counted so that a case torch's path answered cannot pass.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from triton_interpreter import TRITON_DEVICE, quick_few, triton_test  # noqa: E402
from two_gloo_ranks import join  # noqa: E402
from two_gloo_ranks import two_ranks as _two_ranks  # noqa: E402

from megatron_rocm.runtime.backend import fp8 as backend_fp8  # noqa: E402
from megatron_rocm.runtime.kernels import fp8  # noqa: E402

pytestmark = pytest.mark.torch
TRITON_SKIPS_ALLOWED = False
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = [E4M3, E5M2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
DEVICE = TRITON_DEVICE or "cpu"

# magnitudes of successive quantizes: growth past the history (saturation), an all-zero tensor
# (scale kept), a shrink, and enough calls to wrap a short history
MAGNITUDES = [1.0, 3.0, 0.5, 0.0, 8.0, 0.25, 2.0, 2.0, 40.0, 1.0]


def _tensors(seed: int = 0, shape: tuple[int, int] = (40, 48)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(shape, generator=gen) * m).to(torch.bfloat16).to(DEVICE) for m in MAGNITUDES
    ]


def _reference_scales(
    amaxes: list[float], length: int, most_recent: bool, fp8_max: float, margin: int
) -> list[float]:
    """TE's delayed scaling in float64, with a first quantize by its own amax."""
    first = amaxes[0]
    scales = [fp8_max / first / 2**margin if 0 < first < math.inf else 1.0]
    pushed: list[float] = []
    scale = 1.0  # TE's initial scale: kept until a usable amax arrives
    for previous in amaxes[:-1]:
        if previous != 0:  # a zero amax neither joins the history nor rolls it
            pushed.append(previous)
            window = pushed[-length:]
            ref = window[-1] if most_recent else max(window)
            if ref < math.inf:
                scale = fp8_max / ref / 2**margin
        scales.append(scale)
    return scales


def _amax(x: torch.Tensor) -> float:
    """The largest ``|x|`` without NaN, in float64."""
    finite_or_inf = x.double().abs()
    return finite_or_inf[~finite_or_inf.isnan()].max().item()


def _run(xs: list[torch.Tensor], dtype: torch.dtype, history: fp8.AmaxHistory, margin: int = 0,
         transpose: bool = False) -> list[tuple]:  # fmt: skip
    out = []
    for x in xs:
        if transpose:
            q, qt, inv = fp8.quantize_transposed(x, dtype, margin, history)
        else:
            (q, inv), qt = fp8.quantize(x, dtype, margin, history=history), None
        out.append((q, qt, inv))
    return out


@pytest.mark.parametrize("most_recent", [False, True], ids=["max", "most_recent"])
@pytest.mark.parametrize("length", [1, 3, 1024])
@pytest.mark.parametrize("margin", [0, 1])
def test_scales_follow_tes_rule(length: int, most_recent: bool, margin: int) -> None:
    xs = _tensors()
    fp8_max = torch.finfo(E4M3).max
    got = _run(xs, E4M3, fp8.AmaxHistory(length, most_recent), margin)
    amaxes = [_amax(x) for x in xs]
    want = _reference_scales(amaxes, length, most_recent, fp8_max, margin)
    for t, ((q, _, inv), scale, x) in enumerate(zip(got, want, xs, strict=True)):
        assert inv.item() == pytest.approx(1 / scale, rel=2**-21), t
        # the values: x at that scale, saturated at the format's largest value, rounded to E4M3
        expect = (x.double() * scale).clamp(-fp8_max, fp8_max) / scale
        err = (q.double() * inv.double() - expect).abs()
        assert (err <= expect.abs() * 2**-4 + 2**-9 / scale).all(), t


def test_a_tensor_that_outgrows_its_history_saturates() -> None:
    history = fp8.AmaxHistory(4, most_recent=False)
    fp8.quantize(torch.ones(16, 16), E4M3, history=history)
    q, inv = fp8.quantize(torch.full((16, 16), 10.0), E4M3, history=history)  # scale 448 / 1
    assert inv.item() == pytest.approx(1 / 448) and (q.float() == 448).all()


@pytest.mark.parametrize("most_recent", [False, True], ids=["max", "most_recent"])
def test_nan_elements_zeros_and_inf_follow_tes_rule(most_recent: bool) -> None:
    """A NaN element is left out of the amax (it must not freeze the scale for the history's
    length), an all-zero tensor leaves the history alone, an infinite amax keeps the scale."""
    xs = [torch.full((4, 16), v) for v in (2.0, 8.0, 0.0, 1.0, 1.0, float("inf"), 1.0, 1.0)]
    xs[1][0, 0] = float("nan")
    history = fp8.AmaxHistory(1024, most_recent)
    got = [inv.item() for _, inv in (fp8.quantize(x, E4M3, history=history) for x in xs)]
    want = _reference_scales([_amax(x) for x in xs], 1024, most_recent, 448.0, 0)
    assert got == pytest.approx([1 / s for s in want], rel=2**-21)
    # after the 8 (with its NaN): 8's scale, which the zero keeps; 8 stays the max of the history
    assert got[2] == pytest.approx(8 / 448) and got[3] == pytest.approx(8 / 448)
    assert got[4] == pytest.approx(1 / 448 if most_recent else 8 / 448)


def test_the_inverse_a_linear_saved_survives_later_quantizes() -> None:
    history = fp8.AmaxHistory(1, most_recent=True)
    fp8.quantize(torch.ones(4, 16), E4M3, history=history)
    _, inv = fp8.quantize(torch.ones(4, 16), E4M3, history=history)
    fp8.quantize(torch.full((4, 16), 7.0), E4M3, history=history)
    fp8.quantize(torch.full((4, 16), 7.0), E4M3, history=history)
    assert inv.item() == pytest.approx(1 / 448)


def test_a_history_shorter_than_one_is_refused() -> None:
    with pytest.raises(ValueError, match="--fp8-amax-history-len 0"):
        fp8.AmaxHistory(0, most_recent=False)


# -- the kernels against torch's path ----------------------------------------------------------


def _launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    from megatron_rocm.runtime.kernels import fp8_triton

    calls: list[str] = []
    for name in ("delayed_update", "cast_transpose"):
        real = getattr(fp8_triton, name)

        def spy(*args, real=real, name=name, **kwargs):  # noqa: ANN002, ANN003, ANN202
            done = real(*args, **kwargs)  # a launch that raised (torch's path answered) not counted
            recording = name == "delayed_update" or (len(args) > 5 and args[5] is not None)
            calls.append(name if recording else f"{name} (current scaling)")
            return done

        monkeypatch.setattr(fp8_triton, name, spy)
    return calls


@triton_test
@pytest.mark.parametrize(
    "dtype", quick_few(FORMATS), ids=lambda d: str(d).removeprefix("torch.float8_")
)
@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("most_recent", quick_few([False, True]), ids=["max", "most_recent"])
def test_kernels_are_torchs_path_bit_for_bit(monkeypatch, dtype, transpose, most_recent) -> None:
    xs = _tensors(
        seed=1, shape=(70, 200)
    )  # partial tiles both ways, 64 and 128 wide; 70 rows pad to 80
    xs[5][3, 7] = float("nan")
    calls = _launches(monkeypatch)
    kernel_history = fp8.AmaxHistory(3, most_recent)
    kernels = _run(xs, dtype, kernel_history, 1, transpose)
    assert calls.count("delayed_update") == len(xs) - 1  # every quantize after the first
    assert calls.count("cast_transpose") == len(xs) - 1
    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "reference:fp8")
    torch_history = fp8.AmaxHistory(3, most_recent)
    eager = _run(xs, dtype, torch_history, 1, transpose)
    for t, (k, e) in enumerate(zip(kernels, eager, strict=True)):
        assert torch.equal(k[0].view(torch.uint8), e[0].view(torch.uint8)), t
        if transpose:
            assert torch.equal(k[1].view(torch.uint8), e[1].view(torch.uint8)), t
        assert torch.equal(k[2], e[2]), t
    for name in ("history", "current", "pos", "scale"):
        got, want = getattr(kernel_history, name), getattr(torch_history, name)
        assert torch.equal(got.isnan(), want.isnan()), name
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), name


# -- in the linear, and across ranks -----------------------------------------------------------


def _delayed_recipe(length: int = 16) -> backend_fp8.Fp8Recipe:
    config = dict(fp8="hybrid", fp8_recipe="delayed", num_layers=1, fp8_margin=0,
                  fp8_wgrad=True, first_last_layers_bf16=False, fp8_amax_history_len=length,
                  fp8_amax_compute_algo="max")  # fmt: skip
    from types import SimpleNamespace

    return backend_fp8.module_recipe("X", SimpleNamespace(**config), torch.empty(48, 64))


def test_a_linear_trains_its_three_tensors_on_their_histories() -> None:
    torch.manual_seed(4)
    recipe = _delayed_recipe()
    w = (torch.randn(48, 64) / 8).to(torch.bfloat16).requires_grad_()
    for step in range(4):
        x = torch.randn(20, 64, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(20, 48, dtype=torch.bfloat16)
        y = backend_fp8.fp8_linear(x, w, False, recipe)
        y.backward(dy)
        y64 = x.detach().double() @ w.detach().double().t()
        assert ((y.double() - y64).norm() / y64.norm()).item() < 0.05, step
        dx64 = dy.double() @ w.detach().double()
        assert ((x.grad.double() - dx64).norm() / dx64.norm()).item() < 0.08, step
    for name in ("input", "weight", "grad_output"):
        assert recipe.history(name).pos.item() == 3, name  # three advances after the first
    assert recipe.delayed.weight.group is None  # weights are alike on every rank


def _rank(rank: int, port: int, results) -> None:  # noqa: ANN001 - a spawned process
    import torch.distributed as dist

    join(rank, port)
    history = fp8.AmaxHistory(4, most_recent=False, group=dist.group.WORLD)
    fp8.quantize(torch.full((4, 16), 1.0 + rank), E4M3, history=history)  # amaxes 1 and 2
    reduced = history.current.item()  # the group's amax on every rank before the next quantize
    _, inv = fp8.quantize(torch.ones(4, 16), E4M3, history=history)
    results.put((rank, inv.item(), reduced))
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_scale_by_the_amax_over_the_reduction_group() -> None:
    """Outside a forward region, reduced right after each quantize: a checkpoint, which rank 0
    writes for the group, holds the group's amax, not rank 0's own."""
    got = _two_ranks(_rank)
    assert got == [(0, pytest.approx(2 / 448), 2.0), (1, pytest.approx(2 / 448), 2.0)]


def _rank_with_empty_tensors(rank: int, port: int, results) -> None:  # noqa: ANN001
    """Rank 1's first and third tensors are empty: it must take the same steps as rank 0
    (the history's start or its step, then the all-reduce of the amax), or the two ranks'
    all-reduces pair up wrongly and the group hangs or drifts apart."""
    import torch.distributed as dist

    join(rank, port, timeout_s=30)
    history = fp8.AmaxHistory(4, most_recent=False, group=dist.group.WORLD)
    empty = torch.empty(0, 16)
    fp8.quantize(empty if rank else torch.ones(4, 16), E4M3, history=history)  # amax 1 / none
    fp8.quantize(torch.full((4, 16), 3.0 - rank), E4M3, history=history)  # amaxes 3 and 2
    fp8.quantize_transposed(empty if rank else torch.full((4, 16), 0.5), E4M3, 0, history)
    _, inv = fp8.quantize(torch.ones(4, 16), E4M3, history=history)
    results.put((rank, inv.item(), history.history.tolist()))
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_rank_with_empty_tensors_stays_in_step_with_its_group() -> None:
    # the amaxes the group folded in: 1 (rank 0's first), 3 (the max of 3 and 2), 0.5
    want = (pytest.approx(3 / 448), [1.0, 3.0, 0.5, 0.0])
    assert _two_ranks(_rank_with_empty_tensors) == [(0, *want), (1, *want)]


def test_an_empty_first_tensor_without_a_group_leaves_the_history_unstarted() -> None:
    """No collective to keep in step: the first non-empty tensor still scales by its own amax
    (a small one would flush to zero at scale 1)."""
    history = fp8.AmaxHistory(4, most_recent=False)
    fp8.quantize(torch.empty(0, 16), E4M3, history=history)
    assert not history.started
    x = torch.full((4, 16), 1e-3)
    x_fp8, inv = fp8.quantize(x, E4M3, history=history)
    assert history.started and inv.item() == pytest.approx(1e-3 / 448)
    assert torch.equal(x_fp8.float() * inv, torch.full((4, 16), 1e-3))


def test_capturing_an_empty_first_tensor_on_a_group_rank_is_an_error(monkeypatch) -> None:
    monkeypatch.setattr(fp8, "capturing", lambda x: True)
    history = fp8.AmaxHistory(4, most_recent=False, group=object())  # never reached: no start
    with pytest.raises(RuntimeError, match="first quantize is being captured"):
        fp8.quantize(torch.empty(0, 16), E4M3, history=history)


def test_capturing_a_first_quantize_is_an_error(monkeypatch) -> None:
    """Its current scaling and the history's allocation would be frozen into the graph."""
    monkeypatch.setattr(fp8, "capturing", lambda x: True)
    with pytest.raises(RuntimeError, match="first quantize is being captured"):
        fp8.quantize(torch.ones(4, 16), E4M3, history=fp8.AmaxHistory(4, most_recent=False))
