"""The native ``Fp8Padding`` / ``Fp8Unpadding`` (TE's API, upstream's MoE experts call them)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from megatron_rocm.runtime.backend.fp8_padding import Fp8Padding, Fp8Unpadding  # noqa: E402

pytestmark = pytest.mark.torch


def test_each_segment_is_zero_padded_to_16_and_unpadded_back() -> None:
    x = torch.randn(21, 8, requires_grad=True)
    padded, splits = Fp8Padding(4)(x, [5, 0, 16, 0])
    assert splits == [16, 0, 16, 0] and padded.shape == (32, 8)
    assert torch.equal(padded[:5], x[:5]) and not padded[5:16].any()
    assert torch.equal(padded[16:], x[5:])
    back = Fp8Unpadding(4)(padded, [5, 0, 16, 0])
    assert torch.equal(back, x)
    weights = torch.randn(32, 8)
    (padded * weights).sum().backward()  # the padding rows' gradient goes nowhere
    assert torch.equal(x.grad, torch.cat([weights[:5], weights[16:]]))


def test_aligned_segments_pass_through_and_align_size_is_honoured() -> None:
    x = torch.randn(48, 2)
    same, splits = Fp8Padding(2)(x, [16, 32])
    assert same is x and splits == [16, 32]
    padded, splits = Fp8Padding(2, align_size=32)(x, [16, 32])
    assert splits == [32, 32] and padded.shape == (64, 2)
    assert torch.equal(Fp8Unpadding(2, align_size=32)(padded, [16, 32]), x)


def test_a_wrong_number_of_splits_is_one_line() -> None:
    with pytest.raises(ValueError, match="3 splits for 4 experts"):
        Fp8Padding(4)(torch.zeros(3, 2), [1, 1, 1])
