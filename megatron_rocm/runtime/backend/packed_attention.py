"""Packed-sequence (THD) attention: what TransformerEngine does for ``qkv_format="thd"``.

Upstream's packed path hands attention ``query[t, np, hn]`` and ``key/value[t, ng, hn]`` with
``cu_seqlens`` (cumulative document lengths, int32 ``[n+1]``) and optionally
``cu_seqlens_*_padded`` (cumulative *storage* offsets: document ``i`` occupies rows
``[padded[i], padded[i] + len_i)`` and the rows after it up to ``padded[i+1]`` are padding).
Every document attends only to itself; padding is never attended; output and gradients at
padding rows (and at rows past the last document) are zero, as TE's fused backend zero-fills
them. No ``t x t`` mask is ever built.

Implementations (``implementation=`` argument or ``MEGATRON_ROCM_PACKED_ATTENTION``):

* ``flash``: ``torch.ops.aten._flash_attention_forward`` with ``cum_seq_q/k`` (FlashAttention-2
  varlen on CUDA, AOTriton/CK on ROCm builds that have varlen) through its native autograd.
  GQA, scale, sliding window and dropout are native. ``torch.nn.attention.varlen.varlen_attn``
  wraps the same kernel but its signature changed in every release since 2.9 (``is_causal`` ->
  ``window_size``, GQA only from 2.12) and it has no dropout, so the aten op is called directly.
* ``flex``: flex attention with a document block mask (see ``packed_flex``); compiled on GPU.
* ``sdpa_loop``: one SDPA call per document (one host sync for the lengths); always works.
* ``reference``: fp32 math per document (the CPU oracle; no dropout).

``auto`` takes ``flash`` when a one-time probe of the kernel (forward and backward, on tiny
inputs of the same dtype, heads and options) passes, else ``sdpa_loop`` with the reason logged
once. An explicit request runs exactly that implementation or raises.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from megatron_rocm.runtime import settings
from megatron_rocm.runtime.backend.packed_plan import PackedPlan, build_plan, rows_mask
from megatron_rocm.runtime.kernels._runtime import log_fallback_once, logger
from megatron_rocm.runtime.kernels.attention import attention_reference, sdpa_attention

ENV_VAR = "MEGATRON_ROCM_PACKED_ATTENTION"
IMPLEMENTATIONS = settings.choices(ENV_VAR)[1:]  # after "auto"
_last_impl: str | None = None


def last_implementation() -> str | None:
    """The implementation the most recent ``packed_attention`` call ran (None before any)."""
    return _last_impl


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    max_seqlen_q: int | torch.Tensor | None = None,
    max_seqlen_kv: int | torch.Tensor | None = None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_kv_padded: torch.Tensor | None = None,
    causal: bool,
    softmax_scale: float | None,
    dropout_p: float = 0.0,
    window_size: tuple[int, int] | None = None,
    implementation: str | None = None,
) -> torch.Tensor:
    """THD attention: ``query[t, np, hn]``, ``key/value[t_kv, ng, hn(_v)]`` -> ``[t, np * hn_v]``.

    ``max_seqlen_*`` are accepted for TE parity and not needed: the plan reads the offsets
    once per batch (one small host copy shared by all layers) and takes the exact maxima.
    ``window_size=(left, right)`` as in Megatron/TE,
    -1 = unbounded; with ``causal`` the right side is 0. Causal attention is aligned top-left
    and needs equal query and key lengths per document (self-attention).
    """
    global _last_impl
    _check_shapes(query, key, value)
    scale = 1.0 / math.sqrt(query.shape[-1]) if softmax_scale is None else float(softmax_scale)
    window = _normalize_window(window_size, causal)
    plan = build_plan(
        query.shape[0],
        key.shape[0],
        cu_seqlens_q,
        cu_seqlens_kv,
        cu_seqlens_q_padded,
        cu_seqlens_kv_padded,
        causal=causal,
        device=query.device,
    )
    name = _choose(implementation, query, value, causal, window, dropout_p)
    _last_impl = name
    if name == "flash":
        out = _flash(query, key, value, plan, causal, scale, dropout_p, window)
    elif name == "flex":
        from megatron_rocm.runtime.backend.packed_flex import flex_packed_attention

        out = flex_packed_attention(query, key, value, plan, causal, scale, window)
    elif name == "sdpa_loop":
        out = _per_document(query, key, value, plan, causal, scale, window, dropout_p, _sdpa_doc)
    else:
        out = _per_document(query, key, value, plan, causal, scale, window, 0.0, _reference_doc)
    return out.reshape(query.shape[0], -1)


def packed_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    """``packed_attention`` with the fp32 per-document reference math (the parity oracle)."""
    return packed_attention(query, key, value, implementation="reference", **kwargs)


# --------------------------------------------------------------------------- selection


def requested_implementation(implementation: str | None) -> str:
    """The implementation asked for (argument, else the environment variable), or "auto"."""
    if not implementation:
        return str(settings.get(ENV_VAR))
    if implementation != "auto" and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"unknown packed attention implementation {implementation!r} (from the "
            f"argument); use auto or one of {', '.join(IMPLEMENTATIONS)}"
        )
    return implementation


def _choose(
    implementation: str | None,
    query: torch.Tensor,
    value: torch.Tensor,
    causal: bool,
    window: tuple[int, int] | None,
    dropout_p: float,
) -> str:
    name = requested_implementation(implementation)
    if name in ("flex", "reference") and dropout_p > 0.0:
        raise NotImplementedError(
            f"packed attention {name!r} has no dropout; use attention dropout 0 or the "
            f"flash / sdpa_loop implementation"
        )
    if name == "flash":
        reason = flash_unavailable(query, value, window)
        if reason:
            raise RuntimeError(f"packed attention 'flash' was requested but {reason}")
    if name != "auto":
        return name
    reason = flash_unavailable(query, value, window)
    if reason is None:
        key = (query.device.index, query.dtype, query.shape[1], value.shape[1],
               query.shape[2], causal, window is not None)  # fmt: skip
        reason = _flash_probe(*key)
    if reason is None:
        return "flash"
    if query.is_cuda:
        log_fallback_once(f"packed-flash:{reason}", f"packed attention uses sdpa_loop: {reason}")
    return "sdpa_loop"


def _flash_op_args() -> frozenset[str]:
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None:
        return frozenset()
    return frozenset(a.name for a in op.default._schema.arguments)


def flash_unavailable(
    query: torch.Tensor, value: torch.Tensor, window: tuple[int, int] | None
) -> str | None:
    """Why the varlen flash kernel cannot take these inputs (None: it can)."""
    if not query.is_cuda:
        return "the tensors are not on a GPU"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"flash attention needs fp16/bf16, got {query.dtype}"
    hn, hn_v = query.shape[-1], value.shape[-1]
    if hn != hn_v or hn % 8 or hn > 256:
        return f"flash attention needs equal q/v head dims, a multiple of 8, <= 256 ({hn}, {hn_v})"
    args = _flash_op_args()
    if "cum_seq_q" not in args:
        return f"torch {torch.__version__} has no aten._flash_attention_forward varlen op"
    if window is not None and "window_size_left" not in args:
        return f"torch {torch.__version__}'s flash op has no sliding window"
    return None


@functools.lru_cache(maxsize=64)
def _flash_probe(
    device_index: int | None, dtype: torch.dtype, heads: int, groups: int, dim: int,
    causal: bool, windowed: bool,
) -> str | None:  # fmt: skip
    """Run the kernel once, forward and backward, on two tiny documents (None: it works)."""
    device = torch.device("cuda", device_index)
    try:
        with torch.enable_grad():
            q = torch.randn(8, heads, dim, device=device, dtype=dtype, requires_grad=True)
            kv = torch.randn(8, groups, dim, device=device, dtype=dtype, requires_grad=True)
            cu = torch.tensor([0, 3, 8], device=device, dtype=torch.int32)
            window = (2, 0 if causal else 2) if windowed else None
            out = _flash_kernel(q, kv, kv, cu, cu, 5, 5, 0.0, causal, dim**-0.5, window)
            out.float().sum().backward()
        torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - any failure means "use the fallback"
        return f"the varlen flash kernel failed a probe ({type(exc).__name__}: {exc})"[:300]
    logger.info("megatron-rocm: packed attention uses the varlen flash kernel")
    return None


# --------------------------------------------------------------------------- flash


def _flash_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    max_q: int, max_k: int, dropout_p: float, causal: bool, scale: float,
    window: tuple[int, int] | None,
) -> torch.Tensor:  # fmt: skip
    """The aten varlen flash kernel (differentiable through its registered backward)."""
    extra: dict[str, Any] = {"scale": scale}
    if window is not None:
        extra["window_size_left"], extra["window_size_right"] = window
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, False, **extra
    )[0]


class _ZeroGradRows(torch.autograd.Function):
    """Identity forward; zeroes gradient rows the kernel never writes (padding, the tail)."""

    @staticmethod
    def forward(ctx: Any, valid_q: torch.Tensor, valid_kv: torch.Tensor, *qkv: torch.Tensor):  # noqa: ANN205
        ctx.save_for_backward(valid_q, valid_kv)
        return tuple(x.view_as(x) for x in qkv)

    @staticmethod
    def backward(ctx: Any, gq: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor):  # noqa: ANN205
        valid_q, valid_kv = ctx.saved_tensors
        return (
            None,
            None,
            _zero_rows(gq, valid_q),
            _zero_rows(gk, valid_kv),
            _zero_rows(gv, valid_kv),
        )


def _zero_rows(x: torch.Tensor | None, valid: torch.Tensor) -> torch.Tensor | None:
    return None if x is None else x.masked_fill(~valid.view(-1, 1, 1), 0)


def _flash(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: PackedPlan,
    causal: bool, scale: float, dropout_p: float, window: tuple[int, int] | None,
) -> torch.Tensor:  # fmt: skip
    if plan.direct:
        # Documents stored back to back (or causal with padding after each document, which no
        # real token can see): run on the storage offsets, zero what the kernel leaves behind.
        valid_q = rows_mask(plan, "q")
        valid_kv = rows_mask(plan, "kv")
        q, k, v = _ZeroGradRows.apply(valid_q, valid_kv, query, key, value)
        q, k, v = (x.contiguous() for x in (q, k, v))
        maxima = plan.max_stored("q"), plan.max_stored("kv")
        out = _flash_kernel(
            q, k, v, plan.offsets_q, plan.offsets_kv, *maxima, dropout_p, causal, scale, window
        )
        return out.masked_fill(~valid_q.view(-1, 1, 1), 0)
    # Padding a non-causal query could see: gather the real tokens, attend, scatter back.
    idx_q, idx_kv = plan.gather_index("q"), plan.gather_index("kv")
    q = query.index_select(0, idx_q).contiguous()
    k, v = (x.index_select(0, idx_kv).contiguous() for x in (key, value))
    maxima = plan.max_len("q"), plan.max_len("kv")
    out = _flash_kernel(q, k, v, plan.cu_q, plan.cu_kv, *maxima, dropout_p, causal, scale, window)
    zeros = out.new_zeros(query.shape[0], *out.shape[1:])
    return zeros.index_copy(0, idx_q, out)


# --------------------------------------------------------------------------- per document


def _per_document(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: PackedPlan, causal: bool,
    scale: float, window: tuple[int, int] | None, dropout_p: float, attend: Callable[..., torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """Attend each document on its own; zero blocks fill the padding (autograd through cat)."""
    heads, dim_v = query.shape[1], value.shape[-1]
    pieces: list[torch.Tensor] = []
    row = 0
    for start_q, len_q, start_kv, len_kv in plan.documents():
        if len_q == 0:
            continue
        if start_q > row:
            pieces.append(query.new_zeros(start_q - row, heads, dim_v))
        q = query[start_q : start_q + len_q].unsqueeze(1)
        k = key[start_kv : start_kv + len_kv].unsqueeze(1)
        v = value[start_kv : start_kv + len_kv].unsqueeze(1)
        if len_kv == 0:  # nothing to attend to: zeros, as the flash kernel gives
            pieces.append(query.new_zeros(len_q, heads, dim_v))
        else:
            pieces.append(attend(q, k, v, causal, scale, window, dropout_p))
        row = start_q + len_q
    if row < query.shape[0]:
        pieces.append(query.new_zeros(query.shape[0] - row, heads, dim_v))
    return torch.cat(pieces) if pieces else query.new_zeros(0, heads, dim_v)


def _doc_window(window: tuple[int, int] | None, len_q: int, len_kv: int) -> tuple[int, int] | None:
    """-1 (unbounded) -> the document length, the form the dense window mask takes."""
    if window is None:
        return None
    bound = max(len_q, len_kv)
    return tuple(bound if w < 0 else w for w in window)  # type: ignore[return-value]


def _same_head_dims(q, k, v):  # noqa: ANN001, ANN202
    """Zero-pad q/k or v to one head dim: ``sdpa_attention`` and ``attention_reference`` shape
    their output with the query's head dim. Zero channels change no score and add zero
    outputs, which the caller slices off."""
    dim = max(q.shape[-1], v.shape[-1])
    pad = torch.nn.functional.pad
    return tuple(x if x.shape[-1] == dim else pad(x, (0, dim - x.shape[-1])) for x in (q, k, v))


def _sdpa_doc(q, k, v, causal, scale, window, dropout_p):  # noqa: ANN001, ANN202
    mask_type = "causal" if causal else "no_mask"
    win = _doc_window(window, q.shape[0], k.shape[0])
    dim_v, heads = v.shape[-1], q.shape[2]
    qp, kp, vp = _same_head_dims(q, k, v)
    out = sdpa_attention(qp, kp, vp, None, mask_type, scale, dropout_p, window_size=win)
    return out.view(q.shape[0], heads, -1)[..., :dim_v]


def _reference_doc(q, k, v, causal, scale, window, dropout_p):  # noqa: ANN001, ANN202
    mask_type = "causal" if causal else "no_mask"
    win = _doc_window(window, q.shape[0], k.shape[0])
    dim_v, heads = v.shape[-1], q.shape[2]
    qp, kp, vp = _same_head_dims(q, k, v)
    out = attention_reference(qp, kp, vp, None, mask_type, scale, window_size=win)
    return out.view(q.shape[0], heads, -1)[..., :dim_v]


# --------------------------------------------------------------------------- checks


def _check_shapes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError(
            f"packed attention takes [t, heads, dim] tensors, got {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    if key.shape[:2] != value.shape[:2] or key.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} do not match query "
            f"{tuple(query.shape)}"
        )
    if query.shape[1] % key.shape[1]:
        raise ValueError(
            f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} groups"
        )


def _normalize_window(window: tuple[int, int] | None, causal: bool) -> tuple[int, int] | None:
    """None when nothing is cut off; else (left, right) with -1 for an unbounded side."""
    if window is None:
        return None
    left, right = (int(w) for w in window)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1, got {window}")
    if causal:
        right = 0
    if left == -1 and (right == -1 or causal):
        return None
    return left, right
