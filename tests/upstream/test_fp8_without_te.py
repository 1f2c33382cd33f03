"""The ``fp8-without-te`` patch on real megatron-core sdists, on CPU.

The series is applied to the 0.12.3 sdist (the ``v0.12.diff`` variant) and the 0.19.2 one
(``v0.14.diff``), and ``fp8_probe.py`` builds upstream's TE-spec ``TransformerBlock`` (four
layers, the first and the last kept in bf16 by ``first_last_layers_bf16``) with
``fp8="hybrid", fp8_recipe="tensorwise"``, with upstream's default recipe (``delayed``, at the
8B example's history of 1024 and ``max``), with ``blockwise`` (0.19.2: the 0.12 choices lack it;
every linear on the block-scaled function) and in bf16, from the same seed, two steps each.
Without the patch upstream's ``get_fp8_context`` is a null context and FP8 flags train in bf16;
with it the two middle layers' linears run their GEMMs in FP8 (every layer's under ``delayed``),
the outer ones and the bf16 block none, the delayed histories advance once a quantize after
the first, and the FP8 blocks' outputs and gradients stay within FP8's error of the bf16
block's. Under upstream's schedule (two micro-batches an iteration, an SGD step between), the
linears reuse the first micro-batch's FP8 weight on the second, refresh it after the step
(tensorwise losses equal, bit for bit, to those of a run that re-quantizes every time), and
the delayed weight histories advance once an iteration.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from probe_cli import applied_and_probed, relative_error

pytestmark = [pytest.mark.full, pytest.mark.upstream, pytest.mark.torch, pytest.mark.slow]
torch = pytest.importorskip("torch")
PROBE = Path(__file__).with_name("fp8_probe.py")
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
           "mlp.linear_fc2")  # fmt: skip


@pytest.fixture(scope="module", params=["0.12.3", "0.19.2"])
def probed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    dest = tmp_path_factory.mktemp("fp8") / request.param
    return applied_and_probed(PROBE, request.param, dest)


def test_middle_layers_run_fp8_and_the_outer_ones_bf16(probed) -> None:  # noqa: ANN001
    want = {f"layers.{layer}.{linear}": layer in (1, 2) for layer in range(4) for linear in LINEARS}
    assert probed["fp8"]["recipes"] == want
    assert probed["fp8"]["fp8_gemms"] == 2 * 2 * len(LINEARS)  # each FP8 linear's forwards
    assert not any(probed["bf16"]["recipes"].values()) and probed["bf16"]["fp8_gemms"] == 0


def test_delayed_scaling_runs_every_layer_on_its_histories(probed) -> None:  # noqa: ANN001
    assert all(probed["delayed"]["recipes"].values())
    assert probed["delayed"]["fp8_gemms"] == 2 * 4 * len(LINEARS)
    # input, weight and output gradient: started by the first step, one advance in the second
    assert set(map(tuple, probed["delayed"]["history_positions"].values())) == {(1, 1, 1)}
    assert len(probed["delayed"]["history_positions"]) == 4 * len(LINEARS)


def test_block_scaling_runs_every_layer_on_the_blockwise_function(probed) -> None:  # noqa: ANN001
    """``fp8_recipe="blockwise"`` (upstream's choices have it from core 0.13): every linear of
    the block takes the block-scaled function, none the per-tensor one."""
    got = probed["blockwise"]
    if probed["version"] < [0, 13]:
        assert got is None
        return
    assert all(got["recipes"].values()) and got["blockwise_recipes"] == 4 * len(LINEARS)
    assert got["blockwise_gemms"] == 2 * 4 * len(LINEARS) and got["fp8_gemms"] == 0
    assert not got["history_positions"]


# E4M3 rounds within 2^-4 of a value, E5M2 (hybrid's gradients) within 2^-3: the weight
# gradient, a sum over only 32 tokens of E5M2 gradients, keeps most of that error. The delayed
# block runs all four layers in FP8 (upstream's config refuses first/last bf16 layers with
# delayed scaling), the tensorwise one two: layer 1's weight gradient comes through three FP8
# backward passes instead of one.
@pytest.mark.parametrize("recipe", ["fp8", "delayed", "blockwise"])
@pytest.mark.parametrize(("what", "bound"), [("out", 0.02), ("dx", 0.02), ("fc1_grad", 0.15)])
def test_fp8_block_stays_within_fp8_error_of_bf16(probed, recipe, what: str, bound: float) -> None:  # noqa: ANN001
    if probed[recipe] is None:  # blockwise before core 0.13: the previous test checks that
        assert recipe == "blockwise" and probed["version"] < [0, 13]
        return
    rel = relative_error(probed[recipe][what], probed["bf16"][what])
    bound = (
        0.25 if (recipe, what) in (("delayed", "fc1_grad"), ("blockwise", "fc1_grad")) else bound
    )
    assert 1e-4 < rel < bound, rel  # quantized (not bf16's result), within FP8's error


def test_the_schedule_reuses_the_fp8_weight_within_an_iteration_only(probed) -> None:  # noqa: ANN001
    reuse, fresh = probed["scheduled-tensorwise-reuse"], probed["scheduled-tensorwise-no-reuse"]
    fp8_linears = 4 * len(LINEARS)
    assert reuse["reused"] == 2 * fp8_linears  # the second micro-batch of each iteration
    assert fresh["reused"] == 0
    # a stale weight after the step would change the second iteration's losses
    assert reuse["losses"] == fresh["losses"] and len(reuse["losses"]) == 4
    assert reuse["losses"][2] != reuse["losses"][0] * 2  # the step changed the weights
    delayed = probed["scheduled-delayed-reuse"]["weight_positions"]
    assert delayed == [1] * fp8_linears  # started, then one advance: once an iteration
    assert probed["scheduled-delayed-no-reuse"]["weight_positions"] == [3] * fp8_linears


@pytest.mark.parametrize("recipe", ["fp8", "delayed"])
def test_fp8_param_gather_weights_are_upstreams_fp8_params(probed, recipe: str) -> None:  # noqa: ANN001
    """``--fp8-param-gather``: upstream's ``is_float8tensor`` sees the native FP8 weights of the
    FP8 layers' linears and nothing else, and their first step is the block's without it, bit
    for bit."""
    got = probed[f"{recipe}-param-gather"]
    fp8_layers = (1, 2) if recipe == "fp8" else range(4)
    want = {
        name: any(name == f"layers.{layer}.{linear}.weight" for layer in fp8_layers
                  for linear in LINEARS)
        for name in got["float8"]
    }  # fmt: skip
    assert got["float8"] == want and sum(want.values()) == len(fp8_layers) * len(LINEARS)
    assert got["same_out"] and got["same_dx"] and got["same_grads"]
