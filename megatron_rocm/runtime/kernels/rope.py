"""Rotary position embedding with TE's ``fused_apply_rotary_pos_emb*`` signatures.

Upstream refuses ``--apply-rope-fusion`` without TransformerEngine (a ValueError in
``transformer_config.py``); these drop-ins compute the same rotation as Megatron's unfused
``_apply_rotary_pos_emb_bshd``. The autograd is written by hand: backward is one inverse
rotation of the incoming gradient (``R^T = -R``) from the saved ``cos``/``sin`` tables,
instead of autograd replaying each slice, cat and product of the unfused graph.

Layouts: ``t`` is ``[s, b, h, d]`` (sbhd) or ``[total_tokens, h, d]`` (thd); ``freqs`` is
``[s, 1|b, 1, rot_dim]`` (any float dtype; angles in radians). Channels past ``rot_dim``
pass through unchanged (partial rotary). ``interleaved`` rotates pairs ``(2i, 2i+1)``
instead of halves.

Dispatch (the project's policy, as :mod:`~megatron_rocm.runtime.kernels.softmax`): on a GPU
(CUDA or ROCm) a Triton kernel (:mod:`~megatron_rocm.runtime.kernels.rope_triton`) reads
``t`` once and writes the output once, computing ``cos``/``sin`` from the angles itself, in
the forward and in the backward; elsewhere the torch path below. Other dtypes or layouts fall
back to the torch path with the reason logged once; ``MEGATRON_ROCM_KERNELS=reference`` forces
it; learned angles (``freqs.requires_grad``) keep plain autograd. Both paths round as
Megatron's unfused code does (``cos``/``sin`` cast to ``t``'s dtype, then each product and the
sum rounded to it), so they agree bit for bit up to the last bit of ``cos``/``sin``; TE's
fused kernel instead rounds once from fp32 (see docs/kernels.md for the error bound).
The output is always a new contiguous tensor, like TE's (Megatron views it afterwards).
"""

from __future__ import annotations

import torch

from megatron_rocm.runtime.kernels.launch import log_fallback_once, use_triton

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``R x`` with ``R`` the 90-degree rotation of each pair; note ``R^T == -R``."""
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotate(
    t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, sign: float
) -> torch.Tensor:
    """``t*cos + sign * R(t*sin)`` on the first ``rot_dim`` channels, the rest unchanged.

    ``sign=+1`` is the forward rotation written as ``t*cos + R(t)*sin`` (the diagonal ``sin``
    commutes with ``R`` because both halves of a pair share one angle); ``sign=-1`` applies
    ``R^T``, the gradient of the forward.
    """
    rot_dim = cos.shape[-1]
    head = t[..., :rot_dim]
    if sign > 0:
        out = head * cos + _rotate_half(head, interleaved) * sin
    else:
        out = head * cos - _rotate_half(head * sin, interleaved)
    if rot_dim == t.shape[-1]:
        return out
    return torch.cat((out, t[..., rot_dim:]), dim=-1)


class _RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin, interleaved):  # noqa: ANN001, ANN205 - autograd signature
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _rotate(t, cos, sin, interleaved, sign=1.0)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205 - autograd signature
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, ctx.interleaved, sign=-1.0), None, None, None


class _TritonRotaryFunction(torch.autograd.Function):
    """One Triton pass forward and one backward (the inverse rotation of the gradient)."""

    @staticmethod
    def forward(ctx, t, angles, pos, interleaved):  # noqa: ANN001, ANN205 - autograd signature
        ctx.save_for_backward(angles, pos)
        ctx.interleaved = interleaved
        return _run_triton(t, angles, pos, interleaved, inverse=False)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205 - autograd signature
        angles, pos = ctx.saved_tensors
        dt = _run_triton(grad, angles, pos, ctx.interleaved, inverse=True)
        return dt, None, None, None


def _run_triton(
    x: torch.Tensor,
    angles: torch.Tensor,
    pos: torch.Tensor | None,
    interleaved: bool,
    inverse: bool,
) -> torch.Tensor:
    """``x`` as the kernel's ``[R1, R2, H, D]``: sbhd as is (``[s, b, d]`` gets ``h = 1``),
    thd ``[T, h, d]`` as ``[T, 1, h, d]``. Only the head dim must be contiguous."""
    from megatron_rocm.runtime.kernels import rope_triton as _rope_triton

    if x.stride(-1) != 1:
        x = x.contiguous()  # e.g. an expanded gradient; Megatron's q/k have unit stride here
    x4 = x.unsqueeze(1) if pos is not None else x if x.dim() == 4 else x.unsqueeze(2)
    return _rope_triton.rotate(x4, angles, pos, interleaved, inverse).view(x.shape)


def _triton_problem(t: torch.Tensor, freqs: torch.Tensor) -> str | None:
    """Why the Triton kernel cannot take ``t``/``freqs`` (to log), or None if it can."""
    if t.dtype not in SUPPORTED_DTYPES or freqs.dtype not in SUPPORTED_DTYPES:
        return f"no Triton kernel for t {t.dtype} with freqs {freqs.dtype}"
    if freqs.size(-1) == 0:
        return "rotary dim 0"
    return None


def _triton(t: torch.Tensor, freqs: torch.Tensor, layout_problem: str | None) -> bool:
    """Whether this call goes through Triton; an automatic fallback is logged once."""
    if freqs.requires_grad or not use_triton(t, freqs, kernel="rope"):
        return False
    problem = layout_problem or _triton_problem(t, freqs)
    if problem:
        log_fallback_once(f"rope:{problem}", f"rope: {problem}; using the torch path")
        return False
    return True


def _sbhd_angles(t: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
    """``freqs`` (cut and squeezed to ``t``'s rank) as the kernel's ``[s, 1|b, rot]`` table."""
    if t.dim() not in (3, 4) or freqs.dim() != t.dim():
        return None, f"layout t{tuple(t.shape)} with freqs{tuple(freqs.shape)}"
    if freqs.size(1) not in (1, t.size(1)) or (t.dim() == 4 and freqs.size(2) != 1):
        return None, f"freqs{tuple(freqs.shape)} are not [s, 1|b, 1, rot]"
    angles = freqs[:, :, 0] if t.dim() == 4 else freqs
    return (angles if angles.stride(-1) == 1 else angles.contiguous()), None


def _check(t: torch.Tensor, freqs: torch.Tensor) -> int:
    rot_dim = freqs.shape[-1]
    if rot_dim % 2 or rot_dim > t.shape[-1]:
        raise ValueError(
            f"rotary dim {rot_dim} must be even and at most the head dim {t.shape[-1]}"
        )
    return rot_dim


def _tables(t: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` of the angles, rounded as Megatron's unfused path: cast to t's dtype."""
    return torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)


