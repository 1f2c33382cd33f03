"""Ring attention (``cp_comm_type="p2p"``): K/V travel around the CP group, one block per step.

Forward, step ``i`` on rank ``r``: the K/V of rank ``r - i`` are local; the exchange that
brings the next ones (send to ``r + 1``, receive from ``r - 1``, one ``batch_isend_irecv``) is
posted *before* the block is computed, so communication overlaps compute. Each block's output
is merged by log-sum-exp (``SoftmaxMerger``); with the zigzag layout a causal step is the
local diagonal or half a block (``ring_step_plan``), so masked blocks are never computed.

Backward repeats the ring for K/V and sends a second ring the other way round the work: the
fp32 dK/dV accumulator of rank ``j``'s keys travels with them, each rank adds its block's
contribution and passes it on, and after ``cp`` hops it arrives back at ``j``. Its transfer
overlaps the next block's backward, except the last hop's, which nothing is left to overlap:
that one is sent finished, in the inputs' dtype (``_final``). Nothing of size ``s x s`` is
stored or sent.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_rocm.runtime.backend.cp.block_attention import (
    BlockKernel,
    SoftmaxMerger,
    accumulation_dtype,
)
from megatron_rocm.runtime.backend.cp.layout import DIAGONAL, KV_FRONT, Q_BACK, ring_step_plan
from megatron_rocm.runtime.backend.cp.p2p import Pending, global_rank, post

Tensor = torch.Tensor


class Ring:
    """Point-to-point neighbours of this rank in the CP group (global ranks, as P2POp wants)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = global_rank(group, (self.rank + 1) % self.size)
        self.prev = global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, tensors: tuple[Tensor, ...]) -> Pending:
        """Post: send ``tensors`` to the next rank, receive the same shapes from the previous."""
        sends = [(t, self.next) for t in tensors]
        return post(sends, [(torch.empty_like(t), self.prev) for t in tensors], self.group)


def bhsd(x: Tensor) -> Tensor:
    """Megatron's ``[s, b, heads, d]`` -> the kernels' ``[b, heads, s, d]`` (a view)."""
    return x.permute(1, 2, 0, 3)


def _block(plan: str, q: Tensor, key: Tensor, value: Tensor, half: int):  # noqa: ANN202
    """(query rows, q, k, v, key rows) of the block a ring step computes."""
    k, v = bhsd(key), bhsd(value)
    if plan == KV_FRONT:
        return slice(None), q, k[:, :, :half], v[:, :, :half], slice(0, half)
    if plan == Q_BACK:
        return slice(half, None), q[:, :, half:], k, v, slice(None)
    return slice(None), q, k, v, slice(None)


class RingAttention(torch.autograd.Function):
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
        ring = Ring(group)
        s, b, heads, _ = query.shape
        key, value = key.contiguous(), value.contiguous()
        q, half = bhsd(query), s // 2
        merger = SoftmaxMerger(q, value.shape[-1])
        states = []
        kv = (key, value)
        for step in range(ring.size):
            pending = ring.exchange(kv) if step + 1 < ring.size else None
            plan = ring_step_plan(ring.rank, ring.size, step, causal)
            rows, qi, ki, vi, _ = _block(plan, q, *kv, half)
            out, lse, state = kernel.forward(
                qi, ki, vi, causal=plan == DIAGONAL, scale=scale, dropout_p=dropout_p
            )
            merger.add(rows, out, lse, first=step == 0)  # step 0 covers every row
            states.append(state)
            if pending is not None:
                kv = tuple(pending.wait())
        # One copy casts the fp32 merge to the input dtype and lays it out as [s, b, heads * d]
        # (a tensor of its own, not a view: Megatron may free an output's storage in place).
        output = query.new_empty(s, b, heads * value.shape[-1])
        bhsd(output.view(s, b, heads, -1)).copy_(merger.out)
        ctx.save_for_backward(query, key, value, output, merger.lse)
        ctx.args = (group, causal, scale, dropout_p, kernel, states)
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor):  # noqa: ANN001, ANN205
        query, key, value, output, lse = ctx.saved_tensors
        group, causal, scale, dropout_p, kernel, states = ctx.args
        ring = Ring(group)
        s, b, heads, _ = query.shape
        value_dim = value.shape[-1]
        q, half = bhsd(query), s // 2
        out = bhsd(output.view(s, b, heads, value_dim))
        dout = bhsd(grad_output.reshape(s, b, heads, value_dim))
        dq = torch.empty(query.shape, dtype=accumulation_dtype(query.dtype), device=query.device)
        kv = (key, value)
        grads = pending_grads = None
        for step in range(ring.size):
            pending_kv = ring.exchange(kv) if step + 1 < ring.size else None
            plan = ring_step_plan(ring.rank, ring.size, step, causal)
            rows, qi, ki, vi, kv_rows = _block(plan, q, *kv, half)
            dqi, dki, dvi = kernel.backward(
                dout[:, :, rows], qi, ki, vi, out[:, :, rows], lse[:, :, rows], states[step],
                causal=plan == DIAGONAL, scale=scale, dropout_p=dropout_p,
            )  # fmt: skip
            if step == 0:  # the local block covers every query and key row: copy, not add
                assert rows == kv_rows == slice(None), plan
                bhsd(dq).copy_(dqi)
                grads = tuple(
                    torch.empty(t.shape, dtype=accumulation_dtype(t.dtype), device=t.device)
                    for t in kv
                )
                bhsd(grads[0]).copy_(dki)
                bhsd(grads[1]).copy_(dvi)
            else:  # the accumulator of these keys' owner, from the previous rank
                bhsd(dq)[:, :, rows] += dqi
                grads = tuple(pending_grads.wait())
                bhsd(grads[0])[:, :, kv_rows] += dki
                bhsd(grads[1])[:, :, kv_rows] += dvi
            if ring.size > 1:  # hop on; after the last step it lands at the keys' owner
                pending_grads = ring.exchange(
                    _final(grads, (key.dtype, value.dtype)) if pending_kv is None else grads
                )
            if pending_kv is not None:
                kv = tuple(pending_kv.wait())
        dq = dq.to(query.dtype)  # while the last hop is in flight
        dk, dv = pending_grads.wait() if ring.size > 1 else grads
        return (
            dq,
            dk.to(key.dtype),
            dv.to(value.dtype),
            None, None, None, None, None,
        )  # fmt: skip


def _final(grads: tuple[Tensor, ...], dtypes: tuple[torch.dtype, ...]) -> tuple[Tensor, ...]:
    """The finished dK/dV sums in the inputs' dtypes, for their last hop.

    Every contribution has been added by then, and the owner would round the fp32 sum to the
    input dtype on arrival anyway: rounding before the hop gives the same bits and, in bf16,
    halves the one transfer that no block's backward overlaps.
    """
    return tuple(g.to(dtype) for g, dtype in zip(grads, dtypes, strict=True))
