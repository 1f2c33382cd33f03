"""Upstream's CLIP ViT without TE: built from its own defaults and run forward (CPU).

    python clip_vit_probe.py --tree PATCHED_TREE --out RESULT.json

One gloo rank. ``CLIPViTModel``'s ``ln_pre``/``ln_post`` default to TE's norm, and without TE
to ``torch.nn.LayerNorm``, which ``build_module`` cannot construct (it passes ``config=``):
LLaVA and every CLIP test of upstream's stopped there. The probe builds the model with the
norms it defaults to, for LayerNorm and RMSNorm configs, and records the norm's class, whether
it normalises as the config says (against the formula written out here) and the forward's
output.
"""

from __future__ import annotations

import argparse

import probe_cli  # beside this script (sys.path[0])

HIDDEN, HEADS, IMG, PATCH = 64, 4, 32, 16
EPS = 1e-2  # far from every default (1e-5, 1e-6): the config's epsilon must reach the norm


def run(args: argparse.Namespace) -> dict:
    probe_cli.one_rank_world(args)
    import torch
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    out: dict = {}
    for kind in ("LayerNorm", "RMSNorm"):
        torch.manual_seed(0)
        config = TransformerConfig(
            num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, normalization=kind,
            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
            bias_dropout_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
            gradient_accumulation_fusion=False, layernorm_epsilon=EPS,
        )  # fmt: skip
        model = CLIPViTModel(
            config, get_vit_layer_with_local_spec(), img_h=IMG, img_w=IMG, patch_dim=PATCH
        )
        norm = model.ln_pre
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            if getattr(norm, "bias", None) is not None:
                norm.bias.uniform_(-0.5, 0.5)
        x = torch.randn(5, HIDDEN) * 0.05  # small: EPS is a large part of the variance
        xd = x.double()
        if kind == "LayerNorm":
            want = (xd - xd.mean(-1, keepdim=True)) / torch.sqrt(
                xd.var(-1, unbiased=False, keepdim=True) + EPS
            )
        else:
            want = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)
        want = want * norm.weight.double() + (
            norm.bias.double() if getattr(norm, "bias", None) is not None else 0
        )
        images = torch.randn(2, 3, IMG, IMG)
        y = model(images)
        out[kind] = {
            "norm": type(norm).__name__,
            "norm_error": float((norm(x).double() - want).abs().max()),
            "shape": list(y.shape),
            "finite": bool(torch.isfinite(y).all()),
        }
    return out


if __name__ == "__main__":
    raise SystemExit(probe_cli.main(run))
