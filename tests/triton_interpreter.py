"""Triton tests: where they run, their marker, and running them under the CPU interpreter.

A kernel's Triton tests carry ``@triton_test``: they run on a GPU, or on the CPU under
``TRITON_INTERPRET=1``, and skip elsewhere. ``TRITON_INTERPRET`` must be set before Triton
compiles anything, so on CPU-only machines ``run_triton_tests_under_interpreter`` runs a test
file's ``-m triton`` tests in a child pytest with it set; the parent test fails if any of them
fails, or if none ran, or (``allow_skips=False``) if any was skipped.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def _triton_device() -> str | None:
    """ "cuda" (a CUDA or ROCm GPU), "cpu" under the interpreter, None where Triton can't run."""
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None:
        return None
    import torch

    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if INTERPRETER else None


TRITON_DEVICE = _triton_device()
needs_triton = pytest.mark.skipif(
    TRITON_DEVICE is None, reason="needs triton and a GPU, or TRITON_INTERPRET=1 on CPU"
)


def triton_test(fn: Callable[..., None]) -> Callable[..., None]:
    """Marks ``triton``, skips where Triton can't run, silences the interpreter's numpy
    deprecation noise."""
    fn = pytest.mark.filterwarnings("ignore::DeprecationWarning")(fn)
    return pytest.mark.triton(needs_triton(fn))


def run_triton_tests_under_interpreter(
    test_file: Path, *extra_args: str, allow_skips: bool = True
) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("MEGATRON_ROCM_KERNELS", None)  # a forced reference path would test nothing
    env.pop("MEGATRON_ROCM_TRITON_NORMS", None)  # the tests pick the norms' routing themselves
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "triton"]
    proc = subprocess.run(
        [*cmd, *extra_args, str(test_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = "\n".join(proc.stdout.splitlines()[-15:])
    assert proc.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail
    assert allow_skips or " skipped" not in tail, tail
