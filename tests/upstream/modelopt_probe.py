"""Upstream's ModelOpt spec without TE, and its attention past the prompt in training (CPU).

    python modelopt_probe.py --tree PATCHED_TREE --out RESULT.json

One gloo rank. Upstream's ``get_gpt_modelopt_spec(use_arbitrary_attention_mask=True)`` (the
spec ModelOpt's EAGLE draft layer is built from) builds its norms through
``post_training.modelopt.layers.Norm``, which raises ImportError without TE. The probe builds
that layer, then runs its self-attention as EAGLE's train-time-test steps do: in training,
through a ``StaticInferenceContext`` whose ``sequence_len_offset`` moves one sequence on per
step, so that step ``t`` attends ``s`` queries to the ``(t + 1) * s`` cached keys under an
arbitrary mask. It records what reaches the core attention (mask type, shapes, q/k/v, mask and
output) for the test to recompute, and runs one backward through all the steps.
"""

from __future__ import annotations

import argparse
import os
import sys

import probe_cli  # beside this script (sys.path[0])

SEQ, BATCH, STEPS, HIDDEN, HEADS, GROUPS = 6, 2, 3, 32, 4, 2


def step_mask(step: int):  # noqa: ANN201
    """EAGLE-like: query i sees key j of every cached block when j's position is at most i,
    and nothing of the current block past its own position (True = masked)."""
    import torch

    pos_q = torch.arange(SEQ).view(SEQ, 1)
    pos_k = (torch.arange(SEQ * (step + 1)) % SEQ).view(1, -1)
    blocked = pos_k > pos_q
    blocked[:, -SEQ:] |= torch.rand(SEQ, SEQ, generator=torch.Generator().manual_seed(step)) < 0.3
    blocked[torch.arange(SEQ), torch.arange(SEQ)] = False  # every query keeps its own key
    return blocked.view(1, 1, SEQ, -1).expand(BATCH, 1, SEQ, -1)


def run(args: argparse.Namespace) -> dict:
    probe_cli.one_rank_world(args)
    import torch
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.post_training.modelopt.gpt.model_specs import get_gpt_modelopt_spec
    from megatron.core.post_training.modelopt.layers import Norm
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rocm.runtime.backend.dot_product_attention import TEDotProductAttention, mask_name

    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        ffn_hidden_size=48, normalization="RMSNorm", add_bias_linear=False,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, bias_activation_fusion=False, apply_rope_fusion=False,
    )  # fmt: skip
    norms = {}
    for kind in ("RMSNorm", "LayerNorm"):
        config.normalization = kind
        norm = Norm(config, HIDDEN)
        x = torch.randn(3, HIDDEN)
        norms[kind] = {
            "module": type(norm).__module__,
            "state": sorted(norm.state_dict()),
            "finite": bool(torch.isfinite(norm(x)).all()),
        }
    config.normalization = "RMSNorm"
    spec = get_gpt_modelopt_spec(config, use_arbitrary_attention_mask=True)
    layer = build_module(spec.layer_specs[0], config=config, layer_number=1)
    attention = layer.self_attention

    calls: list[dict] = []
    forward = TEDotProductAttention.forward

    def spy(self, query, key, value, attention_mask, attn_mask_type=None, **kwargs):  # noqa: ANN001, ANN202
        out = forward(self, query, key, value, attention_mask, attn_mask_type, **kwargs)
        given = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        calls.append({
            "mask_type": mask_name(given),
            "q": query.detach().tolist(), "k": key.detach().tolist(), "v": value.detach().tolist(),
            "mask": None if attention_mask is None else attention_mask.tolist(),
            "out": out.detach().tolist(),
        })  # fmt: skip
        return out

    TEDotProductAttention.forward = spy
    attention.train()
    context = StaticInferenceContext(BATCH, SEQ * STEPS)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(7))
    total = 0.0
    for step in range(STEPS):
        context.sequence_len_offset = step * SEQ
        out, _ = attention(hidden * (step + 1), step_mask(step), inference_context=context)
        total = total + out.float().pow(2).sum()
    try:
        total.backward()
        backward = None
    except RuntimeError as exc:
        backward = str(exc).splitlines()[0]
    grad = attention.linear_qkv.weight.grad
    torch.distributed.destroy_process_group()
    return {
        "norms": norms,
        "calls": calls,
        "backward_error": backward,
        "qkv_grad": None if grad is None else grad.abs().sum().item(),
    }


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    sys.exit(probe_cli.main(run))
