"""FP8 with tensor parallelism on the native linears, on real megatron-core sdists (CPU).

The series is applied to the 0.12.3 sdist (upstream's mappings without a ``group`` argument)
and the 0.19.2 one, and ``fp8_tp_probe.py`` runs upstream's TE-spec ``TransformerBlock`` on
two gloo ranks with TP=2, in bf16 and in FP8 (``tensorwise``, ``delayed`` and, from core 0.13,
``blockwise``), with and
without sequence parallelism, two steps each from one seed. The FP8 GEMMs sit inside
upstream's tensor-parallel exchanges (``backend.tp_comm``): every rank runs every linear's
GEMMs in FP8, the blocks stay within FP8's error of the bf16 block with the same parallelism
(a missing all-reduce or reduce-scatter leaves a rank's partial sum, far outside it), sequence
parallelism changes no bit of the output or the gradients (all-gather against all-reduce, the
same operands), and under delayed scaling both ranks hold the same histories, the weight's
included (upstream's checkpoint holds TP rank 0's ``_extra_state`` for all ranks). Expert
linears and a column linear built with ``disable_grad_reduce`` exchange nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from probe_cli import applied_and_probed, relative_error

pytestmark = [pytest.mark.full, pytest.mark.upstream, pytest.mark.torch, pytest.mark.slow]
torch = pytest.importorskip("torch")
PROBE = Path(__file__).with_name("fp8_tp_probe.py")
FP8 = ("tensorwise", "delayed", "blockwise")  # blockwise from core 0.13 (upstream's choices)
LINEARS_PER_LAYER = 4  # qkv, proj, fc1, fc2


@pytest.fixture(scope="module", params=["0.12.3", "0.19.2"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list:
    dest = tmp_path_factory.mktemp("fp8-tp") / request.param
    results = applied_and_probed(PROBE, request.param, dest)
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result['error']}\n{result.get('trace')}"
    assert len(results) == 2
    return results


def _runs(result: dict) -> tuple[str, ...]:
    """The FP8 recipes the probe ran: blockwise only where upstream's choices have it."""
    return tuple(r for r in FP8 if r != "blockwise" or "blockwise" in result)


@pytest.mark.parametrize("sp", ["", "-sp"])
def test_every_linear_runs_fp8_on_every_rank(ranks, request, sp: str) -> None:  # noqa: ANN001
    for result in ranks:
        assert result[f"bf16{sp}"]["fp8_gemms"] == 0
        for recipe in _runs(result):  # two layers, two steps
            gemms = result[f"{recipe}{sp}"]
            counted = ("blockwise_gemms", "fp8_gemms")
            if recipe != "blockwise":
                counted = counted[::-1]
            assert (gemms[counted[0]], gemms[counted[1]]) == (2 * 2 * LINEARS_PER_LAYER, 0)
        ran_blockwise = "blockwise" in _runs(result)
        assert ran_blockwise == (request.node.callspec.params["ranks"] != "0.12.3")


# the bounds of test_fp8_without_te (E4M3 forward, E5M2 gradients; delayed scaling's second
# step scales by the first's twice larger amaxes); a rank's partial sum without its peer's is
# about 1/sqrt(2) of the whole away
@pytest.mark.parametrize("recipe", FP8)
@pytest.mark.parametrize("sp", ["", "-sp"])
@pytest.mark.parametrize(("what", "bound"), [("out", 0.02), ("dx", 0.02), ("fc1_grad", 0.15)])
def test_fp8_stays_within_fp8_error_of_bf16(ranks, recipe, sp, what, bound) -> None:  # noqa: ANN001
    bound = 0.25 if (recipe, what) == ("delayed", "fc1_grad") else bound
    for result in ranks:
        if recipe not in _runs(result):
            continue  # core 0.12: test_every_linear_runs_fp8_on_every_rank says it did not run
        rel = relative_error(result[f"{recipe}{sp}"][what], result[f"bf16{sp}"][what])
        assert 1e-4 < rel < bound, rel  # quantized (not bf16's result), within FP8's error


@pytest.mark.parametrize("recipe", ["bf16", *FP8])
def test_sequence_parallelism_changes_no_bit(ranks, recipe: str) -> None:  # noqa: ANN001
    for result in ranks:
        if recipe not in ("bf16", *_runs(result)):
            continue  # core 0.12 has no blockwise
        plain, sp = result[recipe], result[f"{recipe}-sp"]
        for what in ("out", "dx", "fc1_grad"):
            assert plain[what] == sp[what], what


@pytest.mark.parametrize("sp", ["", "-sp"])
def test_delayed_histories_are_the_same_on_both_ranks(ranks, sp: str) -> None:  # noqa: ANN001
    first, second = (result[f"delayed{sp}"]["histories"] for result in ranks)
    assert len(first) == 2 * LINEARS_PER_LAYER * 3  # input, weight, output gradient each
    assert all(state[2] == 1 for state in first.values())  # started, then one advance
    assert first == second


@pytest.mark.parametrize("linear", ["expert-column", "expert-row", "column-no-grad-reduce"])
def test_linears_whose_exchanges_are_elsewhere_exchange_nothing(ranks, linear: str) -> None:  # noqa: ANN001
    """Expert linears (the dispatcher communicates) and ``disable_grad_reduce``: each rank's
    output and input gradient are its own GEMMs' within one FP8 GEMM's error (E4M3 operands
    forward, an E5M2 gradient backward: a few percent); a reduction over the ranks would add
    the peer's, from a different input: about 100% off."""
    for result in ranks:
        got = result["local"][linear]
        assert 1e-4 < relative_error(got["out"], got["want_out"]) < 0.08
        assert 1e-4 < relative_error(got["dx"], got["want_dx"]) < 0.15
