"""Ulysses attention (``cp_comm_type="a2a"``): trade the sequence split for a head split.

Every rank holds ``[s/cp, b, heads, d]``; an exchange gives each rank the whole sequence for
``heads/cp`` of the heads, attention runs on it as on one GPU (causal on the global order,
dropout as usual), and a second exchange returns each rank's tokens with all heads.

* **No reordering copies.** Megatron's zigzag layout gives rank ``r`` chunks ``r`` and
  ``2cp-1-r`` of the sequence (``cp.layout``). Each chunk arrives by its own receive straight
  into its place in a whole-sequence buffer, and the output's chunks leave from their place in
  the kernel's output, so nothing is concatenated or permuted into global order and back. What
  is left is packing the heads bound for each peer (one copy per input) and unpacking the heads
  that come back (one per output), moved as 8-byte words (``copy_wide``).
* **Head groups, for slow links.** ``MEGATRON_ROCM_CP_A2A_STAGES=N`` cuts the rank's heads
  into N groups (whole kv heads each, so a query head stays with its kv head; lowered to the
  largest count that splits them evenly). Every group's exchange is posted at once and group
  ``n``'s attention starts as soon as its own has arrived, while later groups' are in flight;
  its output leaves while group ``n + 1`` is computed, and backward does the same. Only the
  first group's inputs and the last group's output then wait on the links. Unset, the count
  follows the transport (``default_stages``): one group on copy engines, which only NVLink
  within a host gets, where the exchanges take a tenth of the attention's time and groups
  measured no faster; two through the process group, which is what RCCL on ROCm and groups
  spanning hosts take, over links several times slower than NVLink. On two H100s with
  NVLink's peer-to-peer turned off (``NCCL_P2P_DISABLE=1``, a stand-in for such links) two
  groups took 3.1% off each training iteration of Llama-2-70B's heads at 16k, four no more;
  on NVLink itself through the process group they cost 0.3% (docs/backend.md).

* **Copy engines within a host.** Where every rank of the group is on one host (CUDA), the
  exchanges are copies through symmetric memory on the GPUs' copy engines instead of NCCL
  kernels (``cp.copy_engine``; ``MEGATRON_ROCM_CP_A2A_TRANSPORT`` to choose): each rank packs
  the heads bound for a peer into its outbox, which the peer pulls from, and pushes a peer's
  results straight into the peer's inbox. The layout of every piece is the same either way.

* **The output projection overlaps two of the four exchanges.** The forward's last one lands
  while the projection computes over the rank's own heads: the attention returns its output
  before the peers' heads are in it (``cp.early_output``; anything else that reads it first
  lands them). The backward's first one starts in the projection's backward: its input
  gradient is what the exchange sends; the projection queues the packing before its
  weight-gradient GEMM, with the process group's transfers (their kernels then ahead of the
  GEMM's) or the copy engines' barrier, and the copy engines' pulls after it, so the transfers
  run beside that GEMM (``cp.handoff``, ``PreparedScatter``). ``MEGATRON_ROCM_CP_A2A_HANDOFF``
  picks them (``1`` both, ``forward``, ``backward``, ``0`` neither).

* **Inside a CUDA graph** (Megatron's ``--cuda-graph-impl local`` or ``full_iteration``) the
  exchanges go through the process group and stay the attention's own: the copy engines' side
  stream cannot join a capture, and the handoffs are not verified there. Eager calls around
  the capture keep the group's transport (``link_for_call``).

Attention runs on the CP block kernels (``cp.block_attention``: cuDNN on NVIDIA where its
probe passes, flash on ROCm, ``MEGATRON_ROCM_CP_KERNEL`` to choose), which keep their output
and log-sum-exp for a backward of our own. Needs the query heads divisible by the CP size;
grouped kv heads that are not are expanded (``repeat_interleave``) to the query heads first.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from megatron_rocm.runtime import settings
from megatron_rocm.runtime.backend.cp.block_attention import BlockKernel
from megatron_rocm.runtime.backend.cp.copy_engine import (
    Arrival,
    CopyEngineLink,
    Layout,
    group_key,
    link_for_call,
)
from megatron_rocm.runtime.backend.cp.early_output import hand_on_early, untracked
from megatron_rocm.runtime.backend.cp.handoff import (
    Handoff,
    handoff_directions,
    offer,
    settle_open,
)
from megatron_rocm.runtime.backend.cp.layout import zigzag_chunk_ids
from megatron_rocm.runtime.backend.cp.p2p import Pending, global_rank, post
from megatron_rocm.runtime.backend.cp.ring import bhsd
from megatron_rocm.runtime.kernels.launch import log_fallback_once
from megatron_rocm.runtime.platform import capturing

Tensor = torch.Tensor

STAGES_ENV = "MEGATRON_ROCM_CP_A2A_STAGES"
COPY_ENGINE_STAGES = 1  # NVLink within a host: little to hide, groups measured no faster
PROCESS_GROUP_STAGES = 2  # RCCL, other hosts: slower links, where two groups paid


def default_stages(copy_engines: bool) -> int:
    """The head groups a transport gets when ``MEGATRON_ROCM_CP_A2A_STAGES`` is unset."""
    return COPY_ENGINE_STAGES if copy_engines else PROCESS_GROUP_STAGES


def parse_stage_count(text: str) -> int | None:
    """A count of head groups written as text: a positive whole number, else None."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() and int(text) >= 1 else None


