"""TE's mask semantics on torch SDPA, for ``[s, b, heads, dim]`` tensors.

TransformerEngine's ``DotProductAttention`` takes a mask *type* per call and, for padding
types, a bool mask with True = masked; a causal type ignores any mask it is given (Megatron's
data loader still builds one). This module turns that contract into one
``scaled_dot_product_attention`` call that never materialises the score matrix:

* ``causal`` -> ``is_causal`` (top-left aligned, as TE's ``causal``);
* ``causal_bottom_right`` -> torch's lower-right causal bias (no mask tensor);
* ``padding`` / ``arbitrary`` -> the given mask; ``padding_causal`` -> mask | causal;
* ``no_mask`` -> nothing; a sliding ``window_size=(left, right)`` -> a banded bool mask;
* ``attention_bias`` (TE's ``post_scale_bias``) -> an additive float mask, causal folded in.

A query row with every key masked gets a zero output (TE's fused kernels do the same; SDPA
alone would return NaN). ``MEGATRON_ROCM_SDPA_BACKENDS`` (comma list of ``cudnn``, ``flash``,
``efficient``, ``math``) fixes SDPA's kernel priority for benchmarks and A/B runs.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from megatron_rocm.runtime import settings
from megatron_rocm.runtime.kernels.launch import is_hip, log_fallback_once
from megatron_rocm.runtime.kernels.local_sdpa import grouped_kv_for_sdpa

BACKENDS_ENV = "MEGATRON_ROCM_SDPA_BACKENDS"
MASK_TYPES = frozenset(
    {"causal", "causal_bottom_right", "padding", "padding_causal", "arbitrary", "no_mask"}
)


@functools.cache
def mask_name(mask_type: object) -> str:
    """An ``AttnMaskType`` (or its name) as its name: ``causal``, ``no_mask``, ..."""
    return str(getattr(mask_type, "name", mask_type))


def _backend_priority(spec: str) -> tuple[object, ...]:
    from torch.nn.attention import SDPBackend

    names = {
        "cudnn": "CUDNN_ATTENTION",
        "flash": "FLASH_ATTENTION",
        "efficient": "EFFICIENT_ATTENTION",
        "math": "MATH",
    }
    chosen = []
    for item in (s.strip().lower() for s in spec.split(",") if s.strip()):
        if item not in names:
            raise ValueError(
                f"{BACKENDS_ENV}={spec!r}: unknown SDPA backend {item!r}; use {sorted(names)}"
            )
        chosen.append(getattr(SDPBackend, names[item]))
    return tuple(chosen)


def check_platform(spec: str, source: str = BACKENDS_ENV) -> None:
    """ROCm builds of torch have no cuDNN: a list of nothing but ``cudnn`` there raises in one
    line (torch would end in "No available kernel"); ``cudnn`` beside others is skipped, logged.
    """
    names = {s.strip().lower() for s in spec.split(",") if s.strip()}
    if "cudnn" not in names or not is_hip():
        return
    if names == {"cudnn"}:
        raise ValueError(
            f"{source}={spec!r}: ROCm builds of torch have no cuDNN attention; "
            "use flash, efficient or math"
        )
    log_fallback_once("sdpa-cudnn-rocm", f"{source}={spec!r}: no cuDNN on ROCm, skipping it")


def requested_backends() -> str:
    """``MEGATRON_ROCM_SDPA_BACKENDS`` ("" if unset), checked: each name must be a kernel, and
    one this platform has."""
    spec = ",".join(settings.get(BACKENDS_ENV))  # type: ignore[call-overload]
    check_platform(spec)
    return spec


@contextlib.contextmanager
def sdpa_backends(spec: str) -> Iterator[None]:
    """torch SDPA limited to ``spec``'s kernels (``"cudnn,efficient"``), tried in that order."""
    from torch.nn.attention import sdpa_kernel

    check_platform(spec)
    with sdpa_kernel(list(_backend_priority(spec)), set_priority=True):
        yield


