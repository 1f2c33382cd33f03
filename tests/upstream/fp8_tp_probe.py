"""Upstream's TE-spec transformer block under ``--fp8-format`` with tensor parallelism (CPU).

    python fp8_tp_probe.py --tree PATCHED_TREE --out RESULT.json

Launches a gloo world of two ranks (TP=2), each running this file on the patched tree:
upstream's ``TransformerBlock`` from the TE layer spec (the native backend's column, row and
norm-fused column linears), built from one seed in bf16 and in FP8 under three recipes
(``tensorwise``; ``delayed`` at the 8B example's history of 1024 and ``max``; ``blockwise``
where upstream's choices have it, core 0.13 and later), each with and
without sequence parallelism. Each block takes two steps (no optimizer: the weights stay), the
second on a batch half the first's size. Each rank writes, per block, its outputs and input
gradients of the second step over the whole sequence (gathered over the ranks under sequence
parallelism), one weight gradient of its shard, how many GEMMs ran through the FP8 function,
and every delayed history's state.
"""

from __future__ import annotations

import argparse
import os

SEQ, BATCH, HIDDEN, HEADS, LAYERS, TP = 16, 2, 64, 4, 2, 2
RECIPES = {
    "bf16": {},
    "tensorwise": dict(fp8="hybrid", fp8_recipe="tensorwise"),
    "delayed": dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=1024,
                    fp8_amax_compute_algo="max"),
    "blockwise": dict(fp8="hybrid", fp8_recipe="blockwise"),  # core 0.13 and later
}  # fmt: skip


def build(recipe: str, sequence_parallel: bool):  # noqa: ANN201 - the block
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_block import TransformerBlock
    from probe_cli import small_block_config  # beside this script, on sys.path when it runs

    config = small_block_config(
        LAYERS,
        HIDDEN,
        HEADS,
        tensor_model_parallel_size=TP,
        sequence_parallel=sequence_parallel,
        **RECIPES[recipe],
    )
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    return TransformerBlock(config, get_gpt_layer_with_transformer_engine_spec())


def whole_sequence(x, sequence_parallel: bool):  # noqa: ANN001, ANN201
    """``x`` [s, b, h] over the whole sequence: gathered over the TP ranks under sequence
    parallelism (each holds its chunk of the sequence)."""
    import torch
    import torch.distributed as dist

    if not sequence_parallel:
        return x
    parts = [torch.empty_like(x) for _ in range(TP)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def histories(block) -> dict:  # noqa: ANN001
    """Every delayed history of the block: ring, running amax, position and scale."""
    state = {}
    for name, module in block.named_modules():
        recipe = getattr(module, "fp8_recipe", None)
        if recipe is None or recipe.delayed is None:
            continue
        for tensor, history in vars(recipe.delayed).items():
            state[f"{name}.{tensor}"] = [
                history.history.tolist(), history.current.item(), int(history.pos.item()),
                history.scale.item(),
            ]  # fmt: skip
    return state


def run_rank(args: argparse.Namespace) -> dict:
    from gloo_ranks import join_rank_world  # beside this script, on sys.path when it runs

    rank = join_rank_world(args.tree, TP)  # cpu_shim: upstream's CUDA allocations on the CPU
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rocm.runtime.backend import fp8 as backend_fp8

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    calls = {"n": 0}
    forward = backend_fp8.Fp8LinearFunction.forward

    def counted(ctx, *a):  # noqa: ANN001, ANN002, ANN202
        calls["n"] += 1
        return forward(ctx, *a)

    backend_fp8.Fp8LinearFunction.forward = staticmethod(counted)
    from probe_cli import count_blockwise_forwards  # beside this script

    has_blockwise = count_blockwise_forwards(calls)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(7))
    direction = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(8))
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    chunk = SEQ // TP
    result: dict = {}
    for recipe in RECIPES:
        if recipe == "blockwise" and not has_blockwise:  # upstream's choices lack it before 0.13
            continue
        for sequence_parallel in (False, True):
            block = build(recipe, sequence_parallel)
            before, blockwise_before = calls["n"], calls.get("blockwise", 0)
            for scale in (1.0, 0.5):
                block.set_is_first_microbatch()
                block.zero_grad(set_to_none=True)
                x = (hidden * scale).to(torch.bfloat16)
                if sequence_parallel:
                    x = x[rank * chunk : (rank + 1) * chunk]
                x = x.detach().requires_grad_()
                out = block(x, mask)
                out = out[0] if isinstance(out, tuple) else out
                mine = direction[rank * chunk : (rank + 1) * chunk] if sequence_parallel else (
                    direction)  # fmt: skip
                (out.float() * mine).sum().backward()
            result[f"{recipe}{'-sp' if sequence_parallel else ''}"] = {
                "fp8_gemms": calls["n"] - before,
                "blockwise_gemms": calls.get("blockwise", 0) - blockwise_before,
                "out": whole_sequence(out.detach(), sequence_parallel).float().tolist(),
                "dx": whole_sequence(x.grad, sequence_parallel).float().tolist(),
                "fc1_grad": block.layers[0].mlp.linear_fc1.weight.grad.float().tolist(),
                "histories": histories(block),
            }
    result["local"] = local_gemms(rank)
    dist.barrier()
    dist.destroy_process_group()
    return result


def local_gemms(rank: int) -> dict:
    """The linears whose FP8 GEMM exchanges nothing over TP: expert linears (their dispatcher
    communicates: ``explicit_expert_comm``) and a column linear built with
    ``disable_grad_reduce``. Each rank feeds its own input; per linear, the output and input
    gradient in FP8 and from the same weights and inputs in float64, on this rank alone."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rocm.runtime.backend.linear import TEColumnParallelLinear, TERowParallelLinear

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        tensor_model_parallel_size=TP, gradient_accumulation_fusion=False, bf16=True,
        params_dtype=torch.bfloat16, fp8="hybrid", fp8_recipe="tensorwise",
    )  # fmt: skip
    common = dict(config=config, init_method=torch.nn.init.xavier_normal_, bias=False,
                  skip_bias_add=False)  # fmt: skip
    linears = {
        "expert-column": TEColumnParallelLinear(HIDDEN, 128, gather_output=False,
                                                is_expert=True, **common),
        "expert-row": TERowParallelLinear(128, HIDDEN, input_is_parallel=True, is_expert=True,
                                          **common),
        "column-no-grad-reduce": TEColumnParallelLinear(
            HIDDEN, 128, gather_output=False, is_expert=False, disable_grad_reduce=True, **common
        ),
    }  # fmt: skip
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own input
    got = {}
    for name, linear in linears.items():
        assert linear.fp8_recipe is not None, name
        x = torch.randn(32, linear.weight.shape[1], generator=gen).bfloat16().requires_grad_()
        out, _ = linear(x)
        dy = torch.randn(out.shape, generator=gen).bfloat16()
        out.backward(dy)
        w = linear.weight.detach().double()
        got[name] = {
            "out": out.detach().float().tolist(), "want_out": (x.detach().double() @ w.T).tolist(),
            "dx": x.grad.float().tolist(), "want_dx": (dy.double() @ w).tolist(),
        }  # fmt: skip
    return got


def main() -> int:
    from gloo_ranks import rank_main  # beside this script, on sys.path when it runs

    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=600)
    return rank_main(__file__, run_rank, TP, ap)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    raise SystemExit(main())
