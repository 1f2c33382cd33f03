"""The ``multi-tensor`` patch's clip_grads hunk on a real megatron-core sdist, on CPU.

From 0.17 upstream keeps the gradient norm and the clip coefficient on the device where
``multi_tensor_scale_tensor`` exists (TE's path); without TE it read the norm back to the host
every step, a sync before the optimizer step that left the GPU idle while the host caught up
(gradient clipping is on by default). ``grad_norm_probe.py`` calls upstream's
``get_grad_norm_fp32`` and ``clip_grad_by_total_norm_fp32`` on the patched 0.17.1 and 0.19.2
sdists (the v0.17 variant, as 0.18 and dev; the v0.19 one, as main) and on the same trees
without the patch: the norm must be a tensor, and the norm and the clipped gradients must
equal a float64 computation, clipping or not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from patched_trees import without_patch
from probe_cli import applied_and_probed, probed

pytestmark = [pytest.mark.upstream, pytest.mark.torch, pytest.mark.slow, pytest.mark.full]
pytest.importorskip("torch")
PROBE = Path(__file__).with_name("grad_norm_probe.py")


@pytest.fixture(scope="module", params=["0.17.1", "0.19.2"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    tree = tmp_path_factory.mktemp("gradnorm") / request.param
    patched = applied_and_probed(PROBE, request.param, tree)
    without_patch(tree, "multi-tensor")
    return patched, probed(PROBE, tree, tree.parent / "unpatched.json")


@pytest.mark.parametrize("case", ["clips", "keeps"])
def test_the_norm_stays_on_the_device_and_clips_exactly(runs: tuple[dict, dict], case: str) -> None:
    patched, _ = runs
    assert patched["device_path"]
    got = patched[case]
    assert got["norm_type"] == "Tensor"
    assert got["norm_error"] < 1e-6
    assert got["grad_error"] < 1e-6
    assert (got["coeff"] < 0.1) == (case == "clips")  # the two cases are what they say


def test_without_the_patch_the_norm_comes_back_to_the_host(runs: tuple[dict, dict]) -> None:
    _, unpatched = runs
    assert not unpatched["device_path"]
    assert unpatched["clips"]["norm_type"] == "float"
    assert unpatched["clips"]["grad_error"] < 1e-6  # same numbers, only where they live differs