def _apply(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate ``t`` by angles ``freqs`` already aligned (broadcastable) to ``t[..., :rot]``."""
    cos, sin = _tables(t, freqs)
    if freqs.requires_grad:  # learned angles: let autograd differentiate the plain math
        return _rotate(t, cos, sin, interleaved, sign=1.0)
    return _RotaryFunction.apply(t, cos, sin, interleaved)


def _sbhd_inputs(
    t: torch.Tensor, freqs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, str | None]:
    """``freqs`` checked and cut to ``t``'s positions, with the Triton kernel's angle table
    (``_sbhd_angles``) or why the kernel cannot take this layout."""
    _check(t, freqs)
    if freqs.dim() == t.dim() + 1 and freqs.size(-2) == 1:
        freqs = freqs.squeeze(-2)  # [s, 1, 1, d] for a 3-D t
    if freqs.size(0) < t.size(0):
        raise ValueError(f"freqs cover {freqs.size(0)} positions, t has {t.size(0)}")
    freqs = freqs[: t.size(0)]
    angles, problem = _sbhd_angles(t, freqs)
    return freqs, angles, problem


def fused_apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    transpose_output_memory: bool = False,
    interleaved: bool = False,
) -> torch.Tensor:
    """RoPE on ``t`` in sbhd layout; ``transpose_output_memory`` is a layout hint, ignored
    (TE ignores it too)."""
    freqs, angles, problem = _sbhd_inputs(t, freqs)
    if _triton(t, freqs, problem):
        return _TritonRotaryFunction.apply(t, angles, None, interleaved)
    return _apply(t, freqs, interleaved)


def rotate_sbhd(
    t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False, inverse: bool = False
) -> torch.Tensor:
    """The rotation of ``fused_apply_rotary_pos_emb`` (or, ``inverse``, its transpose: the
    gradient) without autograd, for callers that write their own backward
    (``backend.cp.a2a_qkv``). ``t`` is ``[s, b, h, d]`` with any strides but a contiguous head
    dim (e.g. a slice of the fused QKV projection); the result is a new contiguous tensor."""
    freqs, angles, problem = _sbhd_inputs(t, freqs)
    if _triton(t, freqs, problem):
        return _run_triton(t, angles, None, interleaved, inverse)
    cos, sin = _tables(t, freqs)
    return _rotate(t, cos, sin, interleaved, sign=-1.0 if inverse else 1.0).contiguous()


def _thd_positions(
    cu_seqlens: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int, device: torch.device
) -> torch.Tensor:
    """Per-token rotary position for packed sequences, computed on device (no host sync).

    ``cu_seqlens`` are the global (all CP ranks) cumulative lengths; this rank holds
    ``len / cp_size`` tokens of each sequence: chunk ``cp_rank`` and chunk
    ``2*cp_size - 1 - cp_rank`` of its ``2*cp_size`` load-balancing chunks.
    """
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    local_lens = (cu[1:] - cu[:-1]) // cp_size
    local_cu = torch.zeros_like(cu)
    local_cu[1:] = torch.cumsum(local_lens, 0)
    token = torch.arange(total_tokens, device=device, dtype=torch.int64)
    seq = (torch.searchsorted(local_cu, token, right=True) - 1).clamp(0, cu.numel() - 2)
    pos = token - local_cu[seq]
    if cp_size > 1:
        chunk = local_lens[seq] // 2
        full = local_lens[seq] * cp_size
        second = full - (cp_rank + 1) * chunk + (pos - chunk)
        pos = torch.where(pos < chunk, cp_rank * chunk + pos, second)
    return pos


def fused_apply_rotary_pos_emb_thd(
    t: torch.Tensor,
    cu_seqlens: torch.Tensor,
    freqs: torch.Tensor,
    cp_size: int = 1,
    cp_rank: int = 0,
    interleaved: bool = False,
) -> torch.Tensor:
    """RoPE on packed sequences ``t[total_tokens, h, d]``; each sequence restarts at position 0.

    Tokens past ``cu_seqlens[-1]`` (padding) get a clamped, harmless position.
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"invalid context parallel rank {cp_rank} of {cp_size}")
    _check(t, freqs)
    pos = _thd_positions(cu_seqlens, t.size(0), cp_size, cp_rank, t.device)
    if freqs[0].numel() != freqs.size(-1):
        raise ValueError(f"thd freqs must be [max_s, 1, 1, rot_dim], got {tuple(freqs.shape)}")
    pos = pos.clamp(0, freqs.size(0) - 1)
    table = freqs.reshape(freqs.size(0), freqs.size(-1))  # [max_s, rot_dim]
    problem = None if t.dim() == 3 else f"thd t must be [tokens, h, d], got {tuple(t.shape)}"
    if _triton(t, freqs, problem):
        angles = table.unsqueeze(1) if table.stride(-1) == 1 else table.contiguous().unsqueeze(1)
        return _TritonRotaryFunction.apply(t, angles, pos, interleaved)
    return _apply(t, table[pos].unsqueeze(1), interleaved)  # angles [T, 1, rot_dim]


