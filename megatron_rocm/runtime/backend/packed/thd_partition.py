"""Which tokens of a packed (THD) batch each context-parallel rank holds: TE's partitioner.

Upstream's packed data path with context parallelism (``get_thd_batch_on_this_cp_rank`` and
the per-document balancing of ``get_batch_on_this_cp_rank`` in ``megatron/core/utils.py``,
``datasets/data_schedule.py`` on main) calls ``transformer_engine_torch``'s
``thd_get_partitioned_indices``. Without TE the ``thd-cp-partition`` patch binds that module
name (``tex``) to this module, so the call below is the one that runs.

The layout is TE's per-document zigzag: every document's padded span (``cu_seqlens``, the
padded offsets where the batch has them) is cut into ``2 * cp_size`` equal chunks, and rank
``r`` holds chunks ``r`` and ``2 * cp_size - 1 - r`` of every document, in document order.
Causal attention then costs every rank the same. ``backend.packed.context_parallel`` reads
the same layout back.
"""

from __future__ import annotations

import torch

from megatron_rocm.runtime.backend.packed.plan import as_offsets

NATIVE = True  # lets a patched assert tell this module from an old TransformerEngine


def host_offsets(cu_seqlens: torch.Tensor, name: str = "cu_seqlens") -> list[int]:
    """Validated cumulative offsets on the host (one copy; a leading batch dim of 1 is dropped)."""
    offsets = as_offsets(cu_seqlens, name, cu_seqlens.device).tolist()
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{name} must start at 0 and not decrease: {offsets}")
    return offsets


def check_divisible(offsets: list[int], cp_size: int, name: str = "cu_seqlens") -> None:
    """Every document must split into ``2 * cp_size`` equal chunks (TE asserts the same)."""
    step = 2 * cp_size
    bad = [b - a for a, b in zip(offsets, offsets[1:]) if (b - a) % step]
    if bad:
        raise ValueError(
            f"context parallelism with packed sequences needs every document's padded length "
            f"to be a multiple of 2 x context-parallel-size = {step}; {name} has lengths "
            f"{bad[:8]}{' ...' if len(bad) > 8 else ''} (pad each document to a multiple of {step})"
        )


def partition_index(offsets: list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global rows held by ``cp_rank`` in its local order (int64, on the CPU)."""
    starts: list[int] = []
    lengths: list[int] = []
    for begin, end in zip(offsets, offsets[1:]):
        chunk = (end - begin) // (2 * cp_size)
        for position in (cp_rank, 2 * cp_size - 1 - cp_rank):
            starts.append(begin + position * chunk)
            lengths.append(chunk)
    return concat_ranges(starts, lengths)


def concat_ranges(starts: list[int], lengths: list[int]) -> torch.Tensor:
    """``cat(arange(s, s + n) for s, n in zip(starts, lengths))`` without a Python loop."""
    if not lengths or sum(lengths) == 0:
        return torch.zeros(0, dtype=torch.int64)
    n = torch.tensor(lengths, dtype=torch.int64)
    s = torch.tensor(starts, dtype=torch.int64)
    first = torch.cumsum(n, 0) - n  # where each range begins in the output
    total = int(n.sum())
    return torch.arange(total) + torch.repeat_interleave(s - first, n)


def thd_get_partitioned_indices(
    cu_seqlens: torch.Tensor, total_tokens: int, world_size: int, rank: int
) -> torch.Tensor:
    """TE's ``thd_get_partitioned_indices``: int32 ``[total_tokens / world_size]`` on
    ``cu_seqlens``' device, the rows of the packed batch that ``rank`` keeps, in its order.

    ``cu_seqlens`` are the cumulative (padded) document lengths, ending at ``total_tokens``.
    TE leaves tokens past ``cu_seqlens[-1]`` undefined; here that is an error, as is a
    document whose length is not a multiple of ``2 * world_size``.
    """
    world_size, rank, total_tokens = int(world_size), int(rank), int(total_tokens)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a context-parallel group of {world_size}")
    offsets = host_offsets(cu_seqlens)
    if offsets[-1] != total_tokens:
        raise ValueError(
            f"cu_seqlens ends at {offsets[-1]} but the batch has {total_tokens} tokens; the "
            f"packed documents (with their padding) must fill the sequence"
        )
    check_divisible(offsets, world_size)
    index = partition_index(offsets, world_size, rank)
    return index.to(device=cu_seqlens.device, dtype=torch.int32)
