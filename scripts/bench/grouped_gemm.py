#!/usr/bin/env python3
"""Grouped GEMM vs the per-expert loop for MoE experts, forward + backward, on one GPU.

Usage: python3 -m scripts.bench.grouped_gemm [--experts 8 64] [--tokens 16384] [--hidden 2048]
       [--ffn 1408] [--iters 20] [--profile]

Times the local experts of one MoE layer as ``TEGroupedMLP`` runs them: fc1 (SwiGLU, so
``2 * ffn`` wide) -> SwiGLU -> fc2, forward and backward, bf16, weight gradients accumulated
into fp32 ``main_grad`` (Megatron's default gradient-accumulation fusion). Tokens are routed
to experts at random, so the splits are uneven. Providers: ``loop`` (one GEMM per expert, the
baseline: what SequentialMLP does), ``torch`` (``torch._grouped_mm``) and ``triton`` (ours),
each with the expert weights as TEGroupedLinear allocates them (one buffer: a zero-copy view)
and, for the grouped providers, as separate tensors (what Megatron's distributed optimizer
leaves: ``torch`` then stacks them per call, Triton reads them in place).

Prints one JSON line per measurement: device, implementation, how the weights were read,
median ms, TFLOP/s, speed-up over the loop, and the max abs difference of the output against
the loop. ``--profile`` instead counts the GPU kernels of one forward+backward per provider
(torch.profiler): a grouped provider launches one GEMM per projection and pass, the loop one
per expert. Self-contained; about a minute on an H100.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron_rocm.runtime.kernels import grouped_gemm as gg
from scripts.bench import timing

DTYPE = torch.bfloat16
GEMM_NAMES = ("gemm", "cutlass", "_gmm_kernel", "_wgrad_kernel", "nvjet", "xmma", "cijk", "ck_")


def device_info() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "device": props.name,
        "torch": torch.__version__,
        "hip": getattr(torch.version, "hip", None),
        "cuda": torch.version.cuda,
    }


def route(tokens: int, experts: int, seed: int = 0) -> list[int]:
    """Rows per expert for tokens sent to uniformly random experts (uneven, like a router)."""
    gen = torch.Generator().manual_seed(seed)
    choice = torch.randint(0, experts, (tokens,), generator=gen)
    return torch.bincount(choice, minlength=experts).tolist()


class Experts:
    """fc1/fc2 expert weights with fp32 main_grads, in one buffer or as separate tensors."""

    def __init__(self, experts: int, hidden: int, ffn: int, packed: bool) -> None:
        def make(rows: int, cols: int) -> list[torch.nn.Parameter]:
            if packed:
                buf = torch.randn(experts, rows, cols, device="cuda", dtype=DTYPE) * cols**-0.5
                params = [torch.nn.Parameter(buf[i]) for i in range(experts)]
            else:
                params = [
                    torch.nn.Parameter(
                        torch.randn(rows, cols, device="cuda", dtype=DTYPE) * cols**-0.5
                    )
                    for _ in range(experts)
                ]
            grads = torch.zeros(experts, rows, cols, device="cuda", dtype=torch.float32)
            for i, p in enumerate(params):  # DDP's buffer order: last expert first
                p.main_grad = grads[experts - 1 - i]
                p.grad_added_to_main_grad = False
            return params

        self.fc1 = make(2 * ffn, hidden)
        self.fc2 = make(hidden, ffn)


def mlp(x: torch.Tensor, w: Experts, splits: list[int], impl: str) -> torch.Tensor:
    h = gg.grouped_mm(x, w.fc1, splits, fuse_wgrad_accumulation=True, implementation=impl)
    gate, up = h.chunk(2, dim=-1)
    return gg.grouped_mm(
        F.silu(gate) * up, w.fc2, splits, fuse_wgrad_accumulation=True, implementation=impl
    )


def step(x: torch.Tensor, w: Experts, splits: list[int], impl: str, grad: torch.Tensor):
    def run() -> None:
        leaf = x.detach().requires_grad_()
        mlp(leaf, w, splits, impl).backward(grad)
        for p in (*w.fc1, *w.fc2):
            p.grad = None

    return run


def timed(fn: Callable[[], None], iters: int) -> float:
    return timing.sampled_ms(fn, iters, "cuda", warmup=3)


def runnable(impl: str, x: torch.Tensor, hidden: int, ffn: int) -> str | None:
    try:
        gg.choose(x, (2 * ffn, hidden), impl)
    except RuntimeError as exc:
        return str(exc)
    return None


def bench(args: argparse.Namespace) -> None:
    info = device_info()
    for experts in args.experts:
        splits = route(args.tokens, experts)
        x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=DTYPE)
        grad = torch.randn(args.tokens, args.hidden, device="cuda", dtype=DTYPE)
        flops = 3 * 2 * args.tokens * (args.hidden * 2 * args.ffn + args.ffn * args.hidden)
        base = {
            **info,
            "experts": experts,
            "tokens": args.tokens,
            "hidden": args.hidden,
            "ffn": args.ffn,
            "dtype": "bf16",
            "min_split": min(splits),
            "max_split": max(splits),
        }
        packed = Experts(experts, args.hidden, args.ffn, packed=True)
        loose = Experts(experts, args.hidden, args.ffn, packed=False)
        with torch.no_grad():
            for a, b in zip((*packed.fc1, *packed.fc2), (*loose.fc1, *loose.fc2)):
                b.copy_(a)
            reference = mlp(x, packed, splits, "loop")
        loop_ms = None
        for impl, weights in (
            ("loop", packed),
            ("torch", packed),
            ("torch", loose),
            ("triton", packed),
            ("triton", loose),
        ):
            problem = runnable(impl, x, args.hidden, args.ffn)
            if problem:
                print(json.dumps({**base, "implementation": impl, "skipped": problem}))
                continue
            ms = timed(step(x, weights, splits, impl, grad), args.iters)
            with torch.no_grad():
                diff = (mlp(x, weights, splits, impl).float() - reference.float()).abs().max()
            run = gg.last_run()
            loop_ms = ms if impl == "loop" else loop_ms
            print(
                json.dumps(
                    {
                        **base,
                        "implementation": impl,
                        "weights": run.weights if run else None,
                        "ms": round(ms, 3),
                        "tflops": round(flops / ms / 1e9, 1),
                        "speedup_vs_loop": round(loop_ms / ms, 2) if loop_ms else None,
                        "max_abs_diff_vs_loop": float(diff),
                    }
                ),
                flush=True,
            )


def is_gemm(name: str) -> bool:
    low = name.lower()
    return any(key in low for key in GEMM_NAMES)


def profile(args: argparse.Namespace) -> None:
    """Kernel counts of one fc1 -> SwiGLU -> fc2 forward + backward per provider."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    info = device_info()
    experts, tokens = 8, 2048
    splits = route(tokens, experts)
    weights = Experts(experts, args.hidden, args.ffn, packed=True)
    x = torch.randn(tokens, args.hidden, device="cuda", dtype=DTYPE)
    grad = torch.randn(tokens, args.hidden, device="cuda", dtype=DTYPE)
    for impl in ("loop", "torch", "triton"):
        problem = runnable(impl, x, args.hidden, args.ffn)
        if problem:
            print(json.dumps({**info, "profile": impl, "skipped": problem}))
            continue
        run = step(x, weights, splits, impl, grad)
        run()  # compile / warm up outside the trace
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gemms = sorted({e.name for e in kernels if is_gemm(e.name)})
        count = sum(1 for e in kernels if is_gemm(e.name))
        print(
            json.dumps(
                {
                    **info,
                    "profile": impl,
                    "experts": experts,
                    "projections": 2,
                    "gemm_kernels": count,
                    "gemm_kernels_per_projection_and_pass": round(count / 6, 2),
                    "all_kernels": len(kernels),
                    "gemm_kernel_names": [n[:80] for n in gemms[:6]],
                }
            ),
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="count kernels instead of timing")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_grouped_gemm: needs a CUDA or ROCm GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    profile(args) if args.profile else bench(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
