"""The ``mla-rope-mask`` patch on real sdists: upstream's fused MLA RoPE kernels with 12 heads
and ``BLOCK_H=8`` (a partial last block) under the Triton interpreter (CPU).

Unpatched, the last block's mask lets heads 12..15 through: the interpreter reads and writes
past the tensor and the process dies (SIGSEGV), as the GPU run died with an illegal memory
access. Patched, every block size gives the same forward and backward as one block of 16.
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

pytestmark = [
    pytest.mark.upstream,
    pytest.mark.torch,
    pytest.mark.triton,
    pytest.mark.slow,
    pytest.mark.full,
]
pytest.importorskip("torch")
pytest.importorskip("triton")

# the first release with the fused MLA RoPE, one in the middle, the newest line
RELEASES = ["0.13.1", "0.16.1", "0.19.2"]
PROBE = Path(__file__).with_name("mla_rope_probe.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("release", RELEASES)
def test_fused_mla_rope_masks_a_partial_block(tmp_path, monkeypatch, release):
    monkeypatch.setenv("MEGATRON_ROCM_CACHE", str(DOWNLOAD_CACHE))
    dest = tmp_path / release
    assert main(["apply", "--source", "pypi", "--ref", release, "--dest", str(dest)]) == 0
    proc = subprocess.run(
        [sys.executable, str(PROBE)],
        cwd=dest,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(dest), str(REPO)])},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr.strip().splitlines()[-3:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"out_diff": 0.0, "grad_diff": 0.0, "guard_changed": False}
