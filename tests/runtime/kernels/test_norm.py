"""FusedNorm / build_norm: parity with unfused fp32 math and Megatron's parameter conventions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from megatron_rocm.runtime.kernels.norm import FusedNorm, build_norm, norm_reference  # noqa: E402

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
NORMS = ("LayerNorm", "RMSNorm")


def _config(**overrides: object) -> SimpleNamespace:
    """The attributes build_norm reads, with the defaults they have at core_v0.12 .. main."""
    fields = {
        "normalization": "LayerNorm",
        "layernorm_zero_centered_gamma": False,
        "sequence_parallel": False,
        "params_dtype": torch.float32,
        "use_cpu_initialization": True,
        "init_model_with_meta_device": False,
        "persist_layer_norm": True,
        "memory_efficient_layer_norm": False,
    }
    fields.update(overrides)
    return SimpleNamespace(**fields)


def _randomise(norm: FusedNorm) -> None:
    with torch.no_grad():
        for param in norm.parameters():
            param.copy_(torch.randn_like(param) * 0.5)


@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("shape", [(3, 7), (5, 2, 64), (1, 33)])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_forward_backward_parity(
    normalization: str, dtype: torch.dtype, shape: tuple[int, ...], zero_centered: bool
) -> None:
    torch.manual_seed(0)
    hidden = shape[-1]
    norm = FusedNorm(
        hidden,
        eps=1e-5,
        normalization=normalization,
        zero_centered_gamma=zero_centered,
        params_dtype=dtype,
    )
    _randomise(norm)
    x = (torch.randn(shape) * 3 + 1).to(dtype).requires_grad_()
    out = norm(x)
    assert out.dtype == dtype and out.shape == x.shape

    # Oracle: fp32 math on fp32 copies, gamma = 1 + weight when zero-centred.
    xr = x.detach().float().requires_grad_()
    wr = norm.weight.detach().float().requires_grad_()
    br = None if norm.bias is None else norm.bias.detach().float().requires_grad_()
    gamma = wr + 1 if zero_centered else wr
    ref = norm_reference(xr, gamma, br, 1e-5, normalization)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol * 4, rtol=tol)

    grad = torch.randn(shape)
    out.backward(grad.to(dtype))
    ref.backward(grad)
    torch.testing.assert_close(x.grad.float(), xr.grad, atol=tol * 8, rtol=tol * 4)
    # Param grads sum over all rows: compare relative to their scale.
    scale = wr.grad.abs().max().item() + 1
    torch.testing.assert_close(norm.weight.grad.float(), wr.grad, atol=tol * 4 * scale, rtol=tol)
    if br is not None:
        torch.testing.assert_close(norm.bias.grad.float(), br.grad, atol=tol * 4 * scale, rtol=tol)


def test_fp32_input_with_bf16_params_upcasts() -> None:
    """fp32 residual stream with bf16 params: computed in fp32, output fp32."""
    norm = FusedNorm(16, normalization="RMSNorm", params_dtype=torch.bfloat16)
    _randomise(norm)
    x = torch.randn(4, 16)
    expected = norm_reference(x, norm.weight.float(), None, norm.eps, "RMSNorm")
    torch.testing.assert_close(norm(x), expected)


def test_zero_centered_gamma_initialises_to_identity() -> None:
    norm = FusedNorm(8, zero_centered_gamma=True)
    assert torch.count_nonzero(norm.weight) == 0 and torch.count_nonzero(norm.bias) == 0
    x = torch.randn(2, 8)
    torch.testing.assert_close(norm(x), torch.nn.functional.layer_norm(x, (8,)))
    plain = FusedNorm(8)
    assert torch.all(plain.weight == 1)


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("normalization", NORMS)
def test_sequence_parallel_flag_on_every_param(sequence_parallel: bool, normalization: str) -> None:
    norm = FusedNorm(8, normalization=normalization, sequence_parallel=sequence_parallel)
    names = [name for name, _ in norm.named_parameters()]
    assert names == (["weight", "bias"] if normalization == "LayerNorm" else ["weight"])
    for param in norm.parameters():
        assert param.sequence_parallel is sequence_parallel


def test_rejects_unknown_normalization() -> None:
    with pytest.raises(ValueError, match="L2Norm"):
        FusedNorm(8, normalization="L2Norm")


def test_build_norm_reads_config() -> None:
    config = _config(
        normalization="RMSNorm",
        layernorm_zero_centered_gamma=True,
        sequence_parallel=True,
        params_dtype=torch.bfloat16,
    )
    norm = build_norm(config, 24, eps=1e-6)
    assert isinstance(norm, FusedNorm)
    assert (norm.normalization, norm.hidden_size, norm.eps) == ("RMSNorm", 24, 1e-6)
    assert norm.zero_centered_gamma and norm.weight.sequence_parallel
    assert norm.weight.dtype == torch.bfloat16 and norm.weight.device.type == "cpu"
    assert norm.returns_residual is False


def test_build_norm_accepts_wrapped_torch_norm_arguments() -> None:
    """A patch returns build_norm(...) from WrappedTorchNorm.__new__ with all its arguments;
    the flags WrappedTorchNorm asserts off (persist, memory-efficient) are accepted."""
    config = _config(persist_layer_norm=True, memory_efficient_layer_norm=True)
    norm = build_norm(
        config, 8, 1e-5, persist_layer_norm=True, zero_centered_gamma=True, normalization="RMSNorm"
    )
    # Like upstream, the config decides, not the unused arguments.
    assert norm.normalization == "LayerNorm" and not norm.zero_centered_gamma


def test_build_norm_meta_device() -> None:
    config = _config(use_cpu_initialization=False, init_model_with_meta_device=True)
    norm = build_norm(config, 8)
    assert norm.weight.device.type == "meta"


def test_state_dict_matches_torch_layernorm() -> None:
    ours = FusedNorm(8)
    theirs = torch.nn.LayerNorm(8)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    theirs.load_state_dict(ours.state_dict())


@pytest.mark.gpu
@pytest.mark.parametrize("normalization", NORMS)
def test_gpu_parity(cuda_device: torch.device, normalization: str) -> None:
    torch.manual_seed(0)
    norm = FusedNorm(
        4096, normalization=normalization, params_dtype=torch.bfloat16, device=cuda_device
    )
    _randomise(norm)
    x = torch.randn(512, 4096, device=cuda_device, dtype=torch.bfloat16)
    ref = norm_reference(x, norm.weight, norm.bias, norm.eps, normalization)
    torch.testing.assert_close(norm(x), ref, atol=5e-2, rtol=2e-2)
