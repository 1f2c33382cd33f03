"""Whether upstream's ``SelfAttention`` may hand its QKV projection to a2a (``cp.a2a_qkv``).

The ``a2a-qkv-projection`` patch makes upstream's ``Attention.forward`` offer its inputs to
the core attention's ``project_around_a2a`` before it projects them; a non-None result is the
core attention's output, and upstream goes on to the output projection. The native path
computes what upstream's would, in another order: the layer's norm, the fused QKV GEMM, the
split into heads, RoPE and a2a attention. So it runs only where that chain is exactly those
steps: a2a CP of this backend, self-attention with upstream's own split, one TP rank, a plain
GEMM (``linear.gemm_only``) in the norm-fused linear, RoPE by a per-position angle table (or
none), no q/k norms, output gate, bias, packed or inference inputs, offloading, core-attention
recompute or CUDA-graph capture. Anywhere else it returns None and upstream's path runs; where
a2a is in use it logs why once.

``MEGATRON_ROCM_CP_A2A_QKV``: ``1``, the default, lets it run; ``0`` keeps upstream's order
(to compare the two, or to rule the path out). On two H100s it took 0.4% off each iteration of
``70b-slice`` at 16k with upstream's loss (docs/backend.md); it runs inside
``linear_qkv``'s call, so Megatron's parameter hooks (``--overlap-param-gather``) come first.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rocm.runtime import settings
from megatron_rocm.runtime.backend.te_sdpa import mask_name
from megatron_rocm.runtime.kernels.launch import log_fallback_once
from megatron_rocm.runtime.platform import capturing

QKV_ENV = "MEGATRON_ROCM_CP_A2A_QKV"


def enabled() -> bool:
    """``MEGATRON_ROCM_CP_A2A_QKV``: on (the default) or off; a non-boolean is an error."""
    return bool(settings.get(QKV_ENV))


def _is_identity(module: Any) -> bool:
    if module is None:
        return True
    from megatron.core.transformer.identity_op import IdentityOp

    return isinstance(module, IdentityOp)


def _own_split(attention: Any) -> bool:
    """Whether the module splits its projection as upstream's ``SelfAttention`` does."""
    from megatron.core.transformer.attention import SelfAttention

    method = getattr(type(attention), "get_query_key_value_tensors", None)
    return method is SelfAttention.get_query_key_value_tensors


def rope_table(rotary_pos_emb: Any, tokens: int) -> tuple[torch.Tensor | None, str | None]:
    """The angle table upstream rotates q and k by (None: no RoPE), or why it is not one
    ``[s, 1, 1, rot]`` table shared by q and k."""
    if rotary_pos_emb is None:
        return None, None
    if not isinstance(rotary_pos_emb, tuple) or len(rotary_pos_emb) != 2:
        return None, "rotary embeddings that are not a (q, k) pair"
    q_freqs, k_freqs = rotary_pos_emb
    if q_freqs is not k_freqs:
        return None, "different rotary embeddings for q and k"
    freqs = q_freqs
    if not isinstance(freqs, torch.Tensor) or freqs.dim() != 4 or freqs.shape[1:3] != (1, 1):
        return None, "rotary embeddings that are not one [s, 1, 1, rot] table"
    if freqs.shape[0] < tokens or freqs.requires_grad:
        return None, "rotary embeddings shorter than the sequence, or learned"
    return freqs, None


