"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` (SDPA).

The local spec's ``DotProductAttention`` (no TransformerEngine) materialises the full
``[b, np, sq, sk]`` score matrix, softmaxes it and multiplies again; SDPA dispatches to the
flash / memory-efficient kernels of the torch build (aotriton or CK on ROCm), which never
store the scores. ``sdpa_attention`` takes and returns Megatron's layouts and reproduces the
local path's mask semantics:

* Megatron masks are bool with ``True`` = masked; SDPA's bool masks are ``True`` = keep.
* causal: the upper-triangular mask (``is_causal``), the given mask ignored, as Megatron's
  fused causal softmax does; ``sq == 1`` (decode with a KV cache) attends to every key;
  ``sq != sk`` with a mask uses the mask (the unfused path's behaviour).
* padding / arbitrary / no_mask: the mask is applied when given. Megatron fills masked
  scores with -10000 rather than -inf, so a fully masked query row attends uniformly to all
  keys; that row's output is ``mean(value)`` here too (SDPA alone would give NaN or zeros).
* ``window_size=(left, right)`` builds Megatron's sliding-window causal mask.
* GQA (fewer kv heads): see ``grouped_kv_for_sdpa``.

Types SDPA cannot express exactly (``padding_causal`` and ``causal_bottom_right`` keep the
local path's odd semantics; float masks; softmax with an offset) make ``sdpa_supported``
false and the caller keeps the upstream implementation. Dropout uses the current RNG state:
callers fork Megatron's CUDA RNG tracker around the call, as the local path does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from megatron_rocm.runtime import settings
from megatron_rocm.runtime.kernels._runtime import is_hip

# Megatron's AttnMaskType values (megatron/core/transformer/enums.py, 0.12 .. main).
_MASK_TYPE_NAMES = {
    1: "padding",
    2: "causal",
    3: "no_mask",
    4: "padding_causal",
    5: "arbitrary",
    6: "causal_bottom_right",
}
_SUPPORTED = frozenset({"padding", "causal", "no_mask", "arbitrary"})


def sdpa_enabled() -> bool:
    """``MEGATRON_ROCM_LOCAL_SDPA`` (the local spec's switch; old name ``MEGATRON_ROCM_SDPA``):
    on (the default) or off, read at every call (tests and A/B runs); a value that is not a
    boolean is an error, not "on"."""
    return bool(settings.get("MEGATRON_ROCM_LOCAL_SDPA"))


def _mask_type_name(attn_mask_type: Any) -> str:
    """Megatron's ``AttnMaskType`` member, its name, or its int value -> the name."""
    name = getattr(attn_mask_type, "name", None)
    if name is not None:
        return str(name)
    if isinstance(attn_mask_type, int):
        return _MASK_TYPE_NAMES.get(attn_mask_type, str(attn_mask_type))
    return str(attn_mask_type)


def sdpa_supported(
    attn_mask_type: Any,
    attention_mask: torch.Tensor | None,
    *,
    softmax_type: str = "vanilla",
) -> bool:
    """Whether ``sdpa_attention`` computes exactly what the local ``DotProductAttention`` does."""
    if _mask_type_name(attn_mask_type) not in _SUPPORTED or softmax_type != "vanilla":
        return False
    if attention_mask is None:
        return True
    return attention_mask.dtype == torch.bool and attention_mask.dim() == 4


def _sliding_window_mask(
    sq: int, sk: int, window_size: tuple[int, int], device: torch.device
) -> torch.Tensor:
    """Megatron's ``get_sliding_window_causal_mask`` (True = masked) for ``[sq, sk]``."""
    rows = torch.arange(sq, device=device).unsqueeze(1)
    cols = torch.arange(sk, device=device).unsqueeze(0)
    offset = cols - rows - (sk - sq)  # 0 on the bottom-right aligned diagonal
    keep = (offset >= -window_size[0]) & (offset <= window_size[1])
    return ~keep


def _gqa_supported() -> bool:
    """SDPA grew ``enable_gqa`` in torch 2.5 (a builtin: no ``inspect.signature``)."""
    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


def grouped_kv_for_sdpa(
    key: torch.Tensor, value: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, bool]]:
    """Key/value in ``[b, groups, s, d]`` ready for SDPA with ``heads`` query heads.

    ``enable_gqa`` on CUDA torch >= 2.5; on ROCm the kv heads are expanded, because the ROCm
    flash/efficient kernels of several torch releases reject grouped heads and SDPA would fall
    back to the unfused math kernel. Returns (key, value, extra SDPA keyword arguments).
    """
    groups = key.shape[1]
    if groups == heads:
        return key, value, {}
    if is_hip() or not _gqa_supported():
        repeat = heads // groups
        return key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1), {}
    return key, value, {"enable_gqa": True}


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    attn_mask_type: Any,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    *,
    window_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Attention on ``query[sq, b, np, hn]``, ``key/value[sk, b, ng, hn]`` -> ``[sq, b, np*hn]``.

    ``softmax_scale`` is the full scale of ``q @ k^T`` (Megatron's ``softmax_scale`` times the
    layer-number coefficient when ``apply_query_key_layer_scaling`` is on); default
    ``1/sqrt(hn)``. ``attention_mask`` is bool, True = masked, broadcastable to
    ``[b, np, sq, sk]``.
    """
    if not sdpa_supported(attn_mask_type, attention_mask):
        raise ValueError(
            f"sdpa_attention cannot express mask type {_mask_type_name(attn_mask_type)!r} with "
            f"this mask exactly; check sdpa_supported() first"
        )
    sq, b, heads, dim = query.shape
    sk, groups = key.shape[0], key.shape[2]
    if heads % groups:
        raise ValueError(f"{heads} query heads are not a multiple of {groups} kv groups")
    scale = 1.0 / math.sqrt(dim) if softmax_scale is None else softmax_scale

    # [s, b, n, h] -> [b, n, s, h]: views, SDPA only needs the head dim contiguous.
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
    k, v, gqa = grouped_kv_for_sdpa(k, v, heads)

    masked: torch.Tensor | None = None  # Megatron convention, True = masked
    is_causal = False
    kind = _mask_type_name(attn_mask_type)
    if window_size is not None:
        masked = _sliding_window_mask(sq, sk, window_size, query.device)
    elif kind == "causal" and (attention_mask is None or sq == sk):
        if sq == sk:
            is_causal = sq > 1
        elif sq > 1:
            raise ValueError(f"causal attention without a mask needs sq == sk, got {sq}, {sk}")
    else:
        masked = attention_mask

    keep = None
    fully_masked = None
    if masked is not None:
        fully_masked = masked.all(dim=-1, keepdim=True)  # [.., sq, 1]
        # Unmask fully masked rows so SDPA stays finite; their output is replaced below.
        keep = ~masked | fully_masked
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=keep, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **gqa
    )
    if fully_masked is not None:
        uniform = v.float().mean(dim=2, keepdim=True).to(out.dtype)  # [b, n|ng, 1, h]
        if uniform.shape[1] != heads:
            uniform = uniform.repeat_interleave(heads // groups, dim=1)
        # (With dropout Megatron also drops these uniform weights; such rows are padding.)
        out = torch.where(fully_masked, uniform, out)
    # [b, np, sq, hn] -> [sq, b, np*hn]
    # contiguous like Megatron's context: the projection after it may call .view().
    return out.permute(2, 0, 1, 3).contiguous().view(sq, b, heads * dim)


def attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    attn_mask_type: Any,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The local ``DotProductAttention`` math (no dropout): scores, -10000 fill, fp32 softmax."""
    sq, b, heads, dim = query.shape
    sk, groups = key.shape[0], key.shape[2]
    key = key.repeat_interleave(heads // groups, dim=2)
    value = value.repeat_interleave(heads // groups, dim=2)
    scale = 1.0 / math.sqrt(dim) if softmax_scale is None else softmax_scale
    scores = torch.einsum("qbnh,kbnh->bnqk", query.float(), key.float()) * scale
    mask = attention_mask
    if window_size is not None:
        mask = _sliding_window_mask(sq, sk, window_size, query.device)
    elif _mask_type_name(attn_mask_type) == "causal" and (mask is None or sq == sk):
        mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device).triu(1) if sq > 1 else None
    if mask is not None:
        scores = scores.masked_fill(mask, -10000.0)
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    context = torch.einsum("bnqk,kbnh->qbnh", probs.float(), value.float()).to(query.dtype)
    return context.reshape(sq, b, heads * dim)
