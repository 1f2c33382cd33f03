"""Ulysses attention that computes its own QKV projection, around its first and last exchanges.

a2a's forward opens with an exchange of the projected, rotated q/k/v (each peer gets the heads
it owns, of this rank's tokens), and its backward ends with the reverse one. Through upstream's
``SelfAttention`` both run with nothing beside them: the projection is one GEMM whose output
RoPE reads whole before the attention may pack a single head, and the gradients go back
through torch's split and RoPE's backward, which need every head before the projection's
backward starts. On ``70b-slice`` at 16k on two H100s those two exchanges were 6.8 ms of each
iteration's exposed copies on the slower rank.

Heads are independent up to the projection, and Megatron's fused QKV weight is laid out by kv
group (``q1 q2 k1 v1 | q3 q4 k2 v2 | ...``), so the rows that produce the heads a rank owns are
one block of the weight. This Function therefore runs, for the same result:

forward: the GEMM over the peers' rows, their RoPE, their packing and the exchange's start;
    then the GEMM and RoPE of the rank's own heads while the peers' travel; then attention as
    ``_cp_a2a.attend``;
backward: attention's backward as ``_cp_a2a.attend_backward``, its gradients on their way
    back; meanwhile RoPE's backward and both GEMMs (input and weight gradient) of the rank's
    own heads; then, landed, those of the peers' heads, added.

Upstream's ``Attention.forward`` hands its inputs over (the ``a2a-qkv-projection`` patch) and
``TEDotProductAttention.project_around_a2a`` decides whether this path computes exactly what
upstream's would (``a2a_projection``); where it does not, upstream's path runs unchanged. Kept
free of Megatron imports so the CP tests run it on bare torch.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rocm.runtime.backend._linear_function import added_to_main_grad
from megatron_rocm.runtime.backend.cp.a2a import (
    Call,
    PreparedScatter,
    Shards,
    attend,
    attend_backward,
)
from megatron_rocm.runtime.backend.cp.block_attention import BlockKernel
from megatron_rocm.runtime.kernels.grad_accum import (
    has_main_grad,
    main_grad_for_wgrad,
    wgrad_gemm_accum,
)
from megatron_rocm.runtime.kernels.rope import rotate_sbhd

Tensor = torch.Tensor


class QKVRows:
    """Where each CP rank's heads are in Megatron's fused QKV projection.

    The output's last dim is ``groups x (heads/groups + 2) x head_dim``: per kv group its query
    heads, its key head and its value head. Rank ``j`` owns kv groups ``j*g .. (j+1)*g - 1``
    (``g = groups / cp``) and their query heads, as a2a's head split gives them, so its rows of
    the weight are one block.
    """

    def __init__(self, heads: int, groups: int, head_dim: int, cp_size: int) -> None:
        if heads % groups or groups % cp_size:
            raise ValueError(
                f"{heads} heads in {groups} kv groups do not split over {cp_size} CP ranks"
            )
        self.heads, self.groups, self.head_dim, self.cp_size = heads, groups, head_dim, cp_size
        self.per_group = heads // groups  # query heads per kv group
        self.rank_groups = groups // cp_size
        self.block = self.rank_groups * (self.per_group + 2) * head_dim

    def rows(self, rank: int) -> slice:
        """The weight rows (output features) that produce rank ``rank``'s heads."""
        return slice(rank * self.block, (rank + 1) * self.block)

    def split(self, projected: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """One rank's ``[s, b, block]`` projection -> views ``q [s, b*g, per_group, d]``,
        ``k [s, b*g, 1, d]``, ``v [s, b, g, d]`` (RoPE's kernel takes the first two as they
        are; ``merge_heads`` gives them back as ``[s, b, heads, d]``)."""
        s, b = projected.shape[:2]
        grouped = projected.view(s, b * self.rank_groups, self.per_group + 2, self.head_dim)
        q = grouped[:, :, : self.per_group]
        k = grouped[:, :, self.per_group : self.per_group + 1]
        v = grouped[:, :, self.per_group + 1].view(s, b, self.rank_groups, self.head_dim)
        return q, k, v

    def merge_heads(self, x: Tensor, b: int) -> Tensor:
        """``[s, b*g, h, d]`` (contiguous, as RoPE returns it) -> ``[s, b, g*h, d]``."""
        return x.view(x.shape[0], b, -1, self.head_dim)


def _rope(x: Tensor, freqs: Tensor | None, interleaved: bool, inverse: bool = False) -> Tensor:
    if freqs is None:
        return x
    return rotate_sbhd(x, freqs, interleaved, inverse)


def _per_stage(x: Tensor, shards: Shards, stages: int) -> Tensor:
    """One rank's ``[s_local, b, h, d]`` heads as ``PreparedScatter``'s part, ``[stages,
    pieces, piece_len, b, h / stages, d]`` (a view)."""
    pieces = x.unflatten(0, (shards.pieces, shards.piece_len)).unflatten(3, (stages, -1))
    return pieces.permute(3, 0, 1, 2, 4, 5)


def _project(x2d: Tensor, weight: Tensor, bias: Tensor | None, rows: slice, s: int) -> Tensor:
    """``x W[rows]^T (+ b[rows])`` as ``[s, b, rows]``."""
    w = weight[rows]
    out = torch.mm(x2d, w.t())
    if bias is not None:  # added after the GEMM's rounding, as upstream's linear adds it
        out = out + bias[rows]
    return out.view(s, -1, w.shape[0])


class Projection:
    """The projection's inputs and options, as the Function keeps them for its backward."""

    def __init__(
        self,
        rows: QKVRows,
        freqs: Tensor | None,
        interleaved: bool,
        fuse_wgrad: bool,
    ) -> None:
        self.rows, self.freqs, self.interleaved = rows, freqs, interleaved
        self.fuse_wgrad = fuse_wgrad

    def heads(self, x: Tensor, weight: Tensor, bias: Tensor | None, rank: int):  # noqa: ANN201
        """Rank ``rank``'s q (rotated), k (rotated), v of this rank's tokens, ``[s, b, h, d]``."""
        s, b = x.shape[:2]
        projected = _project(x.reshape(s * b, -1), weight, bias, self.rows.rows(rank), s)
        q, k, v = self.rows.split(projected)
        q = self.rows.merge_heads(_rope(q, self.freqs, self.interleaved).contiguous(), b)
        k = self.rows.merge_heads(_rope(k, self.freqs, self.interleaved).contiguous(), b)
        return q, k, v

    def grad_block(self, dq: Tensor, dk: Tensor, dv: Tensor, out: Tensor) -> None:
        """Write the gradient of one rank's block of the projection into ``out`` (``[s*b,
        block]``, a column block of the whole projection's gradient) from its heads'
        ``[s, b, h, d]`` gradients (RoPE's backward on q and k)."""
        rows = self.rows
        s, b = dq.shape[:2]
        groups, per_group, dim = rows.rank_groups, rows.per_group, rows.head_dim
        g = b * groups
        block = out.view(s, b, groups, per_group + 2, dim)  # out's rows are strided: no b*g
        dq = _rope(dq.reshape(s, g, per_group, dim), self.freqs, self.interleaved, inverse=True)
        dk = _rope(dk.reshape(s, g, 1, dim), self.freqs, self.interleaved, inverse=True)
        block[:, :, :, :per_group] = dq.view(s, b, groups, per_group, dim)
        block[:, :, :, per_group] = dk.view(s, b, groups, dim)
        block[:, :, :, per_group + 1] = dv.reshape(s, b, groups, dim)


class ProjectedUlyssesAttention(torch.autograd.Function):
    """``x [s_local, b, hidden]`` (normalised), the fused QKV weight (and bias) -> the a2a
    attention's ``[s_local, b, heads * d]``; see the module docstring."""

    @staticmethod
    def forward(  # noqa: ANN205
        ctx,  # noqa: ANN001
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        projection: Projection,
        call: Call,
    ):
        shards = call.shards(x.shape[0])
        stages = call.stages
        peers = {}
        for j, _ in shards.peers:  # the peers' heads first: their exchange starts at once
            peers[j] = tuple(_per_stage(t, shards, stages)
                             for t in projection.heads(x, weight, bias, j))  # fmt: skip
        scatter = PreparedScatter.of_parts(shards, peers, stages, call.link)
        scatter.post_peers()
        own = projection.heads(x, weight, bias, shards.rank)  # while the peers' heads travel
        scatter.post(own=tuple(_per_stage(t, shards, stages) for t in own))
        wholes, pending = scatter.result()
        shapes = [(t.shape[2] * shards.size, t.shape[3]) for t in own]  # q, k, v: all heads
        attended = attend(call, shards, wholes, pending, own[0], (shapes[0][0], shapes[2][1]))
        ctx.save_for_backward(x, weight, *attended.saved)
        ctx.has_bias = bias is not None
        ctx.fuse_wgrad = projection.fuse_wgrad and has_main_grad(weight)
        ctx.call, ctx.states, ctx.shapes, ctx.projection = call, attended.states, shapes, projection
        return attended.output

    @staticmethod
    def backward(ctx, grad_output: Tensor):  # noqa: ANN001, ANN205
        shapes, projection = ctx.shapes, ctx.projection
        x, weight, *saved = ctx.saved_tensors
        rows = projection.rows
        x2d = x.reshape(-1, x.shape[-1])
        # before the exchanges start: if this raises, no rank has posted anything yet
        wgrad = _WeightGradient(ctx.fuse_wgrad, weight, x2d) if ctx.needs_input_grad[1] else None
        grad_mixed = x2d.new_empty(x2d.shape[0], weight.shape[0])
        gather = attend_backward(ctx.call, tuple(saved), ctx.states, grad_output, shapes)
        shards = gather.shards
        width = [h // shards.size * d for h, d in shapes]

        def block_of(rank: int, outputs: list[Tensor]) -> None:
            """Rank ``rank``'s block of the projection's gradient, written in place."""
            dq, dk, dv = (
                out[..., rank * w : (rank + 1) * w].unflatten(2, (-1, d))
                for out, w, (_, d) in zip(outputs, width, shapes, strict=True)
            )
            block = grad_mixed[:, rows.rows(rank)]
            projection.grad_block(dq, dk, dv, block)
            if wgrad is not None:  # its rows of the weight gradient need this block only
                wgrad.add(rows.rows(rank), block)

        try:  # the rank's own heads while the peers' gradients travel
            block_of(shards.rank, gather.outputs)
        finally:  # land even if that fails: every rank's exchanges must stay paired
            outputs = gather.finish()
        for j, _ in shards.peers:
            block_of(j, outputs)
        # the input's gradient as upstream computes it: one GEMM over every head
        grad_x = torch.mm(grad_mixed, weight).view(x.shape)
        grad_bias = grad_mixed.sum(0) if ctx.has_bias else None
        grad_weight = wgrad.result() if wgrad is not None else None
        return grad_x, grad_weight, grad_bias, None, None


class _WeightGradient:
    """The fused weight's gradient, one block of rows at a time: added into ``main_grad``
    (Megatron's gradient-accumulation fusion, as ``_linear_function``) or assembled."""

    def __init__(self, fuse: bool, weight: Tensor, x2d: Tensor) -> None:
        self.weight, self.x2d = weight, x2d
        self.main_grad = main_grad_for_wgrad(weight) if fuse else None
        self.grad = None if fuse else torch.empty_like(weight)

    def add(self, rows: slice, block: Tensor) -> None:
        if self.main_grad is None:
            assert self.grad is not None
            torch.mm(block.t(), self.x2d, out=self.grad[rows])
        else:
            wgrad_gemm_accum(self.x2d, block, self.main_grad[rows])

    def result(self) -> Tensor | None:
        """What autograd gets for the weight: the gradient, or, where it went into
        ``main_grad``, ``_linear_function.added_to_main_grad``'s placeholder."""
        if self.main_grad is None:
            return self.grad
        return added_to_main_grad(self.weight, self.main_grad, self.x2d)


def projected_a2a_attention(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    heads: int,
    groups: int,
    head_dim: int,
    freqs: Tensor | None,
    interleaved: bool,
    fuse_wgrad: bool,
    group: Any,
    causal: bool,
    scale: float,
    dropout_p: float,
    kernel: BlockKernel,
) -> Tensor:
    """Upstream's ``SelfAttention`` from the normalised input to the core attention's output:
    ``x W^T (+ b)`` split into ``heads`` query and ``groups`` kv heads of ``head_dim``, RoPE by
    ``freqs`` (``[s_local, 1, 1, rot]``, this rank's positions; None: no RoPE) on q and k, and
    Ulysses attention over ``group``, returned as ``a2a_attention`` returns it."""
    size = torch.distributed.get_world_size(group)
    rows = QKVRows(heads, groups, head_dim, size)
    needs_grad = any(t is not None and t.requires_grad for t in (x, weight, bias))
    call = Call(group, x.device, heads, groups, head_dim, needs_grad,
                kernel=kernel, causal=causal, scale=scale, dropout_p=dropout_p)  # fmt: skip
    projection = Projection(rows, freqs, interleaved, fuse_wgrad)
    return call.hand_on(ProjectedUlyssesAttention.apply(x, weight, bias, projection, call))
