"""Upstream's TE-spec MoE block under ``--fp8-format`` without TE (CPU).

    python fp8_moe_probe.py --tree PATCHED_TREE --out RESULT.json

One gloo rank. Builds upstream's ``TransformerBlock`` from the TE layer spec with four experts
(top-2 routing), once with ``--moe-grouped-gemm`` (``TEGroupedMLP`` on the native grouped
linears, its tokens padded by ``Fp8Padding``) and once without (``SequentialMLP`` on the native
column and row linears), each in FP8 (``tensorwise``) and in bf16 from one seed, one forward
and backward each. Records which FP8 padding class the experts hold, the rows of every GEMM that
ran through the FP8 functions (each grouped expert's bucket), and the outputs and gradients for the test to compare.
"""

from __future__ import annotations

import argparse
import os
import sys

import probe_cli  # beside this script (sys.path[0])

SEQ, BATCH, HIDDEN, HEADS, LAYERS, EXPERTS, TOPK = 16, 2, 64, 4, 2, 4, 2


def build(fp8: bool, grouped: bool):  # noqa: ANN201 - the block
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    recipe = dict(fp8="hybrid", fp8_recipe="tensorwise") if fp8 else {}
    config = probe_cli.small_block_config(
        LAYERS, HIDDEN, HEADS, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_ffn_hidden_size=64, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=grouped,
        moe_aux_loss_coeff=0.0, **recipe,
    )  # fmt: skip
    torch.manual_seed(1234)
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=EXPERTS, moe_grouped_gemm=grouped)
    return TransformerBlock(config, spec)


def run(args: argparse.Namespace) -> dict:
    probe_cli.one_rank_world(args)
    import torch

    from megatron_rocm.runtime.backend import fp8 as backend_fp8
    from megatron_rocm.runtime.backend import fp8_experts

    rows: list[int] = []  # the rows of each GEMM through the FP8 functions
    forward = backend_fp8.Fp8LinearFunction.forward
    experts_forward = fp8_experts.Fp8ExpertsFunction.forward

    def counted(ctx, x, *a):  # noqa: ANN001, ANN002, ANN202
        rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return forward(ctx, x, *a)

    def counted_experts(ctx, x, call, *a):  # noqa: ANN001, ANN002, ANN202
        rows.extend(call.segs.buckets)  # each expert's GEMM rows (0: no tokens, no GEMM)
        return experts_forward(ctx, x, call, *a)

    backend_fp8.Fp8LinearFunction.forward = staticmethod(counted)
    fp8_experts.Fp8ExpertsFunction.forward = staticmethod(counted_experts)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(7))
    direction = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(8))
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    result: dict = {}
    for grouped in (True, False):
        for fp8 in (True, False):
            block = build(fp8, grouped)
            experts = block.layers[0].mlp.experts
            before = len(rows)
            block.set_is_first_microbatch()
            x = hidden.to(torch.bfloat16).requires_grad_()
            out = block(x, mask)
            out = out[0] if isinstance(out, tuple) else out
            (out.float() * direction).sum().backward()
            padding = getattr(experts, "quantization_padding", None) or getattr(
                experts, "fp8_padding", None
            )
            fc1 = experts.linear_fc1 if grouped else experts.local_experts[0].linear_fc1
            result[f"{'grouped' if grouped else 'sequential'}-{'fp8' if fp8 else 'bf16'}"] = {
                "experts": type(experts).__name__,
                "padding": None if padding is None else type(padding).__module__,
                "fp8_rows": rows[before:],
                "out": out.detach().float().tolist(),
                "dx": x.grad.float().tolist(),
                "fc1_grad": (fc1.weight0 if grouped else fc1.weight).grad.float().tolist(),
            }
    torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    sys.exit(probe_cli.main(run))
