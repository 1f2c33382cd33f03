"""RoPE drop-ins vs the Megatron-style reference (forward, backward, partial, interleaved, thd)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from megatron_rocm.runtime.kernels.rope import (  # noqa: E402
    fused_apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb_thd,
    rope_reference,
    rope_thd_reference,
)

TOLERANCES = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}


def _freqs(positions: int, rot_dim: int, batch: int = 1) -> torch.Tensor:
    """Megatron's angle table ``pos * theta^(-2i/rot)`` duplicated to ``rot_dim``, fp32."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    table = torch.cat((angles, angles), dim=-1)
    return table[:, None, None, :].expand(positions, batch, 1, rot_dim).contiguous()


def _grads(fn, t: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    leaf = t.detach().clone().requires_grad_()
    out = fn(leaf)
    out.backward(grad)
    return out.detach(), leaf.grad


def test_quarter_turn_by_hand() -> None:
    """Independent of the reference: angle pi/2 maps (a, b) to (-b, a) in both layouts."""
    t = torch.tensor([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
    freqs = torch.full((1, 1, 1, 4), math.pi / 2)
    halves = fused_apply_rotary_pos_emb(t, freqs)
    pairs = fused_apply_rotary_pos_emb(t, freqs, interleaved=True)
    torch.testing.assert_close(halves.flatten(), torch.tensor([-3.0, -4.0, 1.0, 2.0]))
    torch.testing.assert_close(pairs.flatten(), torch.tensor([-2.0, 1.0, -4.0, 3.0]))


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    ("shape", "rot_dim", "freq_batch"),
    [((7, 2, 3, 16), 16, 1), ((5, 3, 2, 24), 8, 1), ((9, 2, 1, 10), 6, 2), ((1, 1, 1, 2), 2, 1)],
)
def test_sbhd_parity(
    dtype: torch.dtype,
    interleaved: bool,
    shape: tuple[int, ...],
    rot_dim: int,
    freq_batch: int,
) -> None:
    torch.manual_seed(0)
    t = torch.randn(shape).to(dtype)
    freqs = _freqs(shape[0], rot_dim, freq_batch)
    grad = torch.randn(shape).to(dtype)
    out, dt = _grads(
        lambda x: fused_apply_rotary_pos_emb(x, freqs, interleaved=interleaved), t, grad
    )
    ref, dref = _grads(lambda x: rope_reference(x, freqs, interleaved), t, grad)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(dt, dref, atol=tol, rtol=tol)
    # Channels past rot_dim pass through untouched, forward and backward.
    torch.testing.assert_close(out[..., rot_dim:], t[..., rot_dim:], atol=0, rtol=0)
    torch.testing.assert_close(dt[..., rot_dim:], grad[..., rot_dim:], atol=0, rtol=0)


def test_longer_freqs_are_cut_and_3d_input() -> None:
    t = torch.randn(4, 2, 8)  # [s, b, d] with freqs [s, 1, 1, d]
    freqs = _freqs(10, 8)
    out = fused_apply_rotary_pos_emb(t, freqs, transpose_output_memory=True)
    torch.testing.assert_close(out, rope_reference(t, freqs[:4]))


def test_learned_angles_get_gradients() -> None:
    t = torch.randn(3, 1, 2, 4)
    freqs = _freqs(3, 4).requires_grad_()
    fused_apply_rotary_pos_emb(t, freqs).sum().backward()
    assert freqs.grad is not None and torch.count_nonzero(freqs.grad) > 0


@pytest.mark.parametrize(
    ("rot_dim", "head_dim"), [(5, 8), (10, 8)], ids=["odd-rotary-dim", "rotary-wider-than-head"]
)
def test_rejects_bad_rotary_dim(rot_dim: int, head_dim: int) -> None:
    with pytest.raises(ValueError, match="rotary dim"):
        fused_apply_rotary_pos_emb(torch.randn(2, 1, 1, head_dim), torch.zeros(2, 1, 1, rot_dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("cp_size", "cp_rank"), [(1, 0), (2, 0), (2, 1), (4, 2)])
def test_thd_parity(dtype: torch.dtype, interleaved: bool, cp_size: int, cp_rank: int) -> None:
    torch.manual_seed(0)
    cu_seqlens = torch.tensor([0, 8, 24, 32, 48], dtype=torch.int32)  # global lengths
    tokens = 48 // cp_size
    t = torch.randn(tokens, 3, 12).to(dtype)
    freqs = _freqs(16, 8)
    grad = torch.randn(tokens, 3, 12).to(dtype)

    def ours(x: torch.Tensor) -> torch.Tensor:
        return fused_apply_rotary_pos_emb_thd(
            x, cu_seqlens, freqs, cp_size=cp_size, cp_rank=cp_rank, interleaved=interleaved
        )

    def reference(x: torch.Tensor) -> torch.Tensor:
        return rope_thd_reference(x, cu_seqlens, freqs, cp_size, cp_rank, interleaved)

    out, dt = _grads(ours, t, grad)
    ref, dref = _grads(reference, t, grad)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(dt, dref, atol=tol, rtol=tol)


def test_thd_restarts_positions_per_sequence() -> None:
    """Every packed sequence starts at angle 0: its first token is unchanged."""
    cu_seqlens = torch.tensor([0, 3, 7, 8], dtype=torch.int32)
    t = torch.randn(8, 2, 4)
    out = fused_apply_rotary_pos_emb_thd(t, cu_seqlens, _freqs(8, 4))
    for start in (0, 3, 7):
        torch.testing.assert_close(out[start], t[start])
    assert not torch.allclose(out[1], t[1])


def test_thd_padding_tokens_past_cu_seqlens() -> None:
    cu_seqlens = torch.tensor([0, 3, 5], dtype=torch.int32)
    t = torch.randn(7, 1, 4)  # two padding tokens at the end
    out = fused_apply_rotary_pos_emb_thd(t, cu_seqlens, _freqs(4, 4))
    torch.testing.assert_close(out[:5], rope_thd_reference(t[:5], cu_seqlens, _freqs(4, 4)))
    assert torch.isfinite(out).all()


def test_thd_rejects_bad_cp_rank() -> None:
    with pytest.raises(ValueError, match="context parallel"):
        fused_apply_rotary_pos_emb_thd(
            torch.randn(4, 1, 4), torch.tensor([0, 4]), _freqs(4, 4), cp_size=2, cp_rank=2
        )


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_gpu_parity(cuda_device: torch.device, interleaved: bool) -> None:
    t = torch.randn(1024, 2, 16, 128, device=cuda_device, dtype=torch.bfloat16)
    freqs = _freqs(1024, 64).to(cuda_device)
    grad = torch.randn_like(t)
    out, dt = _grads(
        lambda x: fused_apply_rotary_pos_emb(x, freqs, interleaved=interleaved), t, grad
    )
    ref, dref = _grads(lambda x: rope_reference(x, freqs, interleaved), t, grad)
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(dt, dref, atol=1e-2, rtol=1e-2)
