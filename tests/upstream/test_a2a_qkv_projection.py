"""The ``a2a-qkv-projection`` patch on a real megatron-core sdist, on CPU.

The series is applied to the 0.19.2 sdist; ``a2a_qkv_probe.py`` then runs upstream's
``GPTModel`` on the TE spec (the native backend) in a gloo world of two ranks with CP=2 and
``cp_comm_type="a2a"``, once with ``MEGATRON_ROCM_CP_A2A_QKV=1`` and once with ``=0``, from
the same seed. With the hunk handing the projection to ``cp.a2a_qkv`` the loss, the logits and
every parameter's gradient must be upstream's; each module's parameters are only valid after
its forward pre-hook (as under ``--overlap-param-gather``), so a path that read the QKV weight
outside ``linear_qkv``'s call would show. Where the chain is not upstream's plain one (q/k
norms) the native path must stand aside and say why.
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
torch = pytest.importorskip("torch")
PROBE = Path(__file__).with_name("a2a_qkv_probe.py")
REPO = Path(__file__).resolve().parents[2]
RELEASE = "0.19.2"  # the patch's first variant


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("a2a-qkv") / RELEASE
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MEGATRON_ROCM_CACHE", str(DOWNLOAD_CACHE))
        assert main(["apply", "--source", "pypi", "--ref", RELEASE, "--dest", str(dest)]) == 0
    return dest


def probe(tree: Path, tmp_path: Path, *flags: str) -> list[dict]:
    out = tmp_path / "probe.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)])}
    env.pop("MEGATRON_ROCM_CP_A2A_QKV", None)
    cmd = [sys.executable, str(PROBE), "--tree", str(tree), "--out", str(out), *flags]
    subprocess.run(cmd, cwd=tree, env=env, check=True, timeout=900)
    results = json.loads(out.read_text())
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result['error']}\n{result.get('trace')}"
    return results


def assert_same_training_step(on: dict, off: dict) -> None:
    assert on["loss"] == pytest.approx(off["loss"], rel=1e-6, abs=1e-6)
    got, want = torch.tensor(on["logits"]), torch.tensor(off["logits"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert set(on["grads"]) == set(off["grads"]) and on["grads"]
    for name, grad in off["grads"].items():
        want = torch.tensor(grad)
        assert want.abs().sum() > 0, name
        torch.testing.assert_close(torch.tensor(on["grads"][name]), want, rtol=1e-5,
                                   atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip


@pytest.mark.parametrize("flags", [(), ("--qkv-bias",), ("--rope-fusion",)], ids=str)
def test_the_projection_around_a2a_trains_as_upstream(tree, tmp_path, flags) -> None:  # noqa: ANN001
    """Every layer of both ranks takes the native path (two layers: two calls each) and the
    step is upstream's, with the parameters valid only from each module's pre-hook on."""
    for result in probe(tree, tmp_path, "--deferred-parameters", *flags):
        assert (result["on"]["projected_calls"], result["off"]["projected_calls"]) == (2, 0)
        assert any("computes the QKV projection around" in m for m in result["logged"])
        assert_same_training_step(result["on"], result["off"])


def test_qk_norms_keep_upstreams_path_and_say_why(tree, tmp_path) -> None:  # noqa: ANN001
    for result in probe(tree, tmp_path, "--qk-layernorm"):
        assert (result["on"]["projected_calls"], result["off"]["projected_calls"]) == (0, 0)
        assert any("(q/k layernorm)" in m for m in result["logged"]), result["logged"]
        assert_same_training_step(result["on"], result["off"])