def _kernels_for(kernels: str | None, masked: bool) -> contextlib.AbstractContextManager[None]:
    """``kernels`` (what ``--attention-backend`` names), else ``MEGATRON_ROCM_SDPA_BACKENDS``'
    priority, else a bare ``nullcontext`` (this runs per layer and micro-batch, on the host).

    SDPA's flash kernel takes no mask tensor, where TE's flash attention unpads a padding mask
    and bands a window itself; so masked attention asked to run on flash runs on the
    memory-efficient kernel, logged once, rather than failing where TE would run."""
    if kernels is None:
        spec = requested_backends()
        return sdpa_backends(spec) if spec else contextlib.nullcontext()
    if kernels == "flash" and masked:
        log_fallback_once(
            "sdpa-flash-masked",
            "--attention-backend flash: SDPA's flash kernel takes no mask tensor, so attention "
            "with a padding, arbitrary or sliding-window mask or a bias runs on the "
            "memory-efficient kernel",
        )
        kernels = "efficient"
    return sdpa_backends(kernels)


def _band(sq: int, sk: int, left: int, right: int, device: torch.device) -> torch.Tensor:
    """Keep-mask of a bottom-right aligned band: key j visible to query i when
    ``-left <= j - i - (sk - sq) <= right`` (negative ``left``/``right`` mean unbounded)."""
    rows = torch.arange(sq, device=device).unsqueeze(1)
    cols = torch.arange(sk, device=device).unsqueeze(0)
    offset = cols - rows - (sk - sq)
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= offset >= -left
    if right >= 0:
        keep &= offset <= right
    return keep


def _causal_keep(sq: int, sk: int, device: torch.device, bottom_right: bool) -> torch.Tensor:
    """Keep-mask of causal attention, top-left (TE's ``causal``) or bottom-right aligned."""
    ones = torch.ones(sq, sk, dtype=torch.bool, device=device)
    return ones.tril(sk - sq if bottom_right else 0)


def sdpa_sbhd(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask_type: str,
    attention_mask: torch.Tensor | None = None,
    attention_bias: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    window_size: tuple[int, int] | None = None,
    kernels: str | None = None,
) -> torch.Tensor:
    """``query[sq, b, np, hn]``, ``key/value[sk, b, ng, hn(_v)]`` -> ``[sq, b, np * hn_v]``.

    ``kernels``: the SDPA kernels ``--attention-backend`` names (``backend.attention_backend_flag``);
    None: ``MEGATRON_ROCM_SDPA_BACKENDS``, else torch's choice."""
    if mask_type not in MASK_TYPES:
        raise ValueError(f"unsupported attention mask type {mask_type!r}")
    sq, b, heads, dim = query.shape
    sk, groups = key.shape[0], key.shape[2]
    if heads % groups:
        raise ValueError(f"{heads} query heads are not a multiple of {groups} kv groups")
    scale = 1.0 / math.sqrt(dim) if softmax_scale is None else softmax_scale
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, n, s, d] views
    k, v, gqa = grouped_kv_for_sdpa(k, v, heads)

    causal = mask_type in ("causal", "padding_causal", "causal_bottom_right")
    keep: torch.Tensor | None = None  # SDPA convention: True = attend
    if mask_type in ("padding", "padding_causal", "arbitrary") and attention_mask is not None:
        keep = ~attention_mask.to(torch.bool)
    if window_size is not None:
        left, right = window_size
        band = _band(sq, sk, left, 0 if causal else right, query.device)
        keep = band if keep is None else keep & band
    elif causal and (keep is not None or attention_bias is not None or sq != sk):
        tri = _causal_keep(sq, sk, query.device, mask_type == "causal_bottom_right")
        keep = tri if keep is None else keep & tri
    is_causal = causal and keep is None and sq == sk and sq > 1

    attn_mask: torch.Tensor | None = keep
    dead_rows: torch.Tensor | None = None
    if keep is not None:
        dead_rows = ~keep.any(dim=-1, keepdim=True)  # [.., sq, 1]
        if attention_bias is None:
            attn_mask = keep | dead_rows  # keep SDPA finite; those rows are zeroed below
    if attention_bias is not None:
        bias = attention_bias.to(query.dtype)
        if keep is not None:
            bias = bias.masked_fill(~(keep | dead_rows), float("-inf"))
        attn_mask = bias
    with _kernels_for(kernels, attn_mask is not None):
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            **gqa,
        )
    if dead_rows is not None:
        out = out.masked_fill(dead_rows, 0.0)
    # [b, np, sq, hv] -> [sq, b, np * hv], contiguous: the projection after it may call .view()
    return out.permute(2, 0, 1, 3).contiguous().view(sq, b, heads * value.shape[-1])
