"""Ulysses attention (``cp_comm_type="a2a"``): trade the sequence split for a head split.

An all-to-all turns each rank's ``[s/cp, b, heads, d]`` into ``[s, b, heads/cp, d]``: the
whole sequence for a slice of the heads. Attention is then ordinary local SDPA (flash or
memory-efficient kernels, causal on the global order restored from the zigzag layout,
dropout as usual), and a second all-to-all returns the output to the sequence split. The
all-to-alls are autograd functions whose backward is the opposite all-to-all.

Needs the query heads divisible by the CP size; grouped kv heads that are not are expanded
(``repeat_interleave``) to the query heads first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rocm.runtime.backend._cp_layout import global_to_rank_major, rank_major_to_global
from megatron_rocm.runtime.kernels._runtime import is_hip

Tensor = torch.Tensor


def _seq_to_heads(x: Tensor, group: Any, reorder: bool) -> Tensor:
    """``[s_local, b, h, d]`` -> ``[s, b, h / cp, d]`` (global order when ``reorder``)."""
    size = dist.get_world_size(group)
    s, b, h, d = x.shape
    send = x.reshape(s, b, size, h // size, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's tokens, my heads
    full = recv.view(size * s, b, h // size, d)
    return rank_major_to_global(full, size) if reorder else full


def _heads_to_seq(y: Tensor, group: Any, reorder: bool) -> Tensor:
    """Inverse of ``_seq_to_heads``: ``[s, b, h / cp, d]`` -> ``[s_local, b, h, d]``."""
    size = dist.get_world_size(group)
    if reorder:
        y = global_to_rank_major(y, size)
    s_all, b, hl, d = y.shape
    send = y.reshape(size, s_all // size, b, hl, d).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: my tokens, rank j's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(s_all // size, b, size * hl, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Any, reorder: bool) -> Tensor:  # noqa: ANN001
        ctx.args = (group, reorder)
        return _seq_to_heads(x, group, reorder)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        return _heads_to_seq(grad, *ctx.args), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, group: Any, reorder: bool) -> Tensor:  # noqa: ANN001
        ctx.args = (group, reorder)
        return _heads_to_seq(y, group, reorder)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        return _seq_to_heads(grad, *ctx.args), None, None


def a2a_unsupported(heads: int, groups: int, cp_size: int) -> str | None:
    """Why Ulysses cannot split these heads over ``cp_size`` ranks (None when it can)."""
    if heads % cp_size:
        return (
            f"{heads} attention heads (per tensor-parallel rank) are not divisible by cp={cp_size}"
        )
    return None


def a2a_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: Any,
    causal: bool,
    scale: float,
    dropout_p: float,
) -> Tensor:
    """``[s, b, np, hn]`` local q/k/v -> ``[s, b, np * hv]`` through two all-to-alls."""
    size = dist.get_world_size(group)
    heads, groups = query.shape[2], key.shape[2]
    if groups % size:  # kv heads cannot be split evenly: give every query head its own
        key = key.repeat_interleave(heads // groups, dim=2)
        value = value.repeat_interleave(heads // groups, dim=2)
        groups = heads
    q, k, v = (_SeqToHeads.apply(t, group, causal).permute(1, 2, 0, 3) for t in (query, key, value))
    extra = {}
    if groups != heads:
        if is_hip():  # ROCm's flash/efficient kernels reject grouped heads in several releases
            k = k.repeat_interleave(heads // groups, dim=1)
            v = v.repeat_interleave(heads // groups, dim=1)
        else:
            extra["enable_gqa"] = True
    out = F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale, **extra
    )
    out = _HeadsToSeq.apply(out.permute(2, 0, 1, 3), group, causal)
    return out.reshape(out.shape[0], out.shape[1], -1)
