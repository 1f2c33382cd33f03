"""Packed (THD) attention under context parallelism: what TE does for ``qkv_format="thd"``
with ``cp_size > 1``.

Each rank holds, of every document, chunks ``r`` and ``2 * cp - 1 - r`` of its padded span
(``backend.packed.thd_partition``, TE's layout); ``cu_seqlens`` and their padded twins describe the
*whole* packed sequence, as upstream passes them. K/V are all-gathered once per layer (one
collective for both; its backward reduce-scatters the fp32 gradients), then every local chunk
with real tokens becomes one varlen "document" of ``packed_attention``: the chunk's queries
against the prefix of its document that causality lets them see (the whole document without a
causal mask). A chunk at positions ``[k c, k c + m)`` sees keys ``[0, k c + m)``: bottom-right
aligned causal attention, which ``packed_attention`` runs as the window ``(-1, 0)``. No ``t x
t`` mask, no cross-document attention, and the same flash / sdpa_loop implementations as the
unsharded path (a one-time probe checks that the GPU's varlen kernel aligns windows bottom-right
before it is used here).

Keys are gathered rather than passed round a ring: a document's chunks sit on every rank, so a
ring would need per-document bookkeeping at every step; gathered K/V of GQA models are small.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rocm.runtime.backend.cp.all_gather import _all_gather, _reduce_scatter
from megatron_rocm.runtime.backend.cp.block_attention import accumulation_dtype
from megatron_rocm.runtime.backend.packed.plan import OFFSET_NAMES, same_batch, versions_of
from megatron_rocm.runtime.backend.packed.thd_attention import (
    flash_unavailable,
    packed_attention,
    requested_implementation,
)
from megatron_rocm.runtime.backend.packed.thd_partition import (
    check_divisible,
    concat_ranges,
    host_offsets,
    partition_index,
)
from megatron_rocm.runtime.kernels.launch import log_fallback_once

Tensor = torch.Tensor


@dataclass(eq=False)
class ChunkLayout:
    """This rank's chunks as varlen documents (device tensors), worked out once per batch."""

    q_rows: Tensor  # int64: local query rows, chunk by chunk
    kv_rows: Tensor  # int64: rows of the gathered (rank-major) K/V, chunk by chunk
    cu_q: Tensor  # int32 [chunks + 1]
    cu_kv: Tensor  # int32 [chunks + 1]
    sources: tuple = ()  # the offset tensors it was worked out from (the cache matches them)
    versions: tuple = ()  # and their in-place versions then
    shape: tuple = ()  # (rows, CP size, CP rank, causal, device)


