"""Upstream's TE-spec transformer block under ``--fp8-format`` without TE (CPU).

    python fp8_probe.py --tree PATCHED_TREE --out RESULT.json

One gloo rank. Builds upstream's ``TransformerBlock`` from the TE layer spec (the native
backend's linears) three times from one seed: with ``fp8="hybrid", fp8_recipe="tensorwise"``
and ``first_last_layers_bf16`` (one layer kept in bf16 at each end); with upstream's default
recipe, ``delayed``, at the 8B example's ``--fp8-amax-history-len 1024
--fp8-amax-compute-algo max``; and in bf16. Each block takes two steps on one batch (the
delayed one scales its second by the first's amaxes). Records which linears got an FP8
recipe, how many GEMMs ran through the FP8 function, where the delayed histories stand, and
the blocks' outputs and gradients of the second step for the test to compare.
"""

from __future__ import annotations

import argparse
import os
import sys

import probe_cli  # beside this script (sys.path[0])

SEQ, BATCH, HIDDEN, HEADS, LAYERS = 16, 2, 64, 4, 4


RECIPES = {
    "fp8": dict(fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True,
                num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1),
    "delayed": dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=1024,
                    fp8_amax_compute_algo="max"),
    "bf16": {},
}  # fmt: skip


def build(kind: str):  # noqa: ANN201 - the block
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = RECIPES[kind]
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=128,
        normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        apply_rope_fusion=False, bf16=True, params_dtype=torch.bfloat16, **extra,
    )  # fmt: skip
    torch.manual_seed(1234)
    block = TransformerBlock(config, get_gpt_layer_with_transformer_engine_spec())
    return block


def run(args: argparse.Namespace) -> dict:
    probe_cli.one_rank_world(args, cpu=False)
    import torch

    from megatron_rocm.runtime.backend import fp8 as backend_fp8

    calls = {"n": 0}
    forward = backend_fp8.Fp8LinearFunction.forward

    def counted(ctx, *a):  # noqa: ANN001, ANN002, ANN202
        calls["n"] += 1
        return forward(ctx, *a)

    backend_fp8.Fp8LinearFunction.forward = staticmethod(counted)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(7))
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    # a fixed random direction: |out|^2 is constant under the final RMSNorm (a zero gradient)
    direction = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(8))
    result: dict = {}
    for name in RECIPES:
        block = build(name)
        linears = {
            mod_name: mod
            for mod_name, mod in block.named_modules()
            if mod_name.count(".") == 3 and "linear" in mod_name.rsplit(".", 1)[-1]
        }
        before = calls["n"]
        for _ in range(2):  # the same batch twice: no optimizer, the weights stay
            block.set_is_first_microbatch()  # each a step's first micro-batch, as the schedules
            block.zero_grad(set_to_none=True)
            x = hidden.to(torch.bfloat16).requires_grad_()
            out = block(x, mask)
            out = out[0] if isinstance(out, tuple) else out
            (out.float() * direction).sum().backward()
        result[name] = {
            "recipes": {n: getattr(m, "fp8_recipe", "absent") is not None
                        for n, m in linears.items()},
            "history_positions": {
                n: [int(h.pos.item()) for h in vars(m.fp8_recipe.delayed).values()]
                for n, m in linears.items()
                if getattr(m, "fp8_recipe", None) is not None and m.fp8_recipe.delayed
            },
            "fp8_gemms": calls["n"] - before,
            "out": out.detach().float().tolist(),
            "dx": x.grad.float().tolist(),
            "fc1_grad": block.layers[1].mlp.linear_fc1.weight.grad.float().tolist(),
        }  # fmt: skip
    torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    sys.exit(probe_cli.main(run))