def requested_stages() -> int | None:
    """The head groups ``MEGATRON_ROCM_CP_A2A_STAGES`` asks for (None if it is unset)."""
    return settings.get(STAGES_ENV)  # type: ignore[return-value]


def stage_count(heads: int, groups: int, cp_size: int, copy_engines: bool) -> int:
    """Head groups to pipeline: the requested count (``default_stages`` of the transport if
    none is), lowered until it splits the kv heads each rank gets (all query heads when the
    kv heads do not split over the ranks: expanded)."""
    kv_heads = heads if groups % cp_size else groups
    asked = requested_stages()
    return math.gcd(asked or default_stages(copy_engines), kv_heads // cp_size)


def a2a_unsupported(heads: int, groups: int, cp_size: int) -> str | None:
    """Why Ulysses cannot split these heads over ``cp_size`` ranks (None when it can)."""
    if heads % cp_size:
        return (
            f"{heads} attention heads (per tensor-parallel rank) are not divisible by cp={cp_size}"
        )
    return None


def sbhd(x: Tensor) -> Tensor:
    """A kernel's ``[b, heads, s, d]`` -> ``[s, b, heads, d]``, contiguous (a copy only if the
    kernel laid it out otherwise: cuDNN and flash keep the query's layout, which is this)."""
    return packed(x.permute(2, 0, 1, 3))


def copy_wide(dst: Tensor, src: Tensor) -> Tensor:
    """``dst.copy_(src)``, moving 8-byte words where both layouts allow it.

    The packing and unpacking copies here read or write permuted views, for which torch's
    copy kernel computes an offset per element and moves 2 bytes at a time in bf16. Seen as
    int64 words, the same bytes take a quarter of the elements: packing one peer's 64 MB of
    query heads (64/8 heads, 16k, cp 2) took 84 us as bf16 and 38 us as words on an H200.
    Bits are copied, never converted.
    """
    if dst.dtype == src.dtype and _widens(dst) and _widens(src):
        dst.view(torch.int64).copy_(src.view(torch.int64))
        return dst
    return dst.copy_(src)


def _widens(x: Tensor) -> bool:
    """Whether ``x`` can be seen as int64 words: its innermost dim contiguous and every offset
    and stride a whole number of words."""
    size = x.element_size()
    if size >= 8 or x.dim() == 0 or x.stride(-1) != 1 or (x.shape[-1] * size) % 8:
        return False
    offsets = (x.storage_offset(), *x.stride()[:-1])
    return all(o * size % 8 == 0 for o in offsets) and x.data_ptr() % 8 == 0


def packed(x: Tensor) -> Tensor:
    """A contiguous copy of ``x`` (``copy_wide``)."""
    return (
        x
        if x.is_contiguous()
        else copy_wide(torch.empty_like(x, memory_format=torch.contiguous_format), x)
    )


class Shards:
    """Where each rank of the CP group keeps its tokens in the whole sequence.

    Causal: Megatron's zigzag, two pieces per rank (chunks ``j`` and ``2cp-1-j``). Without a mask
    the order of keys does not matter, so each rank's tokens are one piece at slot ``j``.
    """

    def __init__(self, group: Any, local_tokens: int, causal: bool) -> None:
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.pieces = 2 if causal else 1
        self.piece_len = local_tokens // self.pieces
        self.peers = [(j, global_rank(group, j)) for j in range(self.size) if j != self.rank]

    def of_rank(self, whole: Tensor, j: int, dim: int = 0) -> Tensor:
        """Rank ``j``'s pieces of a whole sequence along ``dim``: a ``[pieces, piece_len, ...]``
        view (each piece contiguous when ``whole`` is and ``dim`` is its outermost)."""
        chunks = whole.unflatten(dim, (self.size * self.pieces, self.piece_len))
        if self.pieces == 1:
            picks = slice(j, j + 1)
        else:  # Megatron's two chunks of rank j, one step apart (the step is >= 1 for every j)
            first, last = zigzag_chunk_ids(self.size, j)
            picks = slice(first, last + 1, last - first)
        return chunks[(slice(None),) * dim + (picks,)]

    def by_head(self, local: Tensor, stages: int) -> Tensor:
        """``[s_local, b, heads, d]`` as ``[pieces, piece_len, b, cp, stages, heads', d]``: the
        heads of rank ``j``'s stage ``n`` at ``[:, :, :, j, n]`` (a view, for any strides)."""
        pieces = local.unflatten(0, (self.pieces, self.piece_len))  # [pieces, len, b, heads, d]
        return pieces.unflatten(3, (self.size, stages, -1))

    def scatter(
        self, tensors: tuple[Tensor, ...], stages: int, link: CopyEngineLink | None = None
    ) -> tuple[list[Tensor], list[Pending | Arrival]]:
        """Post the exchange of every stage: each local ``[s_local, b, heads, d]`` becomes a
        ``[stages, s, b, heads / cp / stages, d]`` whole-sequence buffer for this rank's heads.

        Returns the buffers and, per stage, the pending transfer to wait for before reading
        that stage (``PreparedScatter``, queued in one go).
        """
        return PreparedScatter(self, tensors, stages, link).result()


class PreparedScatter:
    """A scatter (``Shards.scatter``) queued in two steps, so that other work can be queued
    between them (``cp.handoff``).

    The constructor packs the heads bound for each peer and, with a copy-engine ``link``, queues
    the barrier after which the peers' outboxes may be read; through the process group it posts
    the batches right away (their kernels are then queued ahead of what comes next). ``post``
    queues the pulls (copy engines) and copies the rank's own tokens into place while the
    peers' travel.
    """

    def __init__(
        self,
        shards: Shards,
        tensors: tuple[Tensor, ...],
        stages: int,
        link: CopyEngineLink | None,
    ) -> None:
        # [pieces, len, b, cp, stages, h, d] -> [cp, stages, pieces, len, b, h, d]
        per_ranks = [shards.by_head(x, stages).permute(3, 4, 0, 1, 2, 5, 6) for x in tensors]
        self._start(shards, [dict(enumerate(p)) for p in per_ranks], stages, link)

    @classmethod
    def of_parts(
        cls,
        shards: Shards,
        parts: dict[int, tuple[Tensor, ...]],
        stages: int,
        link: CopyEngineLink | None,
    ) -> PreparedScatter:
        """A scatter of tensors given per rank of the group as ``[stages, pieces, len, b, h',
        d]`` views (``parts[j]``: the heads rank ``j`` owns, of this rank's tokens), the peers'
        only: the rank's own come with ``post(own=...)``, so that they can be computed while
        the peers' travel (``cp.a2a_qkv``)."""
        scatter = cls.__new__(cls)
        per_ranks = [dict(zip(parts, column, strict=True)) for column in zip(*parts.values())]
        scatter._start(shards, per_ranks, stages, link)
        return scatter

    def _start(
        self,
        shards: Shards,
        per_ranks: list[dict[int, Tensor]],
        stages: int,
        link: CopyEngineLink | None,
    ) -> None:
        settle_open(group_key(shards.group))  # a started exchange nobody took: complete it
        self.shards, self.stages, self.link = shards, stages, link
        self.per_ranks = per_ranks
        length = shards.size * shards.pieces * shards.piece_len
        parts = [_a_part(p) for p in per_ranks]
        self.wholes = [part.new_empty(stages, length, *part.shape[-3:]) for part in parts]
        self.pending: list[Pending | Arrival] | None = None
        self._posted = False
        if link is None:
            self.pending = list(self._post_batches())
        else:
            self._pack(link)

    def _post_batches(self) -> list[Pending]:
        """Pack each peer's heads and post one batch of sends and receives per stage."""
        shards = self.shards
        packs = [{j: packed(per_rank[j]) for j, _ in shards.peers} for per_rank in self.per_ranks]
        pending = []
        for n in range(self.stages):
            sends, receives = [], []
            for j, peer in shards.peers:
                for whole, out in zip(self.wholes, packs, strict=True):
                    for i in range(shards.pieces):
                        sends.append((out[j][n, i], peer))
                        receives.append((shards.of_rank(whole[n], j)[i], peer))
            pending.append(post(sends, receives, shards.group))
        return pending

    def _pack(self, link: CopyEngineLink) -> None:
        """Pack each peer's heads into this rank's outbox and queue the barrier after which
        every outbox is packed."""
        self.layout = Layout([(tuple(_a_part(p).shape), _a_part(p).dtype)
                              for p in self.per_ranks], self.shards.size)  # fmt: skip
        link.reserve(self.layout.nbytes)
        link.uses(self.wholes)  # the pulls write them
        link.before_packing()
        for j, _ in self.shards.peers:
            for box, per_rank in zip(link.outbox(self.layout, j), self.per_ranks, strict=True):
                copy_wide(box, per_rank[j])
        link.barrier()

    def post(self, own: tuple[Tensor, ...] | None = None) -> None:
        """Queue the pulls of every peer's pieces for this rank (copy engines; one batch per
        stage) and copy the rank's own tokens into place (``own``: its part, where
        ``of_parts`` left it out). Once only."""
        if self._posted:
            return
        self.post_peers()
        if own is not None:
            for per_rank, part in zip(self.per_ranks, own, strict=True):
                per_rank[self.shards.rank] = part
        self._own_part()
        self._posted = True

    def post_peers(self) -> None:
        """Queue the pulls (copy engines; the process group's transfers are posted already)
        before the rank's own part is computed: it then runs beside them (``post`` later)."""
        if self.link is not None and self.pending is None:
            self.pending = list(self._pull(self.link))

    def _pull(self, link: CopyEngineLink) -> list[Arrival]:
        """One batch of copies per stage. They need only the barrier, which the side stream
        queued after the packing and the buffers' allocation: whatever the current stream
        queued since (the projection's weight-gradient GEMM, under a handoff) runs beside."""
        shards = self.shards
        boxes = {j: link.peer_outbox(self.layout, j) for j, _ in shards.peers}
        return [
            link.copy([
                (shards.of_rank(whole[n], j)[i], box[n, i])
                for j, _ in shards.peers
                for whole, box in zip(self.wholes, boxes[j], strict=True)
                for i in range(shards.pieces)
            ], after_current=False)
            for n in range(self.stages)
        ]  # fmt: skip

    def _own_part(self) -> None:
        shards = self.shards
        for whole, per_rank in zip(self.wholes, self.per_ranks, strict=True):
            copy_wide(shards.of_rank(whole, shards.rank, dim=1), per_rank[shards.rank])

    def result(self) -> tuple[list[Tensor], list[Pending | Arrival]]:
        """The whole-sequence buffers and, per stage, what to wait for before reading them."""
        self.post()
        assert self.pending is not None
        return self.wholes, self.pending

    def settle(self) -> None:
        """Complete this scatter although nobody reads it: every transfer is queued, and the
        next exchange's packing waits until every peer has pulled from this rank's outbox
        (with copy engines, one more barrier after this rank's own pulls)."""
        self.post()
        if self.link is not None:
            self.link.barrier()
        else:
            for pending in self.pending or []:
                pending.wait()


def _a_part(per_rank: dict[int, Tensor]) -> Tensor:
    """One rank's part of a tensor to scatter (every rank's part has its shape and dtype)."""
    return next(iter(per_rank.values()))


class Gather:
    """The way back: per-stage ``[s, b, heads', d]`` results -> ``[s_local, b, heads * d]``.

    ``post`` sends a stage's result as soon as it is computed (each peer's tokens straight from
    their place in it; with a copy-engine ``link``, pushed into the peer's inbox) and keeps the
    rank's own; ``finish`` waits and unpacks the peers' heads.
    """

    def __init__(
        self,
        shards: Shards,
        stages: int,
        shapes: list[tuple[int, int]],
        like: Tensor,
        link: CopyEngineLink | None = None,
    ) -> None:
        settle_open(group_key(shards.group))
        self.shards, self.link = shards, link
        s, b = shards.pieces * shards.piece_len, like.shape[1]
        self.outputs = [like.new_empty(s, b, heads * dim) for heads, dim in shapes]
        self._parts = [  # a late finish writes after autograd has made the output its own
            shards.by_head(untracked(out).unflatten(2, (heads, dim)), stages)
            for out, (heads, dim) in zip(self.outputs, shapes, strict=True)
        ]
        piece = (shards.pieces, shards.piece_len, b)
        received = [(stages, *piece, h // shards.size // stages, d) for h, d in shapes]
        if link is None:
            self._received = {
                j: [like.new_empty(shape) for shape in received] for j, _ in shards.peers
            }
        else:
            self._layout = Layout([(shape, like.dtype) for shape in received], shards.size)
            link.reserve(self._layout.nbytes)
            self._received = {j: link.inbox(self._layout, j) for j, _ in shards.peers}
        self._pending: list[Pending | Arrival] = []

    def post(self, n: int, results: tuple[Tensor, ...]) -> None:
        shards = self.shards
        if self.link is not None:
            self._push(n, results, self.link)
        else:
            sends, receives = [], []
            for j, peer in shards.peers:
                for t, result in enumerate(results):
                    for i in range(shards.pieces):
                        sends.append((shards.of_rank(result, j)[i], peer))
                        receives.append((self._received[j][t][n, i], peer))
            self._pending.append(post(sends, receives, shards.group))
        for part, result in zip(self._parts, results, strict=True):  # while the peers' travel
            copy_wide(part[:, :, :, shards.rank, n], shards.of_rank(result, shards.rank))

    def _push(self, n: int, results: tuple[Tensor, ...], link: CopyEngineLink) -> None:
        shards = self.shards
        pairs = [
            (box[n, i], shards.of_rank(result, j)[i])
            for j, _ in shards.peers
            for box, result in zip(link.peer_inbox(self._layout, j), results, strict=True)
            for i in range(shards.pieces)
        ]
        link.copy(pairs, keep=results)  # finish's barrier, after these, is what is waited for

    def finish(self) -> list[Tensor]:
        if self.link is not None:
            self._pending.append(self.link.seal())  # every rank has pushed everything
        for pending in self._pending:
            pending.wait()
        for j, _ in self.shards.peers:
            for part, received in zip(self._parts, self._received[j], strict=True):
                copy_wide(part[:, :, :, j], received.permute(1, 2, 3, 0, 4, 5))
        if self.link is not None:
            self.link.after_unpacking()
        return self.outputs


class Attended:
    """Attention over exchanged whole-sequence heads, its output's way back posted
    (``attend``): what a Ulysses Function keeps for its backward (``attend_backward``)."""

    def __init__(self, output: Tensor, saved: list[Tensor], states: list[Any]) -> None:
        self.output, self.saved, self.states = output, saved, states


class Call:
    """What one a2a attention call settles before its Function runs, and hands on after: the
    attention's math (``kernel``, ``causal``, ``scale``, ``dropout_p``), the transport, the
    head groups, the backward's first exchange and the output projection's handoffs
    (``cp.handoff``, ``cp.early_output``)."""

    def __init__(
        self,
        group: Any,
        device: torch.device,
        heads: int,
        groups: int,
        value_dim: int,
        needs_grad: bool,
        *,
        kernel: BlockKernel,
        causal: bool,
        scale: float,
        dropout_p: float,
    ) -> None:
        self.group, self.size = group, dist.get_world_size(group)
        self.kernel, self.causal, self.scale, self.dropout_p = kernel, causal, scale, dropout_p
        requested_stages()  # a bad value fails here, before the transport's collectives
        self.link = link_for_call(group, device)
        self.stages = stage_count(heads, groups, self.size, copy_engines=self.link is not None)
        self.douts_shape = (heads, value_dim)
        directions = handoff_directions()
        if directions and capturing(device):
            # untested inside a CUDA graph: the exchanges stay the attention's own there
            directions = frozenset()
            log_fallback_once(
                "a2a-handoff:capture",
                "a2a keeps its exchanges from the output projection while a CUDA graph is captured",
            )
        self.handoff = None
        if "backward" in directions and torch.is_grad_enabled() and needs_grad:
            self.handoff = Handoff(self.scatter_gradient, group_key(group))
        compiling = getattr(torch.compiler, "is_compiling", lambda: False)()
        self.early: list[Gather] | None = [] if "forward" in directions and not compiling else None

    def shards(self, local_tokens: int) -> Shards:
        return Shards(self.group, local_tokens, self.causal)

    def scatter_gradient(self, grad: Tensor) -> PreparedScatter:
        """The backward's first exchange: the output's gradient to the ranks owning its heads
        (the one ``handoff`` may have started already)."""
        heads = grad.unflatten(2, self.douts_shape)
        return PreparedScatter(self.shards(grad.shape[0]), (heads,), self.stages, self.link)

    def hand_on(self, output: Tensor) -> Tensor:
        """The Function's output as the projection takes it: offered for the backward's
        handoff, and early (before the peers' heads land) where the forward's is on."""
        if self.handoff is not None:
            offer(self.handoff, output)
        if not self.early:
            return output
        gather = self.early.pop()  # the landing holds it now: ctx keeps this Call to backward
        width = output.shape[-1] // self.size
        rank = dist.get_rank(self.group)
        own_heads = slice(rank * width, (rank + 1) * width)
        return hand_on_early(output, own_heads, gather.finish, group_key(self.group))


def attend(
    call: Call,
    shards: Shards,
    wholes: list[Tensor],
    pending: list[Pending | Arrival],
    like: Tensor,
    out_shape: tuple[int, int],
) -> Attended:
    """Attention per head group as its heads arrive, each group's output sent back as soon as
    it is computed; ``out_shape`` is ``(query heads, value dim)`` of the local output, ``like``
    a local input (dtype, device, batch). Where ``call.early`` is a list, the output's exchange
    is left in it unfinished (``cp.early_output``) instead of finished here."""
    gather = Gather(shards, call.stages, [out_shape], like, call.link)
    outs, lses, states = [], [], []
    for n in range(call.stages):
        pending[n].wait()
        q, k, v = (bhsd(whole[n]) for whole in wholes)
        out, lse, state = call.kernel.forward(
            q, k, v, causal=call.causal, scale=call.scale, dropout_p=call.dropout_p
        )
        gather.post(n, (sbhd(out),))
        outs.append(out)
        lses.append(lse)
        states.append(state)
    if call.early is None:
        (output,) = gather.finish()
    else:  # the rank's own heads are in place; the peers' land later
        call.early.append(gather)
        (output,) = gather.outputs
    return Attended(output, [*wholes, *outs, *lses], states)


def attend_backward(
    call: Call,
    saved: tuple[Tensor, ...],
    states: list[Any],
    grad_output: Tensor,
    shapes: list[tuple[int, int]],
) -> Gather:
    """``attend``'s backward up to the way back: the output's gradient exchanged (or taken
    from the handoff that started it), each group's q/k/v gradients sent back as soon as
    they are computed. The returned ``Gather`` holds the rank's own heads in place; its
    ``finish`` lands the peers' (``shapes``: heads and head dim of q, k and v)."""
    stages = call.stages
    wholes, outs, lses = saved[:3], saved[3 : 3 + stages], saved[3 + stages : 3 + 2 * stages]
    taken = call.handoff.take(grad_output) if call.handoff is not None else None
    if taken is None:  # nobody started it (or with another gradient): exchange it here
        taken = call.scatter_gradient(grad_output).result()
    (douts,), pending = taken
    gather = Gather(call.shards(grad_output.shape[0]), stages, shapes, grad_output, call.link)
    for n in range(stages):
        pending[n].wait()
        q, k, v = (bhsd(whole[n]) for whole in wholes)
        grads = call.kernel.backward(
            bhsd(douts[n]), q, k, v, outs[n], lses[n], states[n],
            causal=call.causal, scale=call.scale, dropout_p=call.dropout_p,
        )  # fmt: skip
        gather.post(n, tuple(sbhd(g) for g in grads))
    return gather


class UlyssesAttention(torch.autograd.Function):
    """``[s, b, np, hn]`` local q/k/v -> ``[s, b, np * hv]``; see the module docstring."""

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, call: Call):  # noqa: ANN001, ANN205
        shards = call.shards(query.shape[0])
        wholes, pending = shards.scatter((query, key, value), call.stages, call.link)
        attended = attend(call, shards, wholes, pending, query, (query.shape[2], value.shape[3]))
        ctx.save_for_backward(*attended.saved)
        ctx.call, ctx.states = call, attended.states
        ctx.shapes = [(t.shape[2], t.shape[3]) for t in (query, key, value)]
        return attended.output

    @staticmethod
    def backward(ctx, grad_output: Tensor):  # noqa: ANN001, ANN205
        gather = attend_backward(ctx.call, ctx.saved_tensors, ctx.states, grad_output, ctx.shapes)
        dq, dk, dv = (
            out.unflatten(2, (h, d))
            for out, (h, d) in zip(gather.finish(), ctx.shapes, strict=True)
        )
        return dq, dk, dv, None


def a2a_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: Any,
    causal: bool,
    scale: float,
    dropout_p: float,
    kernel: BlockKernel,
) -> Tensor:
    """``[s, b, np, hn]`` local q/k/v -> ``[s, b, np * hv]`` over head-split exchanges."""
    heads, groups = query.shape[2], key.shape[2]
    needs_grad = any(t.requires_grad for t in (query, key, value))
    call = Call(group, query.device, heads, groups, value.shape[3], needs_grad,
                kernel=kernel, causal=causal, scale=scale, dropout_p=dropout_p)  # fmt: skip
    if groups % call.size:  # kv heads cannot be split evenly: give every query head its own
        key = key.repeat_interleave(heads // groups, dim=2)
        value = value.repeat_interleave(heads // groups, dim=2)
    return call.hand_on(UlyssesAttention.apply(query, key, value, call))
