"""``rope-fusion`` on real 0.12 and 0.13 sdists, on CPU: fused RoPE on packed sequences under CP.

Upstream's ``apply_rotary_pos_emb`` at 0.12-0.13 refuses THD inputs with context parallelism
unless TransformerEngine is newer than 1.11 (``Only TE >= 1.12 supports RoPE fusion for THD
format with CP``), because older TE's fused THD RoPE took no CP rank. Without TE the patch
supplies ``megatron_rocm.runtime.kernels.rope.fused_apply_rotary_pos_emb_thd``, which takes
``cp_size``/``cp_rank``; the patch lets it through that check (the GPU smoke check
``parallel.cp2_packed.te`` failed on core_v0.12.0 before). Patched, each CP rank's call returns
what the native kernel gives for that rank; with that hunk reverted the check fires again.
From 0.14 upstream dropped the check.
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

pytestmark = [pytest.mark.upstream, pytest.mark.slow, pytest.mark.torch, pytest.mark.full]
pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[2]
ROPE_UTILS = "megatron/core/models/common/embeddings/rope_utils.py"
PATCHED_CHECK = "if not native and not is_te_min_version("
UPSTREAM_CHECK = "if not is_te_min_version("

PROBE = """
import inspect, json, types, torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings import rope_utils
from megatron_rocm.runtime.kernels.rope import fused_apply_rotary_pos_emb_thd as native

class Group:  # the CP group as 0.13's apply_rotary_pos_emb reads it
    def __init__(self, rank): self._rank = rank
    def size(self): return 2
    def rank(self): return self._rank

cu = torch.tensor([0, 8, 12, 24], dtype=torch.int32)  # three documents, 24 tokens in all
freqs = torch.randn(24, 1, 1, 8, generator=torch.Generator().manual_seed(0))
t = torch.randn(12, 2, 8, generator=torch.Generator().manual_seed(1))  # one rank's half
config = types.SimpleNamespace(apply_rope_fusion=True, mrope_section=None,
                               rotary_interleaved=False, multi_latent_attention=False)
same = {}
for rank in (0, 1):
    parallel_state.get_context_parallel_world_size = lambda: 2  # 0.12 asks parallel_state
    parallel_state.get_context_parallel_rank = lambda r=rank: r
    takes_group = "cp_group" in inspect.signature(rope_utils.apply_rotary_pos_emb).parameters
    kwargs = {"cp_group": Group(rank)} if takes_group else {}
    try:
        got = rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, **kwargs)
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        raise SystemExit(0)
    same[rank] = torch.equal(got, native(t, cu, freqs, cp_size=2, cp_rank=rank))
print(json.dumps(same))
"""


def _probe(tree: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)])},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("release", ["0.12.3", "0.13.1"])
def test_fused_thd_rope_runs_under_cp_without_te(tmp_path, monkeypatch, release) -> None:  # noqa: ANN001
    monkeypatch.setenv("MEGATRON_ROCM_CACHE", str(DOWNLOAD_CACHE))
    tree = tmp_path / release
    assert main(["apply", "--source", "pypi", "--ref", release, "--dest", str(tree)]) == 0
    assert _probe(tree) == {"0": True, "1": True}

    rope_utils = tree / ROPE_UTILS
    text = rope_utils.read_text()
    assert text.count(PATCHED_CHECK) == 1
    rope_utils.write_text(text.replace(PATCHED_CHECK, UPSTREAM_CHECK))
    assert _probe(tree) == {
        "error": "ValueError: Only TE >= 1.12 supports RoPE fusion for THD format with CP."
    }
