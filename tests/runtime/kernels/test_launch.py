"""runtime/kernels/launch.py's host-side helpers."""

from __future__ import annotations

import pytest

from megatron_rocm.runtime.kernels.launch import cdiv


def test_cdiv_is_tritons_for_every_grid_size() -> None:
    triton = pytest.importorskip("triton")
    for a in [*range(0, 300), 2**31 - 1, 2**31, 2**40 + 7]:
        for b in (1, 2, 3, 16, 64, 128, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
