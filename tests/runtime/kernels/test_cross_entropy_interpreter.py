"""Run the Triton cross-entropy parity tests under the Triton interpreter on CPU-only machines.

``TRITON_INTERPRET`` must be set before Triton compiles anything, so the ``-m triton`` tests
of ``test_cross_entropy.py`` run in a child pytest with it set; this test fails if any of them fails
or if none ran.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from triton_interpreter import run_triton_tests_under_interpreter

pytestmark = [pytest.mark.triton, pytest.mark.slow]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the Triton tests natively")
def test_triton_cross_entropy_parity_under_interpreter():
    run_triton_tests_under_interpreter(
        Path(__file__).with_name("test_cross_entropy.py"), allow_skips=False
    )
