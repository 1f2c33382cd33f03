"""All-gather attention (``cp_comm_type="all_gather"``): gather K/V once, attend locally.

Forward: the all-gather of K/V is posted asynchronously; under a causal mask the two blocks
that need only local keys (each local chunk against itself, causal) run while it is in
flight. Then each local chunk attends, unmasked, to every earlier chunk of the gathered
sequence in one call, and the two results per chunk are merged by log-sum-exp. Four kernel
calls whatever the CP size, each as large as it can be.

Backward gathers K/V again (keeping the gathered copy would hold the whole sequence's K/V
for every layer), computes the same blocks' gradients and reduce-scatters the fp32 dK/dV of
the gathered sequence back to the owners of the keys.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from megatron_rocm.runtime.backend.cp.block_attention import (
    BlockKernel,
    SoftmaxMerger,
    accumulation_dtype,
)
from megatron_rocm.runtime.backend.cp.layout import global_to_rank_major, rank_major_to_global
from megatron_rocm.runtime.backend.cp.ring import bhsd

Tensor = torch.Tensor

# all_gather_single / reduce_scatter_single are the newer names (the old ones warn there).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Block(NamedTuple):
    rows: slice  # query rows
    local: bool  # keys from the local K/V (else from the gathered K/V)
    kv_rows: slice  # key rows: local, or gathered in global order (causal) or rank-major
    causal: bool
    first: bool  # the first block of its query rows


def _blocks(rank: int, size: int, half: int, causal: bool) -> list[_Block]:
    """Every block this rank computes (without a mask the key order does not matter)."""
    if not causal:
        return [_Block(slice(None), False, slice(None), False, True)]
    front, back = slice(0, half), slice(half, None)
    blocks = [_Block(front, True, front, True, True), _Block(back, True, back, True, True)]
    if rank > 0:  # every chunk before chunk `rank`
        blocks.append(_Block(front, False, slice(0, rank * half), False, False))
    blocks.append(_Block(back, False, slice(0, (2 * size - 1 - rank) * half), False, False))
    return blocks


def _gather(tensors: tuple[Tensor, ...], group: Any) -> tuple[list[Tensor], list[Any]]:
    size = dist.get_world_size(group)
    out = [t.new_empty((size * t.shape[0], *t.shape[1:])) for t in tensors]
    works = [_all_gather(o, t, group=group, async_op=True) for o, t in zip(out, tensors)]
    return out, works


def _gathered_kv(tensors: list[Tensor], works: list[Any], size: int, causal: bool) -> list[Tensor]:
    for work in works:
        work.wait()
    return [rank_major_to_global(t, size) if causal else t for t in tensors]


class AllGatherAttention(torch.autograd.Function):
    """``[s, b, np, hn]`` local q/k/v -> ``[s, b, np * hv]``; see the module docstring."""

    @staticmethod
    def forward(  # noqa: ANN205
        ctx,  # noqa: ANN001
        query: Tensor,
        key: Tensor,
        value: Tensor,
        group: Any,
        causal: bool,
        scale: float,
        dropout_p: float,
        kernel: BlockKernel,
    ):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        s, b, heads, _ = query.shape
        key, value = key.contiguous(), value.contiguous()
        gathered, works = _gather((key, value), group)
        q = bhsd(query)
        merger = SoftmaxMerger(q, value.shape[-1])
        states = []
        kv_all: list[Tensor] | None = None
        for block in _blocks(rank, size, s // 2, causal):
            if block.local:
                kv = (key, value)
            else:
                kv_all = kv_all or _gathered_kv(gathered, works, size, causal)
                kv = kv_all
            k, v = (bhsd(t)[:, :, block.kv_rows] for t in kv)
            out, lse, state = kernel.forward(
                q[:, :, block.rows], k, v, causal=block.causal, scale=scale, dropout_p=dropout_p
            )
            merger.add(block.rows, out, lse, first=block.first)
            states.append(state)
        output = merger.out.to(query.dtype).permute(2, 0, 1, 3).reshape(s, b, -1)
        ctx.save_for_backward(query, key, value, output, merger.lse)
        ctx.args = (group, causal, scale, dropout_p, kernel, states)
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor):  # noqa: ANN001, ANN205
        query, key, value, output, lse = ctx.saved_tensors
        group, causal, scale, dropout_p, kernel, states = ctx.args
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        s, b, heads, _ = query.shape
        value_dim = value.shape[-1]
        gathered, works = _gather((key, value), group)
        q = bhsd(query)
        out = bhsd(output.view(s, b, heads, value_dim))
        dout = bhsd(grad_output.reshape(s, b, heads, value_dim))

        def zeros(t: Tensor) -> Tensor:
            return torch.zeros(t.shape, dtype=accumulation_dtype(t.dtype), device=t.device)

        dq = zeros(query)
        local_grads = (zeros(key), zeros(value))
        kv_all: list[Tensor] | None = None
        all_grads: tuple[Tensor, Tensor] | None = None
        blocks = _blocks(rank, size, s // 2, causal)
        for block, state in zip(blocks, states):
            if block.local:
                kv, grads = (key, value), local_grads
            else:
                kv_all = kv_all or _gathered_kv(gathered, works, size, causal)
                all_grads = all_grads or (zeros(kv_all[0]), zeros(kv_all[1]))
                kv, grads = kv_all, all_grads
            rows, kv_rows = block.rows, block.kv_rows
            k, v = (bhsd(t)[:, :, kv_rows] for t in kv)
            dqi, dki, dvi = kernel.backward(
                dout[:, :, rows], q[:, :, rows], k, v, out[:, :, rows], lse[:, :, rows], state,
                causal=block.causal, scale=scale, dropout_p=dropout_p,
            )  # fmt: skip
            bhsd(dq)[:, :, rows] += dqi
            bhsd(grads[0])[:, :, kv_rows] += dki
            bhsd(grads[1])[:, :, kv_rows] += dvi
        assert all_grads is not None  # every rank has at least one gathered block
        scattered = []
        for full, own in zip(all_grads, local_grads):
            if causal:
                full = global_to_rank_major(full, size)
            part = torch.empty_like(own)
            _reduce_scatter(part, full.contiguous(), group=group)
            scattered.append(part.add_(own))
        return (
            dq.to(query.dtype),
            scattered[0].to(key.dtype),
            scattered[1].to(value.dtype),
            None, None, None, None, None,
        )  # fmt: skip
