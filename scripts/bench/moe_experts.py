#!/usr/bin/env python3
"""Upstream's MoE expert modules on one GPU: SequentialMLP (the loop) vs TEGroupedMLP (native).

Usage: python3 -m scripts.bench.moe_experts TREE [--experts 8 64] [--tokens 16384]
       [--hidden 2048] [--ffn 1408] [--json F] [--cpu]

``bench/grouped_gemm.py`` times bare GEMMs: its loop is one cuBLAS call per expert and nothing
else, a stricter baseline than what a user runs. This one times what issue 11 names: the
experts of one MoE layer built by upstream's own specs from a patched tree (TREE on
``sys.path``) - ``get_gpt_layer_local_spec(num_experts=E)`` gives ``SequentialMLP``, the Python
loop over per-expert ``MLP`` modules that runs without ``--moe-grouped-gemm``;
``get_gpt_layer_with_transformer_engine_spec(num_experts=E, moe_grouped_gemm=True)`` gives
``TEGroupedMLP`` on the native backend (no TransformerEngine). Both get the same weights,
the same routed tokens (``bench_grouped_gemm.route``: uniform random experts, uneven splits)
and SwiGLU with upstream's default bias-activation fusion; forward + backward, bf16, weight
gradients into ``.grad`` (no DDP here, so no ``main_grad``: the same for both).

Prints one JSON line per module and expert count: device, module class, which grouped-GEMM
implementation ran (``torch._grouped_mm``, Triton or the loop, from ``grouped_gemm.last_run``),
median ms, TFLOP/s, speed-up over SequentialMLP, the max abs difference of output and input
gradient against SequentialMLP, and the GEMM kernels one forward + backward launched.
``--cpu`` runs on a gloo world in fp32 to check the script (no numbers worth reading).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from megatron_rocm.runtime.kernels import grouped_gemm as gg
from scripts.bench.grouped_gemm import device_info, is_gemm, route
from scripts.bench.timing import median_ms

MODULES = {False: "SequentialMLP", True: "TEGroupedMLP"}


def init_world(device: str) -> None:
    """A one-rank world and Megatron's parallel state (every group of size 1)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if device == "cpu":
        torch.cuda.current_device = lambda: "cpu"  # Megatron's RNG tracker asks the GPU
    dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    if device != "cpu":
        model_parallel_cuda_manual_seed(1234)


def build_experts(grouped: bool, experts: int, args: argparse.Namespace, dtype: torch.dtype):  # noqa: ANN201
    """The experts of one MoE layer, built as upstream's training builds them (whole layer)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        moe_ffn_hidden_size=args.ffn,
        num_attention_heads=max(1, args.hidden // 128),
        num_moe_experts=experts,
        moe_router_topk=2,
        moe_grouped_gemm=grouped,
        moe_token_dispatcher_type="allgather",  # only the experts run here
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=args.cpu,
        gradient_accumulation_fusion=False,
    )
    if grouped:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=True
        )
    else:
        spec = specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False)
    module = build_module(spec, config=config, layer_number=1).mlp.experts
    return module.to(args.device)


def expert_weights(module: Any, experts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(fc1, fc2) weight of every expert, from either module's own parameter layout."""
    if hasattr(module, "local_experts"):  # SequentialMLP: one MLP per expert
        return [(e.linear_fc1.weight, e.linear_fc2.weight) for e in module.local_experts]
    return [
        (getattr(module.linear_fc1, f"weight{i}"), getattr(module.linear_fc2, f"weight{i}"))
        for i in range(experts)
    ]


def run_once(module: Any, x: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor,
             grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Forward + backward; returns (output, input gradient) and clears the weight grads."""
    leaf = x.detach().requires_grad_()
    out, _ = module(leaf, tokens, probs)
    out.backward(grad)
    for p in module.parameters():
        p.grad = None
    return out.detach(), leaf.grad


def gemm_kernels(fn: Any) -> int | None:
    """GEMM kernels one call of ``fn`` launches on the GPU (None on the CPU)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kinds = torch.autograd.DeviceType.CUDA
    return sum(1 for e in prof.events() if e.device_type == kinds and is_gemm(e.name))


def bench(args: argparse.Namespace) -> list[dict]:
    dtype = torch.float32 if args.cpu else torch.bfloat16
    info = {"device": "cpu"} if args.cpu else device_info()
    records = []
    for experts in args.experts:
        splits = route(args.tokens, experts)
        gen = torch.Generator().manual_seed(experts)
        x = torch.randn(args.tokens, args.hidden, generator=gen).to(args.device, dtype)
        grad = torch.randn(args.tokens, args.hidden, generator=gen).to(args.device, dtype)
        probs = torch.rand(args.tokens, generator=gen).to(args.device, dtype)
        tokens = torch.tensor(splits)
        loop, grouped = (build_experts(g, experts, args, dtype) for g in (False, True))
        with torch.no_grad():  # the same experts in both modules
            for (a1, a2), (b1, b2) in zip(
                expert_weights(loop, experts), expert_weights(grouped, experts), strict=True
            ):
                b1.copy_(a1)
                b2.copy_(a2)
        reference = run_once(loop, x, tokens, probs, grad)
        flops = 3 * 2 * args.tokens * (args.hidden * 2 * args.ffn + args.ffn * args.hidden)
        loop_ms = None
        for module in (loop, grouped):
            name = type(module).__name__

            call = functools.partial(run_once, module, x, tokens, probs, grad)

            got = run_once(module, x, tokens, probs, grad)
            ran = gg.last_run() if name != "SequentialMLP" else None
            ms = median_ms(call, args.device)
            loop_ms = ms if loop_ms is None else loop_ms
            records.append({
                **info,
                "experts": experts,
                "tokens": args.tokens,
                "hidden": args.hidden,
                "ffn": args.ffn,
                "dtype": str(dtype).removeprefix("torch."),
                "min_split": min(splits),
                "max_split": max(splits),
                "module": name,
                "grouped_gemm": ran.implementation if ran else None,
                "weights": ran.weights if ran else None,
                "ms": round(ms, 3),
                "tflops": round(flops / ms / 1e9, 1),
                "speedup_vs_sequential": round(loop_ms / ms, 2),
                "max_abs_diff_out": float((got[0].float() - reference[0].float()).abs().max()),
                "max_abs_diff_dx": float((got[1].float() - reference[1].float()).abs().max()),
                "gemm_kernels_fwd_bwd": gemm_kernels(call),
            })  # fmt: skip
            print(json.dumps(records[-1]), flush=True)
            if args.json:  # record by record: a later case that fails keeps the earlier ones
                with args.json.open("a") as out:
                    out.write(json.dumps(records[-1]) + "\n")
        del loop, grouped
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", type=Path, help="a patched Megatron-LM tree")
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--tokens", type=int, default=16384, help="routed tokens (all experts)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=1408, help="each expert's FFN width")
    parser.add_argument("--json", type=Path, help="also write the records here, one per line")
    parser.add_argument("--cpu", action="store_true", help="gloo and fp32 on the CPU")
    args = parser.parse_args()
    if not (args.tree / "megatron" / "core").is_dir():
        parser.error(f"{args.tree} is not a Megatron-LM tree (no megatron/core)")
    if not args.cpu and not torch.cuda.is_available():
        print("bench_moe_experts: needs a CUDA or ROCm GPU (or --cpu)", file=sys.stderr)
        return 2
    args.device = "cpu" if args.cpu else "cuda"
    sys.path.insert(0, str(args.tree.resolve()))
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    if args.json:
        args.json.write_text("")
    init_world(args.device)
    bench(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