def chunk_layout(
    t_local: int,
    cu_seqlens: list[int],
    padded: list[int],
    cp_size: int,
    cp_rank: int,
    causal: bool,
) -> tuple[list[int], list[int], list[int], list[int]]:
    """(query starts, query lengths, key lengths, document starts) per chunk with real tokens.

    Query starts are local rows; a chunk's keys are the first ``key length`` global rows of
    its document, which starts at global row ``document start``.
    """
    if padded[-1] != cp_size * t_local:
        raise ValueError(
            f"a context-parallel rank holds {t_local} packed rows, but the padded documents "
            f"end at {padded[-1]} = {cp_size} x {padded[-1] / cp_size:g}; the batch must be "
            f"split with thd_get_partitioned_indices"
        )
    q_starts, q_lengths, kv_lengths, doc_starts = [], [], [], []
    for i, (begin, end) in enumerate(zip(padded, padded[1:])):
        chunk = (end - begin) // (2 * cp_size)
        real = cu_seqlens[i + 1] - cu_seqlens[i]
        for half, position in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
            rows = min(max(real - position * chunk, 0), chunk)
            if rows == 0:
                continue
            q_starts.append(begin // cp_size + half * chunk)
            q_lengths.append(rows)
            kv_lengths.append(position * chunk + rows if causal else real)
            doc_starts.append(begin)
    return q_starts, q_lengths, kv_lengths, doc_starts


def _gathered_row_of_global(padded: list[int], cp_size: int) -> Tensor:
    """Inverse of the rank-major gather order: ``result[global row]`` = gathered row."""
    order = torch.cat([partition_index(padded, cp_size, rank) for rank in range(cp_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return inverse


_cache: list[ChunkLayout] = []


def _layout(
    t_local: int,
    sources: tuple[Tensor | None, ...],
    cp_size: int,
    cp_rank: int,
    causal: bool,
    device: torch.device,
) -> ChunkLayout:
    shape = (t_local, cp_size, cp_rank, causal, device)
    for layout in _cache:
        if layout.shape == shape and same_batch(layout.sources, layout.versions, sources):
            return layout
    host = [None if s is None else host_offsets(s, n) for s, n in zip(sources, OFFSET_NAMES)]
    real_q, real_kv = host[0], host[1]
    padded_q = host[2] if host[2] is not None else real_q
    padded_kv = host[3] if host[3] is not None else real_kv
    if real_q != real_kv or padded_q != padded_kv:
        raise ValueError(
            "context parallelism with packed sequences needs self-attention: equal "
            f"cu_seqlens_q / cu_seqlens_kv (and padded ones); got {real_q} / {real_kv}"
        )
    if len(padded_q) != len(real_q) or any(
        b - a > d - c for a, b, c, d in zip(real_q, real_q[1:], padded_q, padded_q[1:])
    ):
        raise ValueError(f"cu_seqlens_padded {padded_q} cannot hold documents cu_seqlens {real_q}")
    check_divisible(padded_q, cp_size, "cu_seqlens_padded")
    q_starts, q_lengths, kv_lengths, doc_starts = chunk_layout(
        t_local, real_q, padded_q, cp_size, cp_rank, causal
    )
    kv_global = concat_ranges(doc_starts, kv_lengths)
    kv_rows = _gathered_row_of_global(padded_q, cp_size)[kv_global]

    def cumulative(lengths: list[int]) -> Tensor:
        return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)

    layout = ChunkLayout(
        q_rows=concat_ranges(q_starts, q_lengths).to(device),
        kv_rows=kv_rows.to(device),
        cu_q=cumulative(q_lengths).to(device),
        cu_kv=cumulative(kv_lengths).to(device),
        sources=sources,
        versions=versions_of(sources),
        shape=shape,
    )
    _cache[:] = [layout]
    return layout


class _GatherRows(torch.autograd.Function):
    """All-gather along rows (rank-major); backward reduce-scatters the gradient in fp32 (fp64
    stays fp64)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # noqa: ANN205
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        _all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor):  # noqa: ANN205
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        full = grad.to(accumulation_dtype(grad.dtype)).contiguous()
        rows = full.shape[0] // size
        if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter
            dist.all_reduce(full, group=group)
            mine = full.narrow(0, rank * rows, rows)
        else:
            mine = full.new_empty((rows, *full.shape[1:]))
            _reduce_scatter(mine, full, group=group)
        return mine.to(grad.dtype), None


def packed_context_parallel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    cu_seqlens_q: Tensor,
    cu_seqlens_kv: Tensor,
    cu_seqlens_q_padded: Tensor | None,
    cu_seqlens_kv_padded: Tensor | None,
    cp_group: Any,
    causal: bool,
    softmax_scale: float | None,
    dropout_p: float = 0.0,
    implementation: str | None = None,
) -> Tensor:
    """This rank's ``query[t, np, hn]``, ``key/value[t, ng, hn(_v)]`` -> ``[t, np * hn_v]``."""
    cp_size, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    sources = (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
    layout = _layout(query.shape[0], sources, cp_size, cp_rank, causal, query.device)
    dim_k = key.shape[-1]
    gathered = _GatherRows.apply(torch.cat([key, value], dim=-1), cp_group)
    heads, dim_v = query.shape[1], value.shape[-1]
    out = query.new_zeros(query.shape[0], heads * dim_v)
    if layout.q_rows.numel() == 0:
        # Only padding here: the gather stays in the graph (its backward is a collective the
        # other ranks join) and the inputs get zero gradients, as TE's kernels give them.
        return out + gathered.narrow(0, 0, 0).sum() + query.narrow(0, 0, 0).sum()
    rows = gathered.index_select(0, layout.kv_rows)
    chunks = packed_attention(
        query.index_select(0, layout.q_rows),
        rows[..., :dim_k],
        rows[..., dim_k:],
        cu_seqlens_q=layout.cu_q,
        cu_seqlens_kv=layout.cu_kv,
        causal=False,
        softmax_scale=softmax_scale,
        dropout_p=dropout_p,
        window_size=(-1, 0) if causal else None,
        implementation=_implementation(implementation, query, value, causal),
    )
    return out.index_copy(0, layout.q_rows, chunks)


def _implementation(
    requested: str | None, query: Tensor, value: Tensor, causal: bool
) -> str | None:
    """The caller's choice, else ``flash`` only where its windows align bottom-right; an
    explicit ``flash`` whose windows align top-left raises (its chunks would be wrong)."""
    name = requested_implementation(requested)
    if name not in ("auto", "flash") or not (causal and query.is_cuda):
        return requested
    if flash_unavailable(query, value, (-1, 0)) is not None:
        return requested  # auto takes sdpa_loop; flash raises there with the reason
    reason = _bottom_right_probe(query.device.index, query.dtype, query.shape[-1])
    if reason is None:
        return requested
    if name == "flash":
        raise ValueError(f"packed context-parallel attention: 'flash' was requested but {reason}")
    log_fallback_once(
        f"packed-cp:{reason}", f"packed context-parallel attention: {reason}; using sdpa_loop"
    )
    return "sdpa_loop"


@functools.lru_cache(maxsize=8)
def _bottom_right_probe(device_index: int | None, dtype: torch.dtype, dim: int) -> str | None:
    """The flash kernel on one query row against two keys under the window (-1, 0):
    bottom-right alignment lets it see both keys (top-left only the first). None when it may
    run the chunks."""
    device = torch.device("cuda", device_index)
    q = torch.ones(1, 2, dim, device=device, dtype=dtype)
    k = torch.ones(2, 2, dim, device=device, dtype=dtype)
    v = torch.tensor([0.0, 2.0], device=device, dtype=dtype).view(2, 1, 1).expand(2, 2, dim)
    try:
        out = packed_attention(
            q, k, v.contiguous(),
            cu_seqlens_q=torch.tensor([0, 1], device=device, dtype=torch.int32),
            cu_seqlens_kv=torch.tensor([0, 2], device=device, dtype=torch.int32),
            causal=False, softmax_scale=None, window_size=(-1, 0), implementation="flash",
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - any failure means "use the fallback"
        return f"the varlen flash kernel failed a probe ({type(exc).__name__}: {exc})"[:300]
    if abs(float(out.float().mean()) - 1.0) > 1e-2:  # both keys: mean of 0 and 2
        return "the varlen flash kernel aligns windows top-left"
    return None
