"""TE's mask semantics on SDPA (``backend.sdpa``) against the unfused fp32 oracle."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from megatron_rocm.runtime.backend.sdpa import (  # noqa: E402
    BACKENDS_ENV,
    attention_reference_te,
    sdpa_sbhd,
)

pytestmark = pytest.mark.torch
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2), torch.float16: (3e-3, 3e-3)}


def qkv(sq, sk, b, heads, groups, dim, dtype, seed=0, dim_v=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, heads, dim, generator=g).to(dtype).requires_grad_()
    k = torch.randn(sk, b, groups, dim, generator=g).to(dtype).requires_grad_()
    v = torch.randn(sk, b, groups, dim_v or dim, generator=g).to(dtype).requires_grad_()
    return q, k, v


def check(kwargs, shape=(13, 13, 2, 4, 2, 16), dtype=torch.float32, dim_v=None):
    sq, sk, b, heads, groups, dim = shape
    q, k, v = qkv(sq, sk, b, heads, groups, dim, dtype, dim_v=dim_v)
    out = sdpa_sbhd(q, k, v, **kwargs)
    ref = attention_reference_te(q.detach(), k.detach(), v.detach(), **kwargs)
    atol, rtol = TOL[dtype]
    assert out.shape == (sq, b, heads * (dim_v or dim))
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    # backward: against autograd through the oracle
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref32 = attention_reference_te(qr, kr, vr, **kwargs)
    rq, rk, rv = torch.autograd.grad(ref32.float(), (qr, kr, vr), grad.float())
    for got, want in ((dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(got.float(), want, atol=atol * 10, rtol=rtol * 10)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_type", ["causal", "no_mask", "causal_bottom_right"])
def test_mask_types_without_a_mask(mask_type, dtype):
    check({"mask_type": mask_type}, dtype=dtype)


@pytest.mark.parametrize("shape", [(7, 11, 3, 6, 3, 8), (11, 7, 1, 4, 4, 24), (1, 9, 2, 2, 1, 8)])
def test_unequal_lengths_and_gqa(shape):
    for mask_type in ("causal", "causal_bottom_right", "no_mask"):
        check({"mask_type": mask_type}, shape=shape)


def test_causal_ignores_the_mask_it_is_given():
    """TE's causal type ignores attention_mask (Megatron's loader still passes one)."""
    mask = torch.ones(2, 1, 1, 13, dtype=torch.bool)  # everything masked
    q, k, v = qkv(13, 13, 2, 4, 2, 16, torch.float32)
    with_mask = sdpa_sbhd(q, k, v, mask_type="causal", attention_mask=mask)
    without = sdpa_sbhd(q, k, v, mask_type="causal")
    assert torch.equal(with_mask, without)


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "arbitrary"])
def test_masks_are_applied(mask_type):
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(2, 1, 13, 13, generator=g) < 0.3
    mask[:, :, :, 0] = False  # every row keeps one key
    out = check({"mask_type": mask_type, "attention_mask": mask})
    unmasked = sdpa_sbhd(*qkv(13, 13, 2, 4, 2, 16, torch.float32), mask_type="no_mask")
    assert not torch.allclose(out, unmasked)


def test_padding_mask_of_keys_only():
    mask = torch.zeros(2, 1, 1, 13, dtype=torch.bool)
    mask[1, ..., 9:] = True
    check({"mask_type": "padding", "attention_mask": mask})


def test_fully_masked_rows_are_zero_not_nan():
    mask = torch.zeros(2, 1, 13, 13, dtype=torch.bool)
    mask[0, 0, 4] = True  # query 4 of sample 0 sees nothing
    out = check({"mask_type": "padding", "attention_mask": mask})
    assert torch.isfinite(out).all()
    assert out[4, 0].abs().max() == 0


@pytest.mark.parametrize("window", [(3, 0), (2, 2), (0, 0)])
@pytest.mark.parametrize("mask_type", ["causal", "no_mask"])
def test_sliding_window(window, mask_type):
    check({"mask_type": mask_type, "window_size": window})


def test_attention_bias_with_causal_mask():
    bias = torch.randn(1, 4, 13, 13, generator=torch.Generator().manual_seed(5))
    check({"mask_type": "causal", "attention_bias": bias})
    check({"mask_type": "no_mask", "attention_bias": bias})


def test_softmax_scale_and_value_head_dim():
    check({"mask_type": "causal", "softmax_scale": 0.3}, dim_v=24)


def test_unknown_mask_type_is_refused():
    with pytest.raises(ValueError, match="unsupported attention mask type"):
        sdpa_sbhd(*qkv(4, 4, 1, 2, 2, 8, torch.float32), mask_type="sparse")


def test_backend_priority_env(monkeypatch):
    monkeypatch.setenv(BACKENDS_ENV, "math")
    check({"mask_type": "causal"})
    monkeypatch.setenv(BACKENDS_ENV, "warp-speed")
    with pytest.raises(ValueError, match="MEGATRON_ROCM_SDPA_BACKENDS='warp-speed'"):
        sdpa_sbhd(*qkv(4, 4, 1, 2, 2, 8, torch.float32), mask_type="causal")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_parity(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA/ROCm GPU")
    sq, b, heads, groups, dim = 512, 2, 8, 2, 128
    q, k, v = (
        x.cuda().detach().requires_grad_() for x in qkv(sq, sq, b, heads, groups, dim, dtype)
    )
    out = sdpa_sbhd(q, k, v, mask_type="causal")
    ref = attention_reference_te(q, k, v, mask_type="causal")
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