# --- reference math (parity oracle; mirrors Megatron's unfused implementation) -------------


def rope_reference(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Megatron's ``_apply_rotary_pos_emb_bshd`` (mscale 1, no MLA): plain differentiable ops."""
    if freqs.dim() == t.dim() + 1 and freqs.size(-2) == 1:
        freqs = freqs.squeeze(-2)
    rot_dim = freqs.shape[-1]
    rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
    cos = torch.cos(freqs).to(t.dtype)
    sin = torch.sin(freqs).to(t.dtype)
    if interleaved:
        pairs = torch.stack((-rotated[..., 1::2], rotated[..., 0::2]), dim=-1)
        swapped = pairs.reshape(rotated.shape)
    else:
        half = rotated.shape[-1] // 2
        swapped = torch.cat((-rotated[..., half:], rotated[..., :half]), dim=-1)
    return torch.cat((rotated * cos + swapped * sin, passed), dim=-1)


def rope_thd_reference(
    t: torch.Tensor,
    cu_seqlens: torch.Tensor,
    freqs: torch.Tensor,
    cp_size: int = 1,
    cp_rank: int = 0,
    interleaved: bool = False,
) -> torch.Tensor:
    """One sequence at a time, as Megatron's unfused thd path before 0.17 (host syncs)."""
    lengths = ((cu_seqlens[1:] - cu_seqlens[:-1]) // cp_size).tolist()
    outputs = []
    for piece in torch.split(t, lengths):
        n = piece.size(0)
        if cp_size > 1:
            chunk, full = n // 2, n * cp_size
            first = freqs[cp_rank * chunk : (cp_rank + 1) * chunk]
            second = freqs[full - (cp_rank + 1) * chunk : full - cp_rank * chunk]
            piece_freqs = torch.cat((first, second))
        else:
            piece_freqs = freqs[:n]
        outputs.append(rope_reference(piece.unsqueeze(1), piece_freqs, interleaved).squeeze(1))
    return torch.cat(outputs)
