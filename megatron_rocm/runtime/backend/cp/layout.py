"""Megatron's load-balanced context-parallel sequence layout, and which blocks causality keeps.

Upstream's CP data path (``get_batch_on_this_cp_rank`` in ``megatron/core/utils.py``; the same
split at every tag from core_v0.12.0 to main, where it is
``_get_batch_on_this_cp_rank_per_sequence_balancing``) cuts the sequence into ``2 * cp``
equal chunks and gives rank ``r`` chunks ``r`` and ``2 * cp - 1 - r``, concatenated. Under a
causal mask every rank then holds one early and one late chunk: equal work per rank.

"Rank-major" below is what an all-gather over the CP group returns (rank 0's two chunks, then
rank 1's, ...); "global" is the original sequence order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FULL = "full"  # every query attends to every key of the block
DIAGONAL = "diagonal"  # the rank's own chunks: causal inside the concatenated pair
KV_FRONT = "kv_front"  # all local queries, the first (early) half of the keys only
Q_BACK = "q_back"  # the second (late) half of the queries, all keys


def zigzag_chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two global chunk indices (of ``2 * cp_size``) that rank ``cp_rank`` holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _rank_major_order(cp_size: int) -> list[int]:
    """Global chunk index at each rank-major position."""
    return [c for rank in range(cp_size) for c in zigzag_chunk_ids(cp_size, rank)]


def _permute_chunks(x: torch.Tensor, order: list[int], dim: int) -> torch.Tensor:
    """Split ``dim`` into ``len(order)`` equal chunks and put chunk ``order[i]`` at ``i``."""
    n = len(order)
    if x.shape[dim] % n:
        raise ValueError(f"sequence length {x.shape[dim]} is not a multiple of {n} chunks")
    chunks = x.chunk(n, dim=dim)
    return torch.cat([chunks[i] for i in order], dim=dim)


def zigzag_shard(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 0) -> torch.Tensor:
    """This rank's part of a full sequence, as ``get_batch_on_this_cp_rank`` cuts it."""
    if x.shape[dim] % (2 * cp_size):
        raise ValueError(
            f"sequence length {x.shape[dim]} is not a multiple of 2 * cp = {2 * cp_size}"
        )
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[i] for i in zigzag_chunk_ids(cp_size, cp_rank)], dim=dim)


def rank_major_to_global(x: torch.Tensor, cp_size: int, dim: int = 0) -> torch.Tensor:
    """Rank-major chunks (an all-gather of the shards) -> the original sequence order."""
    order = _rank_major_order(cp_size)
    inverse = [order.index(g) for g in range(2 * cp_size)]
    return _permute_chunks(x, inverse, dim)


def global_to_rank_major(x: torch.Tensor, cp_size: int, dim: int = 0) -> torch.Tensor:
    """The original sequence order -> rank-major chunks (rank ``r``'s shard at slot ``r``)."""
    return _permute_chunks(x, _rank_major_order(cp_size), dim)


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Inverse of ``zigzag_shard``: every rank's shard, in rank order -> the full sequence."""
    return rank_major_to_global(torch.cat(list(shards), dim=dim), len(shards), dim)


def ring_step_plan(cp_rank: int, cp_size: int, step: int, causal: bool) -> str:
    """Which part of (local queries, keys of rank ``cp_rank - step``) a causal mask keeps.

    With the zigzag layout each ring step is exactly one of: the own chunks (``DIAGONAL``,
    causal inside the concatenation), an earlier rank's keys (only their early chunk precedes
    both local chunks: ``KV_FRONT``), or a later rank's keys (they all precede only the local
    late chunk: ``Q_BACK``). Off the diagonal every step is half a block, never masked
    elementwise, so no block is computed only to be thrown away.
    """
    if not causal:
        return FULL
    if step == 0:
        return DIAGONAL
    source = (cp_rank - step) % cp_size
    return KV_FRONT if source < cp_rank else Q_BACK
