"""scripts/bench/triton_block_gemm: on PYTHONPATH it puts every block-scaled GEMM of a process on
the Triton kernel (ROCm's path), for benchmarks on NVIDIA GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
HOOK = REPO / "scripts" / "bench" / "triton_block_gemm"
# a problem cuBLASLt computes right (K = 4096: 32 blocks), as fp8_blockwise._problem builds it
ASK = (
    "import torch; from megatron_rocm.runtime.kernels import fp8_blockwise as bw; "
    "print(bw.cublaslt_takes((4096, 4096, True, torch.float8_e4m3fn, torch.float8_e4m3fn, "
    "torch.bfloat16, True)))"
)


def _ask(path: list[Path], cwd: Path) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, path)))
    done = subprocess.run(
        [sys.executable, "-c", ASK], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_on_the_path_no_problem_goes_to_cublaslt(tmp_path: Path) -> None:
    # from another folder, as train_small runs the tree's processes
    assert _ask([HOOK, REPO], tmp_path) == "False"


def test_off_the_path_cublaslt_takes_the_problem(tmp_path: Path) -> None:
    assert _ask([REPO], tmp_path) == "True"
