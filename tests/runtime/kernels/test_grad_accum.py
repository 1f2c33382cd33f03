"""wgrad_gemm_accum_fp32/fp16: in-place ``main_grad += grad_output^T @ total_input``."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from megatron_rocm.runtime.kernels import grad_accum  # noqa: E402
from megatron_rocm.runtime.kernels.grad_accum import (  # noqa: E402
    wgrad_gemm_accum_fp16,
    wgrad_gemm_accum_fp32,
    wgrad_reference,
)

# Relative to the magnitude of the product (sqrt(tokens) for unit-normal inputs).
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
SHAPES = [((13, 7), (13, 5)), ((4, 3, 9), (4, 3, 6)), ((1, 1), (1, 1)), ((64, 33), (64, 17))]


def _inputs(
    in_shape: tuple[int, ...], out_shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(in_shape).to(dtype), torch.randn(out_shape).to(dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize(("in_shape", "out_shape"), SHAPES)
def test_fp32_main_grad_accumulates_in_place(
    dtype: torch.dtype, in_shape: tuple[int, ...], out_shape: tuple[int, ...]
) -> None:
    total_input, grad_output = _inputs(in_shape, out_shape, dtype)
    main_grad = torch.randn(out_shape[-1], in_shape[-1])
    storage = main_grad.data_ptr()
    expected = wgrad_reference(total_input, grad_output, main_grad)
    wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)  # accumulates, not overwrites
    expected = wgrad_reference(total_input, grad_output, expected)
    assert main_grad.dtype == torch.float32 and main_grad.data_ptr() == storage
    scale = max(1.0, in_shape[0] ** 0.5)
    torch.testing.assert_close(main_grad, expected, atol=TOLERANCES[dtype] * scale, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("in_shape", "out_shape"), SHAPES)
def test_half_main_grad(
    dtype: torch.dtype, in_shape: tuple[int, ...], out_shape: tuple[int, ...]
) -> None:
    total_input, grad_output = _inputs(in_shape, out_shape, dtype)
    main_grad = torch.randn(out_shape[-1], in_shape[-1]).to(dtype)
    expected = wgrad_reference(total_input, grad_output, main_grad)
    wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    assert main_grad.dtype == dtype
    scale = max(1.0, in_shape[0] ** 0.5)
    tol = TOLERANCES[dtype] * scale
    torch.testing.assert_close(main_grad, expected, atol=tol, rtol=TOLERANCES[dtype])


@pytest.mark.parametrize(
    ("fn", "main_dtype", "message"),
    [
        (wgrad_gemm_accum_fp32, torch.bfloat16, "fp32 main_grad"),
        (wgrad_gemm_accum_fp16, torch.float32, "must match"),
    ],
)
def test_rejects_wrong_main_grad_dtype(fn, main_dtype: torch.dtype, message: str) -> None:  # noqa: ANN001
    total_input, grad_output = _inputs((4, 3), (4, 2), torch.bfloat16)
    with pytest.raises(TypeError, match=message):
        fn(total_input, grad_output, torch.zeros(2, 3, dtype=main_dtype))


def test_rejects_wrong_shape() -> None:
    total_input, grad_output = _inputs((4, 3), (4, 2), torch.float32)
    with pytest.raises(ValueError, match="shape"):
        wgrad_gemm_accum_fp32(total_input, grad_output, torch.zeros(3, 2))


def test_falls_back_when_out_dtype_gemm_is_missing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Pretend the GPU overloads exist: on CPU both out_dtype calls fail for real, the probe
    walks down to the upcast, logs why, and remembers the choice."""
    monkeypatch.setattr(grad_accum, "_gpu_gemm_overloads", lambda x: True)
    monkeypatch.setattr(grad_accum, "_chosen", {})
    monkeypatch.setattr("megatron_rocm.runtime.kernels.launch._logged", set())
    total_input, grad_output = _inputs((8, 4), (8, 3), torch.bfloat16)
    main_grad = torch.zeros(3, 4)
    expected = wgrad_reference(total_input, grad_output, main_grad)
    with caplog.at_level(logging.WARNING, logger="megatron_rocm.runtime.kernels"):
        wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    torch.testing.assert_close(main_grad, expected, atol=1e-2, rtol=1e-2)
    assert grad_accum.chosen_strategy("cpu", torch.bfloat16) == "upcast operands to fp32"
    assert sum("wgrad accumulation" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_uses_out_dtype_gemm(cuda_device: torch.device, dtype: torch.dtype) -> None:
    total_input = torch.randn(4096, 1024, device=cuda_device, dtype=dtype)
    grad_output = torch.randn(4096, 512, device=cuda_device, dtype=dtype)
    main_grad = torch.randn(512, 1024, device=cuda_device)
    expected = wgrad_reference(total_input, grad_output, main_grad)
    wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    torch.testing.assert_close(main_grad, expected, atol=0.5, rtol=1e-2)
    assert grad_accum.chosen_strategy("cuda", dtype) != "upcast operands to fp32"


def _fsdp_param(shape: tuple[int, int], overwrite: bool) -> tuple[torch.nn.Parameter, torch.Tensor]:
    """A parameter as Megatron-FSDP leaves it: ``__fsdp_param__``, ``get_main_grad()`` handing
    out a buffer that still holds an earlier micro-batch's sum, ``overwrite_main_grad``."""
    weight = torch.nn.Parameter(torch.zeros(shape))
    buffer = torch.full(shape, 7.0)
    weight.__fsdp_param__ = True
    weight.overwrite_main_grad = overwrite
    weight.get_main_grad = lambda: buffer
    return weight, buffer


@pytest.mark.parametrize("overwrite", [True, False])
def test_megatron_fsdp_main_grad_is_fetched_and_overwritten_when_sharded(overwrite: bool) -> None:
    total_input, grad_output = _inputs((6, 4), (6, 3), torch.float32)
    weight, buffer = _fsdp_param((3, 4), overwrite)
    target = grad_accum.main_grad_for_wgrad(weight)
    assert target is buffer and weight.main_grad is buffer
    wgrad_gemm_accum_fp32(total_input, grad_output, target)
    start = torch.zeros(3, 4) if overwrite else torch.full((3, 4), 7.0)
    torch.testing.assert_close(buffer, wgrad_reference(total_input, grad_output, start))


def test_ddp_main_grad_is_used_as_is() -> None:
    weight = torch.nn.Parameter(torch.zeros(3, 4))
    weight.main_grad = torch.ones(3, 4)
    assert grad_accum.main_grad_for_wgrad(weight) is weight.main_grad
    assert torch.equal(weight.main_grad, torch.ones(3, 4))


def test_missing_main_grad_says_how_to_build_the_model() -> None:
    with pytest.raises(RuntimeError, match="gradient_accumulation_fusion=False"):
        grad_accum.main_grad_for_wgrad(torch.nn.Parameter(torch.zeros(2, 2)))
