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

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cache_paths import DOWNLOAD_CACHE

from megatron_rocm.main import main

pytestmark = [pytest.mark.upstream, pytest.mark.torch, pytest.mark.slow, pytest.mark.full]
pytest.importorskip("torch")
PROBE = Path(__file__).with_name("clip_vit_probe.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    dest = tmp_path_factory.mktemp("clip") / "0.19.2"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MEGATRON_ROCM_CACHE", str(DOWNLOAD_CACHE))
        assert main(["apply", "--source", "pypi", "--ref", "0.19.2", "--dest", str(dest)]) == 0
    out = dest.parent / "probe.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(dest), str(REPO)])}
    cmd = [sys.executable, str(PROBE), "--tree", str(dest), "--out", str(out)]
    subprocess.run(cmd, cwd=dest, env=env, check=True, timeout=600)
    result = json.loads(out.read_text())
    assert "error" not in result, f"{result['error']}\n{result.get('trace')}"
    return result


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_the_clip_vit_builds_and_runs_with_the_configs_norm(probed: dict, kind: str) -> None:
    got = probed[kind]
    assert got["norm"] == "FusedNorm"  # the native backend's norm, through WrappedTorchNorm
    assert got["norm_error"] < 1e-5
    assert got["shape"] == [2, 5, 64] and got["finite"]  # 4 patches + the class token
