"""Point-to-point transfers of the CP schemes: post a batch of sends and receives, wait later.

The ring and Ulysses (a2a) both overlap transfers with attention kernels: they post a batch of
``isend``/``irecv`` on the process group's stream and wait for it only when its results are
needed. On NCCL/RCCL ``wait`` makes the current CUDA stream wait, not the host.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def global_rank(group: Any, rank: int) -> int:
    """The global rank of ``rank`` in ``group`` (``P2POp`` addresses peers by global rank)."""
    if group is None:
        return rank
    get = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
    return get(group, rank)


class Pending:
    """Receive buffers of a posted batch; ``wait`` returns them once they have arrived."""

    def __init__(self, works: list[Any], received: list[Tensor], keep: tuple[Tensor, ...]) -> None:
        self._works, self._received, self._keep = works, received, keep

    def wait(self) -> list[Tensor]:
        for work in self._works:
            work.wait()
        self._keep = ()  # the sent tensors may be freed now
        return self._received


def post(
    sends: list[tuple[Tensor, int]], receives: list[tuple[Tensor, int]], group: Any
) -> Pending:
    """Post every ``(tensor, global peer)`` send and receive as one batch.

    Sends and receives between two ranks match in the order they are listed, so both sides
    must list their transfers to each other in the same order.
    """
    ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in receives]
    works = dist.batch_isend_irecv(ops) if ops else []
    return Pending(works, [t for t, _ in receives], tuple(t for t, _ in sends))
