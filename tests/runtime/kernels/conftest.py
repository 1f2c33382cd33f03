"""Shared fixtures for the kernel parity tests (torch CPU is enough unless marked ``gpu``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture
def cuda_device() -> torch.device:
    """The current GPU (CUDA or ROCm); skips the test on machines without one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA/ROCm GPU")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def simulate_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``torch.version.hip`` look like a ROCm build for code paths keyed on it."""
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
