"""Every kernel choice has a ROCm answer (``torch.version.hip`` simulated on the CPU): cuDNN SDPA
is refused in our own line, ``torch._grouped_mm`` is checked against the arch, flash and
efficient CP blocks against the GPUs AOTriton ships kernels for."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from megatron_rocm.runtime.backend import te_sdpa as sdpa  # noqa: E402
from megatron_rocm.runtime.backend.cp import block_attention as cpb  # noqa: E402
from megatron_rocm.runtime.kernels import grouped_gemm  # noqa: E402


@pytest.fixture
def rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "7.1.0", raising=False)


def test_cudnn_sdpa_alone_is_refused_on_rocm_in_one_line(
    rocm: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(sdpa.BACKENDS_ENV, "cudnn")
    with pytest.raises(ValueError) as info:
        sdpa.requested_backends()
    assert "\n" not in str(info.value) and "ROCm" in str(info.value)
    with pytest.raises(ValueError, match="no cuDNN"):
        with sdpa.sdpa_backends("cudnn"):
            pass


def test_cudnn_beside_others_on_rocm_and_cudnn_on_cuda_are_accepted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(sdpa.BACKENDS_ENV, "cudnn")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert sdpa.requested_backends() == "cudnn"
    monkeypatch.setattr(torch.version, "hip", "7.1.0", raising=False)
    monkeypatch.setenv(sdpa.BACKENDS_ENV, "cudnn,flash")
    assert sdpa.requested_backends() == "cudnn,flash"


def _gpu_tensor() -> object:
    return types.SimpleNamespace(is_cuda=True, device="cuda:0", element_size=lambda: 2)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
@pytest.mark.parametrize(("arch", "ok"), [("gfx942", True), ("gfx950", True), ("gfx90a", False)])
def test_explicit_grouped_mm_checks_the_rocm_arch(
    rocm: None, monkeypatch: pytest.MonkeyPatch, arch: str, ok: bool
) -> None:
    monkeypatch.setattr(grouped_gemm, "rocm_arch", lambda device: arch)
    problem = grouped_gemm._torch_problem(_gpu_tensor(), (4096, 1024), automatic=False)
    assert (problem is None) == ok
    if not ok:
        assert arch in problem and "gfx942/gfx950" in problem


@pytest.mark.parametrize(("arch", "ok"), [("gfx942", True), ("gfx90a", True), ("gfx1030", False)])
def test_flash_and_efficient_blocks_need_an_aotriton_arch(
    rocm: None, monkeypatch: pytest.MonkeyPatch, arch: str, ok: bool
) -> None:
    monkeypatch.setattr(cpb, "rocm_arch", lambda device: arch)
    problem = cpb._aotriton_problem(torch.device("cpu"))
    assert (problem is None) == ok
    if not ok:
        assert "AOTriton" in problem and arch in problem


def test_nvidia_blocks_do_not_ask_for_an_amd_arch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(cpb, "rocm_arch", lambda device: pytest.fail("asked for a gfx arch"))
    assert cpb._aotriton_problem(torch.device("cpu")) is None
