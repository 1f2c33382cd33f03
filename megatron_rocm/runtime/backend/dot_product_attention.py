"""TEDotProductAttention without TransformerEngine: flash / memory-efficient attention via SDPA.

Constructor and forward follow upstream's TE wrapper at every tag (``num_splits`` from 0.16,
``model_comm_pgs`` in 0.13-0.14, ``pg_collection`` later); the mask semantics are TE's (see
``backend.te_sdpa``). What TE does beyond that dispatches here:

* context parallelism (``config.context_parallel_size > 1``): ``backend.cp.dispatch``;
* packed sequences (``PackedSeqParams`` with ``qkv_format="thd"``): ``backend.packed.thd_attention``,
  and ``backend.packed.context_parallel`` under context parallelism;
* ``attention_bias`` (relative position embeddings): an additive float mask;
* a sliding window where ``window_size`` / ``window_attn_skip_freq`` put one on this layer;
* a block-causal mask under a causal mask type (``--reset-attention-mask`` data): attention
  within each document (``backend.packed.document_mask``); TE ignores that mask;
* ``--attention-backend`` flash / fused / unfused: the same family of kernels on every one of
  these paths (``backend.attention_backend_flag``).

Features that only TE's kernels have (non-vanilla softmax with sinks, returning the max logit for
QK-clip, ``num_splits`` or ``batch_invariant_mode`` for batch invariance) are refused in the
constructor with one clear line;
``backend.options`` refuses the flags behind them earlier, at argument validation.
``apply_query_key_layer_scaling`` has no effect, as with TE: it only guards fp16 overflow in an
unfused softmax, and SDPA accumulates in fp32.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any

import torch

from megatron_rocm.runtime.backend import attention_backend_flag as attention_backend
from megatron_rocm.runtime.backend.te_sdpa import mask_name, sdpa_sbhd
from megatron_rocm.runtime.platform import capturing

_OWNER = "TEDotProductAttention"


def _window_for_layer(config: Any, layer_number: int) -> tuple[int, int] | None:
    window = getattr(config, "window_size", None)
    if not window:
        return None
    try:
        from megatron.core.transformer.utils import is_layer_window_attention
    except ImportError:  # before 0.16 the window applies to every layer
        return tuple(window)
    skip = getattr(config, "window_attn_skip_freq", None)
    return tuple(window) if is_layer_window_attention(window, skip, layer_number) else None


def _offsets(params: Any) -> dict[str, torch.Tensor | None]:
    """The document offsets of a ``PackedSeqParams`` (the padded ones may be absent)."""
    return {
        "cu_seqlens_q": params.cu_seqlens_q,
        "cu_seqlens_kv": params.cu_seqlens_kv,
        "cu_seqlens_q_padded": getattr(params, "cu_seqlens_q_padded", None),
        "cu_seqlens_kv_padded": getattr(params, "cu_seqlens_kv_padded", None),
    }


def _cp_group(config: Any, groups: Any) -> Any:
    if groups is not None and getattr(groups, "cp", None) is not None:
        return groups.cp
    from megatron.core import parallel_state

    try:
        return parallel_state.get_context_parallel_group(check_initialized=False)
    except TypeError:  # tags whose getter has no check_initialized
        return parallel_state.get_context_parallel_group()


def _check_determinism(config: Any) -> None:
    """``config.deterministic_mode`` as upstream's TE wrapper holds it, for library users who
    build models without ``--deterministic-mode`` (which sets both switches below).

    Upstream raises unless ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``, TE's switch to its
    deterministic kernels. The native attention's kernels (SDPA's, the CP blocks') are
    deterministic under ``torch.use_deterministic_algorithms(True)`` instead: with neither
    switch this raises as upstream does; with TE's alone it says once that determinism
    follows torch's flag here."""
    if not getattr(config, "deterministic_mode", False):
        return
    if torch.are_deterministic_algorithms_enabled():
        return
    if os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1").strip() != "0":
        raise RuntimeError(
            f"{_OWNER}: deterministic_mode is on, but neither "
            "torch.use_deterministic_algorithms(True) (what --deterministic-mode sets) nor "
            "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 is; set one"
        )
    from megatron_rocm.runtime.kernels.launch import log_fallback_once

    log_fallback_once(
        "deterministic-mode-nvte",
        "deterministic_mode with NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 alone: that is "
        "TransformerEngine's switch; the native attention's backward is deterministic under "
        "torch.use_deterministic_algorithms(True), which --deterministic-mode sets",
    )


