"""Packed (THD) attention through flex attention with a document block mask.

The block mask is built straight from the document offsets, block by block (``O((t/128)^2)``
small integer ops): ``create_block_mask`` would evaluate the mask function on the full
``t x t`` grid unless it is compiled too. Blocks inside one document (and below the diagonal
when causal, inside the window when windowed) are "full" and skip the mask function; blocks
that may hold an allowed pair are "partial"; the rest are never visited. Padding rows belong
to no document: flex gives them zero output and zero gradients.

On a GPU flex attention runs compiled (one ``torch.compile`` of ``flex_attention``; a new
total length ``t`` recompiles, dynamo turns the length dynamic after the second one). On the
CPU it runs eagerly, which materialises the scores: only for tests. No dropout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from megatron_rocm.runtime.backend.packed.plan import PackedPlan, rows_mask, segments

BLOCK = 128


@functools.lru_cache(maxsize=2)
def _flex(compiled: bool) -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if compiled else flex_attention


def _documents(plan: PackedPlan, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the storage segment (document span incl. its padding) and the document id
    (-1 for padding on the query side, -2 on the key side, so padding never matches)."""
    segment = segments(plan, side)
    return segment, torch.where(rows_mask(plan, side), segment, -1 if side == "q" else -2)


def _block_ranges(
    segment: torch.Tensor, valid: torch.Tensor, tail: int
) -> tuple[torch.Tensor, ...]:
    """Per 128-row block: first and last segment, and whether every row is real (rows past
    the end count as the tail segment ``tail``, which holds no document)."""
    pad = (-segment.numel()) % BLOCK
    seg = torch.nn.functional.pad(segment, (0, pad), value=tail)
    ok = torch.nn.functional.pad(valid, (0, pad), value=False).view(-1, BLOCK)
    seg = seg.view(-1, BLOCK)
    return seg[:, 0], seg[:, -1], ok.all(dim=1)


def _kv_blocks(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nq, nk] bool -> (counts [1,1,nq], indices [1,1,nq,nk]) with the chosen blocks first."""
    counts = allowed.sum(dim=1, dtype=torch.int32)
    order = torch.argsort((~allowed).to(torch.int8), dim=1, stable=True).to(torch.int32)
    return counts[None, None], order[None, None]


def document_block_mask(plan: PackedPlan, causal: bool, window: tuple[int, int] | None):  # noqa: ANN201 - BlockMask, imported lazily
    """The flex ``BlockMask`` of this batch's documents (cached on the plan)."""
    from torch.nn.attention.flex_attention import BlockMask

    key = f"flex_mask:{causal}:{window}"
    if key in plan._memo:
        return plan._memo[key]
    seg_q, doc_q = _documents(plan, "q")
    seg_kv, doc_kv = _documents(plan, "kv")
    left, right = window if window is not None else (-1, -1)

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        keep = doc_q[q_idx] == doc_kv[kv_idx]
        if causal:
            keep = keep & (q_idx >= kv_idx)
        if left >= 0:
            keep = keep & (q_idx - kv_idx <= left)
        if right >= 0 and not causal:
            keep = keep & (kv_idx - q_idx <= right)
        return keep

    tail = plan.cu_q.numel() - 1
    q_lo, q_hi, q_full = _block_ranges(seg_q, rows_mask(plan, "q"), tail)
    k_lo, k_hi, k_full = _block_ranges(seg_kv, rows_mask(plan, "kv"), tail)
    qb = torch.arange(q_lo.numel(), device=q_lo.device)[:, None] * BLOCK
    kb = torch.arange(k_lo.numel(), device=k_lo.device)[None, :] * BLOCK
    q_end, k_end = qb + BLOCK - 1, kb + BLOCK - 1
    some = (q_lo[:, None] <= k_hi[None, :]) & (k_lo[None, :] <= q_hi[:, None])
    every = (
        (q_lo == q_hi)[:, None]
        & (k_lo == k_hi)[None, :]
        & (q_lo[:, None] == k_lo[None, :])
        & q_full[:, None]
        & k_full[None, :]
    )
    if causal:
        some &= q_end >= kb
        every &= qb >= k_end
    if left >= 0:
        some &= qb - k_end <= left
        every &= q_end - kb <= left
    if right >= 0 and not causal:
        some &= kb - q_end <= right
        every &= k_end - qb <= right
    partial = some & ~every
    counts, indices = _kv_blocks(partial)
    full_counts, full_indices = _kv_blocks(every)
    mask = BlockMask.from_kv_blocks(
        counts, indices, full_counts, full_indices, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
        seq_lengths=(plan.t_q, plan.t_kv),
    )  # fmt: skip
    plan._memo[key] = mask
    return mask


def flex_packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: PackedPlan,
    causal: bool,
    scale: float,
    window: tuple[int, int] | None,
) -> torch.Tensor:
    """``[t, np, hn]`` x ``[t_kv, ng, hn]`` -> ``[t, np, hn_v]`` through flex attention."""
    if (causal or window is not None) and plan.host["off_q"] != plan.host["off_kv"]:
        raise NotImplementedError(
            "flex packed attention needs the same storage offsets for queries and keys when "
            "causal or windowed; use the flash or sdpa_loop implementation"
        )
    mask = document_block_mask(plan, causal, window)
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
    out = _flex(query.is_cuda)(
        q, k, v, block_mask=mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out[0].transpose(0, 1)
