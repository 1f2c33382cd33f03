"""SDPA core attention vs the local DotProductAttention math (layouts, masks, GQA, ROCm path)."""

from __future__ import annotations

import enum

import pytest

torch = pytest.importorskip("torch")

from megatron_rocm.runtime.kernels import attention  # noqa: E402
from megatron_rocm.runtime.kernels.attention import (  # noqa: E402
    attention_reference,
    sdpa_attention,
    sdpa_enabled,
    sdpa_supported,
)

TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


class AttnMaskType(enum.Enum):
    """Same names and values as megatron.core.transformer.enums.AttnMaskType."""

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5
    causal_bottom_right = 6


def _qkv(sq: int, sk: int, b: int, heads: int, groups: int, dim: int, dtype: torch.dtype):  # noqa: ANN202
    torch.manual_seed(0)
    q = torch.randn(sq, b, heads, dim).to(dtype)
    k = torch.randn(sk, b, groups, dim).to(dtype)
    v = torch.randn(sk, b, groups, dim).to(dtype)
    return q, k, v


def _padding_mask(b: int, sq: int, sk: int) -> torch.Tensor:
    """[b, 1, sq, sk], True = masked; batch 0 has a fully masked query row."""
    generator = torch.Generator().manual_seed(1)
    mask = torch.rand(b, 1, sq, sk, generator=generator) > 0.6
    mask[0, 0, min(2, sq - 1)] = True
    return mask


