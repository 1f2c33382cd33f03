#!/usr/bin/env python3
"""FP8 MoE experts: the experts in one function (``backend.fp8_experts``) against one dense FP8
linear per expert, and against bf16's grouped GEMM, one GPU.

    python -m scripts.bench.fp8_experts [--experts 4] [--tokens 2048] [--json F]
    python -m scripts.bench.fp8_experts --smoke   # tiny CPU run, checks it works

Two figures per path, each a forward and backward of one expert layer's projection (the
0.85B Llama's FC1, 1536 -> 11008, current scaling, hybrid): ``host_us``, the host's
microseconds a step on 64 x 64 experts with 128 tokens each, whose kernels take microseconds
(what a step bound by the host pays); ``gpu_ms``, the median step between CUDA events at
``--tokens`` per expert (each expert's count moved by up to 10%, as a router's would be).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_rocm.runtime.backend import fp8 as backend_fp8
from megatron_rocm.runtime.backend import fp8_experts
from megatron_rocm.runtime.kernels import fp8
from megatron_rocm.runtime.kernels.fp8_segments import Segments
from megatron_rocm.runtime.kernels.grouped_gemm import grouped_mm
from scripts.bench.fp8_cli import device_name, fp8_device, report
from scripts.bench.timing import host_us, sampled_ms

HIDDEN, FFN = 1536, 11008  # the 0.85B Llama's FC1 (SwiGLU's two halves)


def _counts(experts: int, tokens: int) -> tuple[int, ...]:
    """Tokens per expert around ``tokens``, each a multiple of 16 (upstream's ``Fp8Padding``)."""
    spread = [((7 * e) % 5 - 2) / 20 for e in range(experts)]  # -10% .. +10%
    return tuple(max(16, round(tokens * (1 + s) / 16) * 16) for s in spread)


def _steps(
    counts: tuple[int, ...], hidden: int, out: int, device: str
) -> dict[str, Callable[[], None]]:
    """One forward + backward of each path on fresh inputs of these sizes."""
    gen = torch.Generator().manual_seed(0)
    rows = sum(counts)
    x = torch.randn(rows, hidden, generator=gen).bfloat16().to(device).requires_grad_()
    dy = torch.randn(rows, out, generator=gen).bfloat16().to(device)
    weights = [
        torch.nn.Parameter((torch.randn(out, hidden, generator=gen) * 0.02).bfloat16().to(device))
        for _ in counts
    ]
    for w in weights:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=device)
    recipe = backend_fp8.Fp8Recipe(formats=fp8.formats("hybrid"))
    segs = Segments(counts, fp8_experts.EXPERT_ROW_BUCKET)
    cache = fp8_experts.ExpertWeightCache()
    call = fp8_experts.ExpertsCall(segs, recipe, True, cache, None)

    def grouped_fp8() -> None:
        fp8_experts.fp8_experts(x, tuple(weights), call).backward(dy)

    def per_expert_fp8() -> None:
        outs = [
            backend_fp8.fp8_linear(rows_e, w, True, recipe)
            for rows_e, w in zip(x.split(counts), weights, strict=True)
        ]
        torch.cat(outs).backward(dy)

    def grouped_bf16() -> None:
        grouped_mm(x, weights, list(counts), fuse_wgrad_accumulation=True).backward(dy)

    return {
        "fp8_experts": grouped_fp8,
        "fp8_per_expert": per_expert_fp8,
        "bf16_grouped": grouped_bf16,
    }


def measure(
    experts: int, tokens: int, calls: int, iters: int, device: str, dims: tuple[int, int]
) -> dict:
    """Host microseconds on tiny experts and GPU milliseconds at ``dims`` (in, out)."""
    host = {
        name: round(host_us(step, calls, device), 1)
        for name, step in _steps((128,) * experts, 64, 64, device).items()
    }
    counts = _counts(experts, tokens)
    gpu = {
        name: round(sampled_ms(step, iters, device, warmup=3), 3)
        for name, step in _steps(counts, *dims, device).items()
    }
    return {"counts": counts, "host_us": host, "gpu_ms": gpu}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=4, help="local experts (default 4)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per expert (default 2048)")
    p.add_argument("--calls", type=int, default=300, help="host-timed steps a path (default 300)")
    p.add_argument("--iters", type=int, default=20, help="GPU-timed steps a path (default 20)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run: checks it works")
    opts = p.parse_args(argv)
    if min(opts.experts, opts.tokens, opts.calls, opts.iters) < 1:
        print("bench_fp8_experts: --experts, --tokens, --calls, --iters must be 1 or more",
              file=sys.stderr)  # fmt: skip
        return 2
    device = fp8_device("bench_fp8_experts", opts.smoke)
    if device is None:
        return 3
    if opts.smoke:
        result = measure(opts.experts, 32, 2, 1, device, (64, 48))
    else:
        result = measure(opts.experts, opts.tokens, opts.calls, opts.iters, device, (HIDDEN, FFN))
    gpu = device_name(device)
    print(f"{gpu}: {opts.experts} experts, tokens {result['counts']}")
    for name in result["host_us"]:
        print(f"{name:>16} host {result['host_us'][name]:>9} us   GPU {result['gpu_ms'][name]} ms")
    return report({"device": gpu, "experts": opts.experts, **result}, opts.json)


if __name__ == "__main__":
    sys.exit(main())
