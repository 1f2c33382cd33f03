"""Judge each kernel file's child run under the Triton interpreter on CPU-only machines.

``TRITON_INTERPRET`` must be set before Triton compiles anything, so a file's Triton tests run
in a child pytest with it set, and each reports its own outcome from there
(``triton_interpreter``). These cases judge a file's child run as a whole: it fails if the
child failed or ran nothing, and (where the file has no legitimately skipped case) if anything
was skipped. Grouped GEMM judges its own from ``test_grouped_gemm.py``.
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
    "test_fp8_cast_transpose.py": False,
    "test_fp8_delayed.py": False,
    "test_fp8_blockwise.py": False,
    "test_fp8_segments.py": False,
    "../backend/test_fp8_param.py": False,
    "../../envtools/test_smoke_fp8.py": False,
    "test_norm.py": False,
    "test_swiglu.py": False,
}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the Triton tests natively")
@pytest.mark.parametrize("test_file", sorted(KERNEL_TESTS))
def test_triton_parity_under_interpreter(test_file: str, request: pytest.FixtureRequest) -> None:
    run_triton_tests_under_interpreter(
        (Path(__file__).parent / test_file).resolve(),
        request.session,
        allow_skips=KERNEL_TESTS[test_file],
    )