def _compare(mask_type, mask, dtype, shape, softmax_scale=None, window_size=None) -> None:  # noqa: ANN001
    sq, sk, b, heads, groups, dim = shape
    q, k, v = _qkv(sq, sk, b, heads, groups, dim, dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    refs = [x.clone().float().requires_grad_() for x in (q, k, v)]
    out = sdpa_attention(*leaves, mask, mask_type, softmax_scale, window_size=window_size)
    ref = attention_reference(*refs, mask, mask_type, softmax_scale, window_size=window_size)
    assert out.shape == (sq, b, heads * dim) and out.dtype == dtype and out.is_contiguous()
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    grad = torch.randn(out.shape)
    out.backward(grad.to(dtype))
    ref.backward(grad)
    for ours, theirs in zip(leaves, refs):
        torch.testing.assert_close(ours.grad.float(), theirs.grad, atol=tol * 4, rtol=tol * 4)


SHAPES = [(7, 7, 2, 4, 4, 8), (9, 9, 1, 6, 2, 16), (1, 1, 3, 2, 1, 4)]  # sq, sk, b, np, ng, hn


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("shape", SHAPES)
def test_causal(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    _compare(AttnMaskType.causal, None, dtype, shape)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask_type", [AttnMaskType.padding, AttnMaskType.arbitrary])
def test_padding_mask_with_fully_masked_row(
    dtype: torch.dtype, shape: tuple[int, ...], mask_type: AttnMaskType
) -> None:
    sq, sk, b = shape[:3]
    _compare(mask_type, _padding_mask(b, sq, sk), dtype, shape)


def test_causal_ignores_the_given_mask_like_the_fused_kernel() -> None:
    shape = (6, 6, 2, 2, 2, 8)
    _compare(AttnMaskType.causal, _padding_mask(2, 6, 6), torch.float32, shape)
    q, k, v = _qkv(*shape, torch.float32)
    with_mask = sdpa_attention(q, k, v, _padding_mask(2, 6, 6), AttnMaskType.causal)
    torch.testing.assert_close(with_mask, sdpa_attention(q, k, v, None, AttnMaskType.causal))


def test_cross_attention_lengths_and_scale() -> None:
    _compare(AttnMaskType.no_mask, None, torch.float32, (5, 11, 2, 4, 2, 8), softmax_scale=0.3)
    _compare(AttnMaskType.padding, _padding_mask(2, 5, 11), torch.float32, (5, 11, 2, 4, 4, 8))


def test_decode_step_attends_to_all_keys() -> None:
    _compare(AttnMaskType.causal, None, torch.float32, (1, 9, 2, 4, 2, 8))


def test_causal_without_mask_needs_square_scores() -> None:
    q, k, v = _qkv(4, 6, 1, 2, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="sq == sk"):
        sdpa_attention(q, k, v, None, AttnMaskType.causal)


@pytest.mark.parametrize("window", [(2, 0), (3, 1)])
def test_sliding_window(window: tuple[int, int]) -> None:
    _compare(AttnMaskType.causal, None, torch.float32, (8, 8, 1, 2, 2, 8), window_size=window)


def test_rocm_expands_kv_heads_instead_of_enable_gqa(
    simulate_rocm: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):  # noqa: ANN001, ANN202
        calls.append({"kv_heads": k.shape[1], **kwargs})
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    _compare(AttnMaskType.causal, None, torch.float32, (5, 5, 2, 6, 2, 8))
    assert calls[0]["kv_heads"] == 6 and "enable_gqa" not in calls[0]


def test_cuda_path_uses_enable_gqa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    calls: list[dict] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):  # noqa: ANN001, ANN202
        calls.append({"kv_heads": k.shape[1], **kwargs})
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    q, k, v = _qkv(5, 5, 1, 6, 2, 8, torch.float32)
    sdpa_attention(q, k, v, None, AttnMaskType.causal)
    assert calls[0]["kv_heads"] == 2 and calls[0]["enable_gqa"] is True
    assert calls[0]["is_causal"] is True and calls[0]["attn_mask"] is None


def test_dropout_is_applied() -> None:
    q, k, v = _qkv(6, 6, 1, 2, 2, 8, torch.float32)
    plain = sdpa_attention(q, k, v, None, AttnMaskType.causal)
    torch.manual_seed(3)
    dropped = sdpa_attention(q, k, v, None, AttnMaskType.causal, dropout_p=0.5)
    torch.manual_seed(3)
    again = sdpa_attention(q, k, v, None, AttnMaskType.causal, dropout_p=0.5)
    assert not torch.allclose(plain, dropped)
    torch.testing.assert_close(dropped, again)


@pytest.mark.parametrize(
    ("mask_type", "mask", "expected"),
    [
        (AttnMaskType.causal, None, True),
        (AttnMaskType.padding, torch.zeros(1, 1, 2, 2, dtype=torch.bool), True),
        (AttnMaskType.arbitrary, torch.zeros(1, 1, 2, 2, dtype=torch.bool), True),
        (AttnMaskType.no_mask, None, True),
        ("causal", None, True),
        (2, None, True),
        (AttnMaskType.padding_causal, None, False),
        (AttnMaskType.causal_bottom_right, None, False),
        (4, None, False),
        (AttnMaskType.padding, torch.zeros(1, 1, 2, 2), False),  # additive float mask
        (AttnMaskType.padding, torch.zeros(2, 2, dtype=torch.bool), False),
    ],
)
def test_sdpa_supported(mask_type: object, mask: torch.Tensor | None, expected: bool) -> None:
    assert sdpa_supported(mask_type, mask) is expected


def test_sdpa_supported_refuses_softmax_offset() -> None:
    assert not sdpa_supported(AttnMaskType.causal, None, softmax_type="off-by-one")


def test_unsupported_mask_raises() -> None:
    q, k, v = _qkv(2, 2, 1, 1, 1, 4, torch.float32)
    with pytest.raises(ValueError, match="padding_causal"):
        sdpa_attention(q, k, v, None, AttnMaskType.padding_causal)


@pytest.mark.parametrize(
    ("value", "expected"), [(None, True), ("1", True), ("0", False), ("off", False)]
)
def test_sdpa_enabled(value: str | None, expected: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if value is None:
        monkeypatch.delenv("MEGATRON_ROCM_LOCAL_SDPA", raising=False)
    else:
        monkeypatch.setenv("MEGATRON_ROCM_LOCAL_SDPA", value)
    assert sdpa_enabled() is expected


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [8, 2])
def test_gpu_parity(cuda_device: torch.device, groups: int) -> None:
    torch.manual_seed(0)
    q = torch.randn(512, 2, 8, 128, device=cuda_device, dtype=torch.bfloat16)
    k = torch.randn(512, 2, groups, 128, device=cuda_device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = sdpa_attention(q, k, v, None, AttnMaskType.causal)
    ref = attention_reference(q, k, v, None, AttnMaskType.causal)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
