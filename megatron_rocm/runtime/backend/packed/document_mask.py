"""``--reset-attention-mask`` data as packed documents: a block-causal mask -> ``cu_seqlens``.

With ``--reset-attention-mask`` upstream's GPT dataset builds a dense ``[b, 1, s, s]`` mask
(True = masked) that is causal inside each document and masks every earlier document. The
layer spec still says ``attn_mask_type=causal``, and TransformerEngine ignores the mask for
causal attention, so with TE the flag silently has no effect on attention. The local spec's
unfused softmax honours the mask; its fused causal kernel does not.

The native backend honours it without the ``s x s`` attention: ``documents_from_causal_mask``
recognises a block-causal mask and returns the document boundaries over the flattened
``b * s`` tokens, and ``block_causal_attention`` runs ``packed_attention`` on them. The mask is
read once per batch (cached on the tensor object: every layer gets the same mask). Reading it
synchronises with the GPU, so the plain causal mask of the default loader is recognised inside
that one cached read too: a check per layer cost the TE spec 4% of a 0.85B model's step.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from megatron_rocm.runtime.backend.packed.thd_attention import packed_attention


@dataclass(frozen=True)
class DocumentMask:
    """Documents of a ``[b, s]`` batch, flattened sample-major to ``b * s`` rows."""

    cu_seqlens: torch.Tensor  # int32 [n+1], on the mask's device
    max_seqlen: int
    plain_causal: bool  # one document per sample: the mask is just the causal mask


_last: list[tuple[weakref.ref, int, int, DocumentMask | None]] = []
# per mask shape, batch size and device: whether any mask read so far held documents
_documents_met: dict[tuple, bool] = {}


def documents_from_causal_mask(
    attention_mask: torch.Tensor, batch_size: int
) -> DocumentMask | None:
    """Documents of a block-causal mask ``[b|1, 1, s, s]`` (True = masked), else None.

    Block-causal: every query row ``i`` keeps exactly the keys ``[start_i, i]``, where
    ``start_i`` is ``start_{i-1}`` or ``i`` (a new document). Anything else (padding masks,
    arbitrary masks) returns None: the caller needs an explicit-mask path for it.
    """
    for ref, version, size, result in _last:
        if ref() is attention_mask and version == attention_mask._version and size == batch_size:
            return result
    result = _documents(attention_mask, batch_size)
    _last[:] = [(weakref.ref(attention_mask), attention_mask._version, batch_size, result)]
    key = _shape_key(attention_mask, batch_size)
    _documents_met[key] = _documents_met.get(key, False) or not (
        result is None or result.plain_causal
    )
    return result


def ignorable_when_captured(attention_mask: torch.Tensor, batch_size: int) -> bool:
    """Whether a causal-type mask met inside a CUDA-graph capture may be ignored, as TE would.

    The capture cannot read it (a host sync), and whatever is decided is what every replay
    runs. Megatron's ``--cuda-graph-impl local`` warms up eagerly first, so masks of this
    shape were read then: when none of them held documents (the default loader's plain causal
    mask), neither does this one. Documents (``--reset-attention-mask`` data) change with every
    batch, which no captured graph can follow, and a mask never read eagerly cannot be judged:
    both are a one-line error.
    """
    met = _documents_met.get(_shape_key(attention_mask, batch_size))
    if met is False:
        return True
    why = (
        "its documents (--reset-attention-mask data) change with every batch"
        if met
        else "no mask of its shape was read before the capture (eager warm-up steps read them)"
    )
    raise ValueError(
        "TEDotProductAttention: a causal attention mask cannot be read inside a CUDA graph "
        f"(--cuda-graph-impl): {why}; pass --no-create-attention-mask-in-dataloader for plain "
        "causal data, or leave CUDA graphs off"
    )


def _shape_key(mask: torch.Tensor, batch_size: int) -> tuple:
    return tuple(mask.shape), batch_size, mask.device


def _documents(mask: torch.Tensor, batch_size: int) -> DocumentMask | None:
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return None
    samples, _, s, s_k = mask.shape
    if s != s_k or samples not in (1, batch_size):
        return None
    if torch.equal(mask, _causal_mask(s, mask.device).expand_as(mask)):
        return _plain_causal(s, batch_size, mask.device)  # the default loader's mask
    rows = torch.arange(s, device=mask.device)
    starts = []
    for keep in (~mask[:, 0]).unbind(0):  # one sample at a time: a few s x s temporaries
        if keep.triu(1).any() or not keep.diagonal().all():
            return None
        first = keep.to(torch.uint8).argmax(dim=-1)
        if not torch.equal(keep.sum(dim=-1), rows - first + 1):
            return None  # a row keeps a non-contiguous set of keys
        if not ((first[1:] == first[:-1]) | (first[1:] == rows[1:])).all():
            return None  # a row starts a document somewhere other than at itself
        starts.append(first == rows)
    if samples == 1:
        starts = starts * batch_size
    begin = torch.cat(starts).nonzero().squeeze(1)
    end = torch.tensor([batch_size * s], device=mask.device)
    cu_seqlens = torch.cat([begin, end]).to(torch.int32)
    return DocumentMask(
        cu_seqlens=cu_seqlens,
        max_seqlen=int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
        plain_causal=cu_seqlens.numel() == batch_size + 1,
    )


@functools.lru_cache(maxsize=8)
def _causal_mask(s: int, device: torch.device) -> torch.Tensor:
    """Megatron's causal mask (True = masked) for ``s`` tokens, [1, 1, s, s]."""
    return torch.ones(s, s, dtype=torch.bool, device=device).triu(1).view(1, 1, s, s)


def _plain_causal(s: int, batch_size: int, device: torch.device) -> DocumentMask:
    """One document per sample."""
    step = torch.arange(0, (batch_size + 1) * s, s, device=device, dtype=torch.int32)
    return DocumentMask(cu_seqlens=step, max_seqlen=s, plain_causal=True)


def block_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    documents: DocumentMask,
    *,
    softmax_scale: float | None,
    dropout_p: float = 0.0,
    window_size: tuple[int, int] | None = None,
    implementation: str | None = None,
) -> torch.Tensor:
    """Causal attention within documents on Megatron's ``[s, b, heads, dim]`` -> ``[s, b, np*hn_v]``."""
    s, b = query.shape[:2]
    q, k, v = (x.transpose(0, 1).reshape(b * s, *x.shape[2:]) for x in (query, key, value))
    out = packed_attention(
        q,
        k,
        v,
        cu_seqlens_q=documents.cu_seqlens,
        cu_seqlens_kv=documents.cu_seqlens,
        max_seqlen_q=documents.max_seqlen,
        max_seqlen_kv=documents.max_seqlen,
        causal=True,
        softmax_scale=softmax_scale,
        dropout_p=dropout_p,
        window_size=window_size,
        implementation=implementation,
    )
    return out.view(b, s, -1).transpose(0, 1).contiguous()
