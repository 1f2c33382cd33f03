#!/usr/bin/env python3
"""GPU time of ``--fp8-param-gather``'s own work in one step, one GPU, the 8B's layer weights.

    python -m scripts.bench.fp8_param_gather [--layers 8] [--dp 2] [--json F]
    python -m scripts.bench.fp8_param_gather --smoke   # tiny CPU run, checks it works

With the flag, each step the distributed optimizer casts this rank's fp32 main shard of every
FP8 weight into the byte buffer (``fp8_param.quantize_param_shard``) and, after the
all-gather, every weight's transpose is rebuilt for the input gradient's GEMM
(``Fp8State.transposed``). Without it, the forward quantizes every gathered bf16 weight with its
transpose (``quantize_transposed``). This times the three per step for ``--layers`` of Llama-3
8B's layers (QKV, output projection, FC1, FC2) with ``1/--dp`` of each weight's elements in the
shard, under current and delayed scaling, on the kernels and on torch's reference path
(``MEGATRON_ROCM_KERNELS=reference:fp8``). Milliseconds a step: the median of ``--iters``
steps between CUDA events; the all-gather and the GEMMs are not in it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from megatron_rocm.runtime.backend import fp8 as backend_fp8
from megatron_rocm.runtime.backend import fp8_param
from megatron_rocm.runtime.kernels import fp8
from scripts.bench.fp8_cli import device_name, fp8_device, report
from scripts.bench.fp8_linear import example_history
from scripts.bench.timing import environment, sampled_ms

HIDDEN, FFN, QKV = 4096, 14336, 6144  # Llama-3 8B: 32 query heads and 8 KV groups of 128
LAYER = ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * FFN, HIDDEN), (HIDDEN, FFN))  # [out, in]
SMOKE_LAYER = ((96, 64), (64, 64), (256, 64), (64, 128))


def _recipe(delayed: bool) -> backend_fp8.Fp8Recipe:
    histories = (example_history(), example_history(), example_history())
    return backend_fp8.Fp8Recipe(
        formats=fp8.formats("hybrid"),
        delayed=backend_fp8.DelayedScaling(*histories) if delayed else None,
    )


def _weights(shapes: list[tuple[int, int]], device: str, delayed: bool) -> list:
    """One bf16 linear's FP8 weight (``fp8_param.convert_weight``) a shape."""
    out = []
    for rows, cols in shapes:
        with torch.no_grad():
            linear = torch.nn.Linear(cols, rows, bias=False, device=device, dtype=torch.bfloat16)
        fp8_param.convert_weight(linear, _recipe(delayed))
        out.append(linear.weight)
    return out


def _pieces(shapes: list[tuple[int, int]], dp: int, device: str, delayed: bool) -> dict:
    """The three pieces of one step as calls, on fresh weights of ``shapes``."""
    params = _weights(shapes, device, delayed)
    mains = [torch.randn(p.numel() // dp, device=device) * 0.02 for p in params]
    bf16 = [p.dequantize() for p in params]
    histories = [example_history() if delayed else None for _ in params]
    fmt = fp8.formats("hybrid").forward

    def shard_casts() -> None:
        fp8_param.quantize_param_shard(params, mains, [0] * len(params), None)

    def transposes() -> None:
        for p in params:
            p._fp8.stale()
            p._fp8.transposed()

    def without_the_flag() -> None:  # the forward's quantize of each gathered bf16 weight
        for w, history in zip(bf16, histories):
            fp8.quantize_transposed(w, fmt, 0, history)

    return {
        "shard_casts": shard_casts,
        "transposes": transposes,
        "without_the_flag": without_the_flag,
    }


def measure(shapes: list[tuple[int, int]], dp: int, iters: int, device: str) -> dict:
    """Milliseconds a step of each piece, by recipe and path."""
    results: dict[str, dict[str, float]] = {}
    for recipe in ("tensorwise", "delayed"):
        pieces = _pieces(shapes, dp, device, delayed=recipe == "delayed")
        for path, kernels in (("kernels", ""), ("torch", "reference:fp8")):
            with environment(MEGATRON_ROCM_KERNELS=kernels):
                results[f"{recipe}_{path}"] = {
                    name: round(sampled_ms(fn, iters, device, warmup=3), 3)
                    for name, fn in pieces.items()
                }
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8, help="8B layers (default 8: the 8b-slice)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks sharing each weight")
    p.add_argument("--iters", type=int, default=20, help="steps timed (default 20)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run: checks it works")
    opts = p.parse_args(argv)
    if min(opts.layers, opts.dp, opts.iters) < 1:
        print(
            "bench_fp8_param_gather: --layers, --dp and --iters must be 1 or more", file=sys.stderr
        )
        return 2
    device = fp8_device("bench_fp8_param_gather", opts.smoke)
    if device is None:
        return 3
    layer = SMOKE_LAYER if opts.smoke else LAYER
    shapes = [shape for _ in range(opts.layers) for shape in layer]
    iters = 2 if opts.smoke else opts.iters
    ms = measure(shapes, opts.dp, iters, device)
    gpu = device_name(device)
    print(f"{gpu}: ms a step, {len(shapes)} weights, 1/{opts.dp} of each in the shard")
    for key, pieces in ms.items():
        print(f"{key:>20} " + "  ".join(f"{k} {v:>8}" for k, v in pieces.items()))
    result = {"device": gpu, "weights": len(shapes), "dp": opts.dp, "iters": iters, "ms": ms}
    return report(result, opts.json)


if __name__ == "__main__":
    sys.exit(main())
