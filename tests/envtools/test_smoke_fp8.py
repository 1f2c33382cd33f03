"""The smoke suite's ``kernels.fp8`` on the CPU: it passes in the formats of the arch (gfx942's
``fnuz`` ones simulated), fails on a wrong quantize, on its fault and where the Triton kernels
fell back, and skips on a GPU without FP8 GEMMs. Under Triton's interpreter it compares the
Triton kernels themselves with torch's cast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from triton_interpreter import triton_test  # noqa: E402

from megatron_rocm.commands.smoke import smoke  # noqa: E402
from megatron_rocm.envtools.smoke.checks_fp8 import fp8 as fp8_check  # noqa: E402
from megatron_rocm.envtools.smoke.runner import FAULT_ENV, Context, Skip  # noqa: E402
from megatron_rocm.runtime.kernels import fp8, fp8_blockwise  # noqa: E402
from megatron_rocm.runtime.kernels.launch import interpreting  # noqa: E402

pytestmark = pytest.mark.torch
TRITON_SKIPS_ALLOWED = False  # under the interpreter the Triton case runs


@pytest.fixture(autouse=True)
def no_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULT_ENV, raising=False)
    monkeypatch.setattr(fp8_blockwise, "_failed", set())  # no GEMM path failed or checked yet
    monkeypatch.setattr(fp8_blockwise, "_checked", set())


def _run(tmp_path: Path) -> tuple[int, dict]:
    out = tmp_path / "r.json"
    code = smoke(".", str(out), None, only=["kernels.fp8"])
    return code, json.loads(out.read_text())["checks"][0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_passes_in_the_ocp_formats(tmp_path: Path) -> None:
    code, check = _run(tmp_path)
    assert code == 0 and check["status"] == "pass", check
    assert check["detail"].startswith("torch.float8_e4m3fn / torch.float8_e5m2: 84 tensors")
    gemms = "Triton" if interpreting() else "fp32 emulation"  # TRITON_INTERPRET=1 in-process
    assert check["detail"].endswith(f"block scaling's GEMMs on {gemms}"), check


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_passes_in_gfx942s_fnuz_formats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    monkeypatch.setattr(fp8, "gpu_arch", lambda: "gfx942")
    code, check = _run(tmp_path)
    assert code == 0 and check["status"] == "pass", check
    assert check["detail"].startswith("torch.float8_e4m3fnuz / torch.float8_e5m2fnuz")


def test_the_fault_fails_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "fp8")
    code, check = _run(tmp_path)
    assert code == 1 and check["status"] == "fail"
    assert "bytes differ from torch's cast" in check["detail"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch's path: the kernels skip _scale")
def test_a_quantize_a_step_off_fails_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose scale is slightly off: the check's reference is its own math."""
    real = fp8._scale
    monkeypatch.setattr(fp8, "_scale", lambda amax, *a, **k: real(amax, *a, **k) * 1.01)
    code, check = _run(tmp_path)
    assert code == 1 and "differ from torch's cast" in check["detail"], check


def test_a_fallback_to_torch_fails_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bytes would be right (torch's path), but the Triton kernels did not run."""
    real = fp8.quantize

    def failing(x, dtype, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        fp8._eager_keys.add((dtype, x.dtype))
        return real(x, dtype, *args, **kwargs)

    monkeypatch.setattr(fp8, "quantize", failing)
    monkeypatch.setattr(fp8, "_eager_keys", set())
    code, check = _run(tmp_path)
    assert code == 1 and "fell back to torch" in check["detail"], check


def test_a_kernel_that_failed_earlier_in_the_process_fails_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fp8, "_eager_keys", {(torch.float8_e4m3fn, torch.bfloat16)})
    code, check = _run(tmp_path)
    assert code == 1 and "fell back to torch" in check["detail"], check


def test_a_gpu_without_fp8_gemms_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8, "unsupported_gpu_reason", lambda: "gfx90a has no FP8 GEMMs")
    ctx = Context(tree=None, device="cuda", gpu_count=1)
    with pytest.raises(Skip, match="gfx90a has no FP8 GEMMs: --fp8-format is refused"):
        fp8_check(ctx)


@triton_test
def test_the_triton_kernels_pass_it(tmp_path: Path) -> None:
    """On a GPU, or on the CPU under Triton's interpreter: the kernels' own bytes."""
    code, check = _run(tmp_path)
    assert code == 0 and "(triton); weight gradients added into" in check["detail"], check
    gemms = (
        "Triton" if not torch.cuda.is_available() or torch.version.hip else "cuBLASLt and Triton"
    )
    assert check["detail"].endswith(f"block scaling's GEMMs on {gemms}"), check


def test_a_wrong_block_inverse_scale_fails_it(tmp_path: Path, monkeypatch) -> None:
    real = fp8_blockwise.quantize_rows

    def halved(x, dtype, transposed):  # noqa: ANN001, ANN202
        rows, turned = real(x, dtype, transposed)
        return fp8_blockwise.Blocks(rows.data, rows.inv / 2), turned

    monkeypatch.setattr(fp8_blockwise, "quantize_rows", halved)
    code, check = _run(tmp_path)
    assert code == 1 and check["detail"].startswith("blockwise rows"), check
    assert "inverse scales differ" in check["detail"]


def test_a_wrong_block_scaled_cast_fails_it(tmp_path: Path, monkeypatch) -> None:
    """The block casts are compared byte for byte: one flipped bit in the tiles fails the
    check and names them."""
    bw = fp8_blockwise
    real = bw.quantize_tiles

    def flipped(w, dtype, transposed):  # noqa: ANN001, ANN202
        tiles, turned = real(w, dtype, transposed)
        data = tiles.data.clone()
        data.view(torch.uint8).view(-1)[5] ^= 1
        return bw.Blocks(data, tiles.inv), turned

    monkeypatch.setattr(bw, "quantize_tiles", flipped)
    code, check = _run(tmp_path)
    assert code == 1 and check["detail"].startswith("blockwise tiles"), check


def test_a_weight_gradient_that_misses_main_grad_fails_it(tmp_path: Path, monkeypatch) -> None:
    """Under gradient-accumulation fusion the gradient must land in ``main_grad``: the CPU's
    separate add, dropped here, and the check names the main_grad comparison."""
    from megatron_rocm.runtime.backend import fp8 as backend_fp8

    original = backend_fp8.deliver_wgrad

    def dropped(fuse, weight, wgrad, like, main_grad=None):  # noqa: ANN001, ANN202
        return original(fuse, weight, None if fuse else wgrad, like, main_grad)

    monkeypatch.setattr(backend_fp8, "deliver_wgrad", dropped)
    code, check = _run(tmp_path)
    assert code != 0 and "main_grad" in check["detail"], check


def test_on_the_cpu_it_says_the_add_ran_separately(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "reference:fp8")
    code, check = _run(tmp_path)
    assert code == 0 and "added into main_grad separately;" in check["detail"], check