class TEDotProductAttention(torch.nn.Module):
    """Core attention with TE's constructor and forward contract, computed with torch SDPA."""

    cp_stream: Any = None  # TE keeps a class-level CP stream; kept for attribute parity
    # Upstream keeps the mask of a training call past the prompt (ModelOpt's EAGLE training
    # through a StaticInferenceContext) only with TE >= 2.2; this attention computes what TE's
    # does there (an arbitrary mask against the cached keys, TE's top-left causal where sq !=
    # sk), so the `modelopt-without-te` patch keeps it for this class too.
    keeps_mask_past_prompt = True

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        num_splits: int | None = None,
        cp_comm_type: str | None = "p2p",
        pg_collection: Any = None,
        model_comm_pgs: Any = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.qkv_format = "sbhd"
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        )
        self.attention_dropout = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.window_size = _window_for_layer(config, layer_number)
        self._refuse_te_only(config, num_splits)
        _check_determinism(config)
        self.kernels = attention_backend.resolve(config)  # --attention-backend
        groups = pg_collection if pg_collection is not None else model_comm_pgs
        self._tp_group = getattr(groups, "tp", None)
        self.cp_size = int(getattr(config, "context_parallel_size", 1) or 1)
        self.cp_comm_type = cp_comm_type or "p2p"
        self.cp_group = _cp_group(config, groups) if self.cp_size > 1 else None
        if self.cp_size > 1:
            from megatron_rocm.runtime.backend.cp.dispatch import SUPPORTED_CP_COMM_TYPES

            if self.cp_comm_type not in SUPPORTED_CP_COMM_TYPES:
                raise ValueError(
                    f"{_OWNER}: --cp-comm-type {self.cp_comm_type} is not supported by the "
                    f"native backend; use one of {', '.join(SUPPORTED_CP_COMM_TYPES)}"
                )
            heads = config.num_attention_heads // config.tensor_model_parallel_size
            if self.cp_comm_type == "a2a" and heads % self.cp_size:
                raise ValueError(
                    f"{_OWNER}: --cp-comm-type a2a needs the attention heads per tensor-parallel "
                    f"rank ({heads}) to be a multiple of --context-parallel-size {self.cp_size}; "
                    f"use --cp-comm-type p2p"
                )

    @staticmethod
    def _refuse_te_only(config: Any, num_splits: int | None) -> None:
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type != "vanilla":
            raise ValueError(
                f"{_OWNER}: softmax_type={softmax_type!r} (attention sinks) needs "
                f"TransformerEngine's fused attention; use --softmax-type vanilla"
            )
        if getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False):
            raise ValueError(
                f"{_OWNER}: --qk-clip / --log-max-attention-logit need TransformerEngine's "
                f"max-logit output; remove them"
            )
        if num_splits is not None:
            raise ValueError(
                f"{_OWNER}: num_splits={num_splits} (batch-invariant attention) needs "
                f"TransformerEngine's flash-attention; remove it"
            )
        if getattr(config, "batch_invariant_mode", False):
            raise ValueError(
                f"{_OWNER}: batch_invariant_mode (batch-invariant attention) needs "
                f"TransformerEngine's flash-attention; remove it"
            )

    def _packed_implementation(self) -> str | None:
        """``packed_attention``'s implementation for ``--attention-backend`` (None: its own)."""
        return self.kernels.packed if self.kernels else None

    def _dropout_p(self) -> float:
        return self.attention_dropout if self.training else 0.0

    def _rng_context(self) -> contextlib.AbstractContextManager:
        """Dropout draws from Megatron's model-parallel RNG stream, as TE's attention does."""
        if self._dropout_p() == 0.0:
            return contextlib.nullcontext()
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        tracker = get_cuda_rng_tracker()
        initialized = getattr(tracker, "is_initialized", lambda: True)()
        return tracker.fork() if initialized else contextlib.nullcontext()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        num_splits: int | None = None,
    ) -> torch.Tensor:
        if num_splits is not None:
            self._refuse_te_only(self.config, num_splits)
        mask_type = mask_name(attn_mask_type if attn_mask_type is not None else self.attn_mask_type)
        qkv_format = getattr(packed_seq_params, "qkv_format", None) or self.qkv_format
        if packed_seq_params is not None:
            self._follow_dynamic_cp(packed_seq_params)
        # --attention-backend: the packed and document paths may run one SDPA per document, so
        # they run under its SDPA kernels; sdpa_sbhd takes them as an argument, the CP blocks
        # as an order.
        with self._rng_context():
            if packed_seq_params is not None and qkv_format == "thd":
                with attention_backend.sdpa_kernels(self.kernels):
                    return self._packed(
                        query, key, value, mask_type, attention_bias, packed_seq_params
                    )
            if self.cp_size > 1:
                return self._context_parallel(query, key, value, mask_type, attention_bias)
            documents = self._documents(query, key, attention_mask, mask_type, attention_bias)
            if documents is not None:
                from megatron_rocm.runtime.backend.packed.document_mask import (
                    block_causal_attention,
                )

                with attention_backend.sdpa_kernels(self.kernels):
                    return block_causal_attention(
                        query,
                        key,
                        value,
                        documents,
                        softmax_scale=self.softmax_scale,
                        dropout_p=self._dropout_p(),
                        window_size=self.window_size,
                        implementation=self._packed_implementation(),
                    )
            return sdpa_sbhd(
                query,
                key,
                value,
                mask_type=mask_type,
                attention_mask=attention_mask,
                attention_bias=attention_bias,
                softmax_scale=self.softmax_scale,
                dropout_p=self._dropout_p(),
                window_size=self.window_size,
                kernels=self.kernels.sdpa if self.kernels else None,
            )

    def project_around_a2a(
        self,
        attention: Any,
        hidden_states: torch.Tensor,
        rotary_pos_emb: Any,
        **inputs: Any,
    ) -> torch.Tensor | None:
        """Upstream's ``Attention.forward`` from its input to this module's output, computed
        with the QKV projection around a2a's exchanges (the ``a2a-qkv-projection`` patch calls
        it; ``a2a_projection``), or None where upstream's own path must compute it. ``inputs``
        are upstream's other forward inputs (cross-attention states, packed and inference
        parameters, attention bias), all None for this path to run."""
        from megatron_rocm.runtime.backend.cp.a2a_projection import projected_self_attention

        return projected_self_attention(self, attention, hidden_states, rotary_pos_emb, inputs)

    def _follow_dynamic_cp(self, params: Any) -> None:
        """Hybrid CP (``--hybrid-context-parallel``) hands each batch its CP group in
        ``PackedSeqParams``; ``local_cp_size == 1`` without a group turns CP off. As TE's
        wrapper does, the change persists until the next batch changes it."""
        group = getattr(params, "cp_group", None)
        local = getattr(params, "local_cp_size", None)
        if group is not None:
            import torch.distributed as dist

            self.cp_group, self.cp_size = group, dist.get_world_size(group)
        elif local is not None:
            if local != 1:
                raise ValueError(
                    f"{_OWNER}: PackedSeqParams.local_cp_size={local} needs its cp_group "
                    f"(only local_cp_size == 1 may come without one)"
                )
            self.cp_group, self.cp_size = None, 1

    @staticmethod
    def _documents(
        query: torch.Tensor,
        key: torch.Tensor,
        attention_mask: torch.Tensor | None,
        mask_type: str,
        attention_bias: torch.Tensor | None,
    ) -> Any:
        """Documents of a block-causal mask (``--reset-attention-mask`` data), else None.

        A causal mask type ignores the mask, as with TE, when the mask is the plain causal
        one or not a square ``[b|1, 1, s, s]`` mask. But a block-causal mask -- documents packed
        in one sample -- is honoured: TE would silently attend across documents.
        """
        s = query.shape[0]
        if (
            mask_type != "causal"
            or attention_mask is None
            or attention_bias is not None
            or key.shape[0] != s
            or attention_mask.dim() != 4
            or tuple(attention_mask.shape[-2:]) != (s, s)
            or attention_mask.dtype != torch.bool
        ):
            return None
        from megatron_rocm.runtime.backend.packed import document_mask

        if capturing(query.device) and document_mask.ignorable_when_captured(
            attention_mask, query.shape[1]
        ):
            return None  # the eager warm-up read masks of this shape: plain causal
        # Reading the mask syncs with the GPU: done once per mask tensor (cached), not per layer.
        documents = document_mask.documents_from_causal_mask(attention_mask, query.shape[1])
        return None if documents is None or documents.plain_causal else documents

    def _context_parallel(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask_type: str,
        attention_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        if attention_bias is not None or self.window_size is not None:
            raise ValueError(
                f"{_OWNER}: context parallelism with an attention bias or a sliding window is "
                f"not supported by the native backend"
            )
        if mask_type not in ("causal", "no_mask"):
            raise ValueError(
                f"{_OWNER}: context parallelism supports causal and no_mask attention, "
                f"got {mask_type}"
            )
        from megatron_rocm.runtime.backend.cp.dispatch import context_parallel_attention

        return context_parallel_attention(
            query,
            key,
            value,
            cp_group=self.cp_group,
            causal=mask_type == "causal",
            softmax_scale=self.softmax_scale,
            dropout_p=self._dropout_p(),
            comm_type=self.cp_comm_type,
            kernel_order=self.kernels.cp_blocks if self.kernels else None,
        )

    def _packed(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask_type: str,
        attention_bias: torch.Tensor | None,
        params: Any,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError(f"{_OWNER}: packed sequences with an attention bias are not supported")
        if capturing(query.device):
            raise ValueError(
                f"{_OWNER}: packed (THD) sequences read their cu_seqlens on the host, which a "
                "CUDA graph cannot (--cuda-graph-impl); leave CUDA graphs off for packed data"
            )
        if mask_type == "arbitrary":
            raise ValueError(
                f"{_OWNER}: packed (THD) sequences take their mask from cu_seqlens; an "
                f"arbitrary attention mask is not supported with them"
            )
        causal = "causal" in mask_type  # causal, padding_causal and their bottom_right forms
        if self.cp_size > 1:
            return self._packed_context_parallel(query, key, value, causal, params)
        from megatron_rocm.runtime.backend.packed.thd_attention import packed_attention

        return packed_attention(
            query,
            key,
            value,
            **_offsets(params),
            max_seqlen_q=getattr(params, "max_seqlen_q", None),
            max_seqlen_kv=getattr(params, "max_seqlen_kv", None),
            causal=causal,
            softmax_scale=self.softmax_scale,
            dropout_p=self._dropout_p(),
            window_size=self.window_size,
            implementation=self._packed_implementation(),
        )

    def _packed_context_parallel(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, params: Any
    ) -> torch.Tensor:
        if self.window_size is not None:
            raise ValueError(
                f"{_OWNER}: context parallelism with packed (THD) sequences and a sliding window "
                f"is not supported by the native backend"
            )
        from megatron_rocm.runtime.backend.packed.context_parallel import (
            packed_context_parallel_attention,
        )
        from megatron_rocm.runtime.kernels.launch import log_fallback_once

        log_fallback_once(
            f"packed-cp-comm:{self.cp_comm_type}",
            f"packed (THD) sequences under context parallelism all-gather K/V once per layer "
            f"(--cp-comm-type {self.cp_comm_type} applies to unpacked batches)",
        )
        return packed_context_parallel_attention(
            query,
            key,
            value,
            **_offsets(params),
            cp_group=self.cp_group,
            causal=causal,
            softmax_scale=self.softmax_scale,
            dropout_p=self._dropout_p(),
            implementation=self._packed_implementation(),
        )

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """No parameters (vanilla softmax only), as TE's wrapper without a learnable offset."""
        return {}

    def extra_repr(self) -> str:
        return (
            f"native SDPA, mask={mask_name(self.attn_mask_type)}, dropout="
            f"{self.attention_dropout}, scale={self.softmax_scale:.4g}, cp={self.cp_size}"
        )
