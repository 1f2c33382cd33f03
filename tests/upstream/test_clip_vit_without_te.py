"""The ``clip-vit-norm-without-te`` patch on a real megatron-core sdist, on CPU.

Upstream's ``CLIPViTModel`` (LLaVA's vision tower) defaults its ``ln_pre``/``ln_post`` to TE's
norm, and without TE to ``torch.nn.LayerNorm``, which ``build_module`` cannot construct: it
passes ``config=`` (``TypeError``; upstream's LLaVA and CLIP tests error there on a tree without
TE). ``clip_vit_probe.py`` builds the model from its defaults on the patched 0.19.2 sdist and
runs it forward; the norm must normalise as the config says (LayerNorm and RMSNorm, against
the formula in float64). 0.19.2 is the newest release sdist; at 0.12 the ViT specs themselves
import TE's extension unconditionally, so a ViT without TE is out of reach there anyway.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from probe_cli import applied_and_probed

pytestmark = [pytest.mark.upstream, pytest.mark.torch, pytest.mark.slow, pytest.mark.full]
pytest.importorskip("torch")
PROBE = Path(__file__).with_name("clip_vit_probe.py")


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return applied_and_probed(PROBE, "0.19.2", tmp_path_factory.mktemp("clip") / "0.19.2")


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_the_clip_vit_builds_and_runs_with_the_configs_norm(probed: dict, kind: str) -> None:
    got = probed[kind]
    assert got["norm"] == "FusedNorm"  # the native backend's norm, through WrappedTorchNorm
    assert got["norm_error"] < 1e-5
    assert got["shape"] == [2, 5, 64] and got["finite"]  # 4 patches + the class token
