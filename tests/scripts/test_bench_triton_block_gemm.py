"""scripts/bench/triton_block_gemm: on PYTHONPATH it puts every block-scaled GEMM of a process on
the Triton kernel (ROCm's path), for benchmarks on NVIDIA GPUs, and says so; where it cannot, the
process stops."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
HOOK = REPO / "scripts" / "bench" / "triton_block_gemm"
SAID = "triton_block_gemm: every block-scaled FP8 GEMM on the Triton kernel\n"
# a problem cuBLASLt computes right (K = 4096: 32 blocks), as fp8_blockwise._problem builds it
ASK = (
    "import torch; from megatron_rocm.runtime.kernels import fp8_blockwise as bw; "
    "print(bw.cublaslt_takes((4096, 4096, True, torch.float8_e4m3fn, torch.float8_e4m3fn, "
    "torch.bfloat16, True)))"
)


def _ask(path: list[Path], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, path)))
    return subprocess.run(
        [sys.executable, "-c", ASK], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_on_the_path_no_problem_goes_to_cublaslt_and_the_process_says_so(tmp_path: Path) -> None:
    done = _ask([HOOK, REPO], tmp_path)  # from another folder, as train_small runs the ranks
    assert (done.returncode, done.stdout, done.stderr) == (0, "False\n", SAID)


def test_off_the_path_cublaslt_takes_the_problem(tmp_path: Path) -> None:
    done = _ask([REPO], tmp_path)
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr


def test_a_process_that_cannot_import_megatron_rocm_stops_with_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "megatron_rocm"
    broken.mkdir()
    (broken / "__init__.py").write_text('raise ImportError("no such build")\n')
    done = _ask([HOOK, tmp_path], tmp_path)
    assert (done.returncode, done.stdout) == (3, "")
    assert done.stderr == (
        "triton_block_gemm: cannot import megatron_rocm (ImportError: no such build)\n"
    )
