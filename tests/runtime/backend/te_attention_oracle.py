"""TE ``DotProductAttention``'s math, written out for the parity tests: dense float64 scores and
a visibility mask built key by key from TE's documented rules, sharing no code with
``backend.te_sdpa`` (an oracle built from the helpers under test would agree with their bugs).

TE's rules, for query ``i`` of ``sq`` and key ``j`` of ``sk`` (``d = sk - sq``):
* ``causal``: ``j <= i`` (top-left); ``causal_bottom_right``: ``j <= i + d``;
* ``window_size=(left, right)``: ``i + d - left <= j <= i + d + right``, a negative bound is
  unbounded, and a causal type forces ``right = 0`` (the window replaces the triangle);
* ``padding`` / ``padding_causal`` / ``arbitrary``: ``attention_mask`` (True = masked) as well;
  a causal type ignores any mask it is given;
* a query that sees no key outputs zeros.
"""

from __future__ import annotations

import math

import torch

CAUSAL = ("causal", "padding_causal", "causal_bottom_right")
MASKED = ("padding", "padding_causal", "arbitrary")


def visible(sq: int, sk: int, mask_type: str, window_size: tuple[int, int] | None) -> torch.Tensor:
    """``[sq, sk]`` bool, True where query i may attend to key j (no attention_mask)."""
    d = sk - sq
    keep = torch.ones(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            if window_size is not None:
                left, right = window_size
                if mask_type in CAUSAL:
                    right = 0
                if left >= 0 and j < i + d - left:
                    keep[i, j] = False
                if right >= 0 and j > i + d + right:
                    keep[i, j] = False
            elif mask_type in ("causal", "padding_causal") and j > i:
                keep[i, j] = False
            elif mask_type == "causal_bottom_right" and j > i + d:
                keep[i, j] = False
    return keep


def attention_reference_te(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask_type: str,
    attention_mask: torch.Tensor | None = None,
    attention_bias: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``query[sq, b, np, hn]``, ``key/value[sk, b, ng, hn(_v)]`` -> ``[sq, b, np * hn_v]`` in
    the query's dtype, computed in float64 (no dropout)."""
    sq, b, heads, dim = query.shape
    sk, groups = key.shape[0], key.shape[2]
    per_group = heads // groups
    scale = 1.0 / math.sqrt(dim) if softmax_scale is None else softmax_scale
    q = query.double().permute(1, 2, 0, 3)  # [b, np, sq, hn]
    k = key.double().permute(1, 2, 0, 3).repeat_interleave(per_group, dim=1)
    v = value.double().permute(1, 2, 0, 3).repeat_interleave(per_group, dim=1)
    scores = q @ k.transpose(-1, -2) * scale  # [b, np, sq, sk]
    if attention_bias is not None:
        scores = scores + attention_bias.double()
    keep = visible(sq, sk, mask_type, window_size).to(query.device).expand(b, heads, sq, sk)
    if mask_type in MASKED and attention_mask is not None:
        keep = keep & ~attention_mask.to(torch.bool)
    scores = scores.masked_fill(~keep, float("-inf"))
    sees_a_key = keep.any(dim=-1, keepdim=True)
    probs = torch.where(sees_a_key, torch.softmax(scores, dim=-1), torch.zeros_like(scores))
    context = (probs @ v).permute(2, 0, 1, 3)  # [sq, b, np, hn_v]
    return context.reshape(sq, b, heads * value.shape[-1]).to(query.dtype)
