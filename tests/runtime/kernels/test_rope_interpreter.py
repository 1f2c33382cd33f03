"""Run the Triton RoPE parity tests under the Triton interpreter on CPU-only machines.

``TRITON_INTERPRET`` must be set before Triton compiles anything, so the ``-m triton`` tests
of ``test_rope.py`` run in a child pytest with it set; this test fails if any of them fails
or if none ran.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.triton, pytest.mark.slow]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the Triton tests natively")
def test_triton_rope_parity_under_interpreter():
    here = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("MEGATRON_ROCM_KERNELS", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "triton",
            str(here / "test_rope.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = "\n".join(proc.stdout.splitlines()[-15:])
    assert proc.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail and " skipped" not in tail, tail
