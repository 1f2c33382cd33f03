"""Run a test file's ``-m triton`` tests in a child pytest under Triton's CPU interpreter.

``TRITON_INTERPRET`` must be set before Triton compiles anything, so the Triton parity tests
of a kernel run in a child process with it set; the parent test fails if any of them fails,
or if none ran, or (``allow_skips=False``) if any was skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_triton_tests_under_interpreter(
    test_file: Path, *extra_args: str, allow_skips: bool = True
) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("MEGATRON_ROCM_KERNELS", None)  # a forced reference path would test nothing
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
