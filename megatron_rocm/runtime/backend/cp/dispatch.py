"""Context-parallel core attention without TransformerEngine.

With ``--context-parallel-size cp`` Megatron gives each rank of the CP group ``1/cp`` of the
sequence in the load-balanced zigzag layout (``cp.layout``: rank ``r`` holds chunks ``r`` and
``2cp-1-r`` of ``2cp``). ``context_parallel_attention`` computes exact attention over the
whole sequence for the local queries, forward and backward, over ``torch.distributed``
(NCCL/RCCL on GPUs, gloo on the CPU). Upstream's ``--cp-comm-type`` picks the scheme:

* ``p2p`` (upstream's default): a ring; K/V blocks hop rank to rank while the previous block
  is computed; per-block SDPA kernels with log-sum-exp merging (``cp.ring``).
* ``all_gather``: gather K/V, four large local kernel calls (``cp.all_gather``).
* ``a2a``: Ulysses; heads <-> sequence exchanges pipelined with the block kernels over head
  groups (``cp.a2a``).

``a2a+p2p`` (hierarchical, needs upstream's hierarchical CP groups) is not implemented.

Why not PyTorch's ``torch.distributed.tensor.experimental.context_parallel``: it swaps
``F.scaled_dot_product_attention`` for a DTensor dispatcher over a ``DeviceMesh`` (a global
monkey-patch, with module-wide options), expects ``[b, h, s, d]`` buffers that it shards itself,
rejects grouped kv heads in its aten-op path, refuses a non-causal mask with load balancing on,
and its ring helpers are private with signatures that change between releases. Megatron
hands us an already-sharded ``[s, b, h, d]`` and a ProcessGroup, so a small ring of our own over
the same aten kernels fits better; the tests pin it against single-process attention.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from megatron_rocm.runtime.backend.cp.a2a import a2a_attention, a2a_unsupported
from megatron_rocm.runtime.backend.cp.all_gather import AllGatherAttention
from megatron_rocm.runtime.backend.cp.block_attention import pick_kernel
from megatron_rocm.runtime.backend.cp.layout import (
    rank_major_to_global,
    ring_step_plan,
    zigzag_chunk_ids,
    zigzag_shard,
    zigzag_unshard,
)
from megatron_rocm.runtime.backend.cp.ring import RingAttention

__all__ = [
    "SUPPORTED_CP_COMM_TYPES",
    "context_parallel_attention",
    "rank_major_to_global",
    "ring_step_plan",
    "zigzag_chunk_ids",
    "zigzag_shard",
    "zigzag_unshard",
]

SUPPORTED_CP_COMM_TYPES: tuple[str, ...] = ("p2p", "all_gather", "a2a")


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool) -> None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("context-parallel attention takes [s, b, heads, dim] query, key and value")
    s, b, heads, dim = query.shape
    if key.shape[:2] != (s, b) or value.shape[:3] != key.shape[:3] or key.shape[3] != dim:
        raise ValueError(
            f"context-parallel attention is self-attention over one local sequence: query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)} do not match"
        )
    if heads % key.shape[2]:
        raise ValueError(f"{heads} query heads are not a multiple of {key.shape[2]} kv groups")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            f"query/key/value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if causal and s % 2:
        raise ValueError(
            f"causal context parallelism needs an even local sequence (Megatron's layout gives "
            f"each rank two chunks of 2*cp); got {s} tokens on this rank"
        )


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    cp_group: Any,
    causal: bool,
    softmax_scale: float | None,
    dropout_p: float = 0.0,
    comm_type: str = "p2p",
    kernel_order: tuple[str, ...] | None = None,
) -> torch.Tensor:
    """Exact attention of the local queries over the whole CP-sharded sequence.

    ``query [s_local, b, np, hn]``, ``key [s_local, b, ng, hn]``, ``value [s_local, b, ng, hv]``
    in Megatron's zigzag CP layout; returns ``[s_local, b, np * hv]`` (contiguous),
    differentiable w.r.t. q, k and v. ``softmax_scale`` is the full scale of ``q @ k^T``
    (``None``: ``1/sqrt(hn)``). ``cp_group`` is the CP process group (``None``: the default
    group). Dropout uses the current RNG state (callers fork Megatron's CUDA RNG tracker).
    ``kernel_order``: the block kernels ``--attention-backend`` names (None: ``pick_kernel``'s
    own choice).
    """
    if comm_type not in SUPPORTED_CP_COMM_TYPES:
        raise ValueError(
            f"--cp-comm-type {comm_type!r} is not supported without TransformerEngine; use one "
            f"of {', '.join(SUPPORTED_CP_COMM_TYPES)}"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"attention dropout must be in [0, 1), got {dropout_p}")
    _check(query, key, value, causal)
    scale = 1.0 / math.sqrt(query.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if comm_type == "a2a":
        reason = a2a_unsupported(query.shape[2], key.shape[2], dist.get_world_size(cp_group))
        if reason:
            raise ValueError(f"--cp-comm-type a2a: {reason}; use p2p or all_gather")
    kernel = pick_kernel(query, key, value, dropout_p, kernel_order)
    if comm_type == "a2a":
        return a2a_attention(
            query, key, value, group=cp_group, causal=causal, scale=scale, dropout_p=dropout_p,
            kernel=kernel,
        )  # fmt: skip
    impl = RingAttention if comm_type == "p2p" else AllGatherAttention
    return impl.apply(query, key, value, cp_group, causal, scale, dropout_p, kernel)