def why_not(core: Any, attention: Any, hidden_states: torch.Tensor, inputs: dict) -> str | None:
    """Why upstream's path must compute this call (None: the native one may)."""
    config = attention.config
    linear = getattr(attention, "linear_qkv", None)
    from megatron_rocm.runtime.backend.layernorm_linear import TELayerNormColumnParallelLinear
    from megatron_rocm.runtime.backend.linear import gemm_only

    checks = [
        (attention.attention_type == "self" and _own_split(attention), "not SelfAttention"),
        (all(v is None for v in inputs.values()), "cross, packed, biased or inference inputs"),
        (isinstance(linear, TELayerNormColumnParallelLinear), "linear_qkv is not norm-fused"),
        (
            linear is not None
            and gemm_only(linear, linear.output_size_per_partition == linear.output_size)
            and not linear.skip_bias_add,
            "linear_qkv is not one plain GEMM (TP, sequence parallel, offloading)",
        ),
        (_is_identity(getattr(attention, "q_layernorm", None)), "q/k layernorm"),
        (_is_identity(getattr(attention, "k_layernorm", None)), "q/k layernorm"),
        (
            not (
                getattr(config, "test_mode", False)
                or getattr(config, "attention_output_gate", False)
                or getattr(config, "fused_single_qkv_rope", False)
                or getattr(config, "flash_decode", False)
                or getattr(config, "multi_latent_attention", False)
            ),
            "test mode, output gate, fused QKV RoPE or flash decode",
        ),
        (
            not any(
                getattr(attention, name, False)
                for name in ("offload_qkv_linear", "offload_core_attention", "offload_attn_proj")
            ),
            "activation offloading",
        ),
        (
            not (getattr(attention, "checkpoint_core_attention", False) and attention.training),
            "core-attention recompute",
        ),
        (getattr(attention, "_yarn_concentration_factor", 1.0) in (None, 1.0), "YaRN mscale"),
        (core.window_size is None, "a sliding window"),
        (
            mask_name(attention.attn_mask_type) in ("causal", "no_mask"),
            "a mask type other than causal or no_mask",
        ),
        (not capturing(hidden_states.device), "CUDA-graph capture"),
        (not getattr(torch.compiler, "is_compiling", lambda: False)(), "torch.compile"),
        (not torch.is_autocast_enabled(), "autocast"),
        (
            linear is None or linear.layer_norm_weight.dtype == linear.weight.dtype,
            "a norm in another dtype than the GEMM",
        ),
    ]
    for ok, reason in checks:
        if not ok:
            return reason
    heads = attention.num_attention_heads_per_partition
    groups = attention.num_query_groups_per_partition
    if heads % groups or groups % core.cp_size:
        return f"{groups} kv groups (per TP rank) do not split over cp={core.cp_size}"
    if hidden_states.shape[0] % 2:
        return "an odd local sequence"
    return None


def projected_self_attention(
    core: Any, attention: Any, hidden_states: torch.Tensor, rotary_pos_emb: Any, inputs: dict
) -> torch.Tensor | None:
    """The core attention's output for upstream's ``attention`` on ``hidden_states``, computed
    by ``cp.a2a_qkv``, or None where upstream's path must compute it. ``inputs``: upstream's
    other forward inputs that this path does not take (each must be None)."""
    if core.cp_size < 2 or core.cp_comm_type != "a2a" or not enabled():
        return None
    freqs, reason = rope_table(rotary_pos_emb, hidden_states.shape[0])
    reason = reason or why_not(core, attention, hidden_states, inputs)
    if reason is not None:
        log_fallback_once(
            f"a2a-qkv:{reason}",
            f"a2a attention takes the QKV projection's output as upstream computes it "
            f"({reason}): its first and last exchanges run with nothing beside them",
        )
        return None
    log_fallback_once(  # said once, so that a run shows which path computed it
        "a2a-qkv:on",
        f"a2a attention computes the QKV projection around its exchanges "
        f"({QKV_ENV}=0 keeps upstream's order)",
    )
    from megatron_rocm.runtime.backend.cp.a2a_qkv import projected_a2a_attention
    from megatron_rocm.runtime.backend.cp.block_attention import pick_kernel

    linear = attention.linear_qkv
    heads = attention.num_attention_heads_per_partition
    groups = attention.num_query_groups_per_partition
    head_dim = attention.hidden_size_per_attention_head
    interleaved = bool(getattr(attention.config, "rotary_interleaved", False))
    causal = mask_name(attention.attn_mask_type) == "causal"
    dropout_p = core._dropout_p()

    def project(normed: torch.Tensor) -> torch.Tensor:
        # the weight is read here, inside the module's call: after its hooks (param sync)
        shape = (normed.shape[0], normed.shape[1], heads, head_dim)
        stand_in = normed.new_empty(()).expand(shape)
        kernel = pick_kernel(stand_in, stand_in, stand_in, dropout_p,
                             core.kernels.cp_blocks if core.kernels else None)  # fmt: skip
        return projected_a2a_attention(
            normed, linear.weight, linear.bias, heads=heads, groups=groups, head_dim=head_dim,
            freqs=freqs, interleaved=interleaved,
            fuse_wgrad=bool(linear.gradient_accumulation_fusion), group=core.cp_group,
            causal=causal, scale=core.softmax_scale, dropout_p=dropout_p, kernel=kernel,
        )  # fmt: skip

    with core._rng_context():
        output, _ = linear(hidden_states, around_a2a=project)
    return output
