"""Run each kernel's Triton parity tests under the Triton interpreter on CPU-only machines.

``TRITON_INTERPRET`` must be set before Triton compiles anything, so the ``-m triton`` tests of
each kernel's test file run in a child pytest with it set; a case fails if any of them fails or
if none ran, and (where the file has no legitimately skipped case) if any was skipped. Grouped
GEMM runs its own child from ``test_grouped_gemm.py`` (``-k triton``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from triton_interpreter import run_triton_tests_under_interpreter

pytestmark = [pytest.mark.triton, pytest.mark.slow]

# test file -> whether a skipped case is acceptable there
KERNEL_TESTS = {
    "test_softmax.py": True,
    "test_rope.py": False,
    "test_cross_entropy.py": False,
    "test_norm.py": False,
    "test_swiglu.py": False,
}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the Triton tests natively")
@pytest.mark.parametrize("test_file", sorted(KERNEL_TESTS))
def test_triton_parity_under_interpreter(test_file: str) -> None:
    run_triton_tests_under_interpreter(
        Path(__file__).with_name(test_file), allow_skips=KERNEL_TESTS[test_file]
    )
