"""The ``model-specs-without-te`` patch on real megatron-core sdists, on CPU.

Without TE, upstream's T5, BERT and heterogeneous GPT spec modules leave their TE names unbound
(to 0.15) or None (from 0.16), so their TE specs fail: ``NameError`` or ``not_none``'s
``ValueError: Expected value to be not None`` (upstream's ``test_t5_model.py`` and
``test_heterogeneous_gpt_model.py`` stop there), and BERT's refuses with ``ImportError:
Transformer Engine is not installed``. ``model_specs_probe.py`` builds each model from its TE
spec on the patched tree and from its local spec, and runs the TE one forward: the native
backend's modules must stand in (heterogeneous GPT's linear replacements included), with the
local spec's parameter count, and the padding mask must reach the attention. The same probe
on the tree without this patch (its commit reverted) must fail as upstream does. Three releases
(about 16 s each): 0.12.3 (v0.12: the native names straight from ``te_names``), 0.15.3 (v0.13:
names unbound without TE) and 0.19.2 (v0.17, as main and dev); v0.16 differs from v0.13 in
context only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from patched_trees import without_patch
from probe_cli import applied_and_probed, probed

from megatron_rocm.patchtool.series import parse_version

pytestmark = [pytest.mark.upstream, pytest.mark.torch, pytest.mark.slow, pytest.mark.full]
pytest.importorskip("torch")
PROBE = Path(__file__).with_name("model_specs_probe.py")
PATCH = "model-specs-without-te"
RELEASES = ["0.12.3", "0.15.3", "0.19.2"]
MODELS = ["t5", "bert", "heterogeneous"]
NATIVE = "megatron_rocm.runtime.backend"


@pytest.fixture(scope="module", params=RELEASES)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(release, the probe's result on the patched tree, its result without this patch)."""
    release = request.param
    tree = tmp_path_factory.mktemp("specs") / release
    patched = applied_and_probed(PROBE, release, tree)
    without_patch(tree, PATCH)
    return release, patched, probed(PROBE, tree, tree.parent / "unpatched.json")


@pytest.mark.parametrize("model", MODELS)
def test_the_te_spec_builds_on_the_native_backend_and_runs(runs: tuple, model: str) -> None:
    got = runs[1][model]
    assert "failed" not in got, got.get("trace")
    assert all(NATIVE in where for where in got["attention"]), got["attention"]
    assert got["params"] == got["local_params"]  # the fused norms are the local spec's norms
    assert got["shape"] == [2, 8, 128] and got["finite"]
    if model == "heterogeneous":  # TELayerNormColumnParallelLinearGathered on the native linear
        assert all(
            w.startswith("TELayerNormColumnParallelLinearGathered") and NATIVE in w
            for w in got["replaced"]
        ), got["replaced"]
    else:
        assert got["padding_ignored"] and got["padding_reaches"]


@pytest.mark.parametrize("model", MODELS)
def test_without_the_patch_the_te_spec_fails_as_upstream(runs: tuple, model: str) -> None:
    release, _, unpatched = runs
    unbound = parse_version(release) < parse_version("0.16.0")
    want = {
        "bert": "ImportError: Transformer Engine is not installed",
        "t5": "NameError: name 'TELayerNormColumnParallelLinear' is not defined"
        if unbound
        else "ValueError: Expected value to be not None",
    }
    want["heterogeneous"] = want["t5"]
    assert unpatched[model].get("failed", "").startswith(want[model]), unpatched[model]
