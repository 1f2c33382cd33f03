#!/usr/bin/env python3
"""Host time of the FP8 linear's pieces: microseconds the CPU spends issuing each call, one GPU.

    python -m scripts.bench.fp8_host [--calls 2000] [--json F]
    python -m scripts.bench.fp8_host --smoke   # tiny CPU run, checks it works

Where a step's kernels are shorter than their launches the GPU waits on the host, and a
profiled step (``trace_summary.py``) cannot say how much of its idle is the profiler's own host
time; this benchmark measures the host alone. Every piece runs on 64 x 64 tensors,
whose kernels take a few microseconds, so the wall time of ``calls`` back-to-back calls (one
synchronize at the end) is the host's: the Triton launches (an empty kernel's launch is the
yardstick), ``torch._scaled_mm``, one quantize under delayed scaling, and the forward and
backward of a linear in bf16 and in FP8 (current and delayed scaling, the weight gradient added
into an fp32 ``main_grad``, the weight quantized once and reused as in a step's later
micro-batches).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_rocm.runtime.backend import fp8 as backend_fp8
from megatron_rocm.runtime.kernels import fp8, launch
from scripts.bench.fp8_cli import device_name, fp8_device, report
from scripts.bench.fp8_linear import example_history
from scripts.bench.timing import host_us

SIZE = 64


def _empty_kernel() -> Callable[[torch.Tensor], None]:
    """An empty Triton kernel's launcher (one pointer): what any launch costs at least."""
    import triton

    @triton.jit
    def _empty(x):
        pass

    return lambda t: _empty[(1,)](t)


def _linear_step(
    x: torch.Tensor,
    w: torch.nn.Parameter,
    dy: torch.Tensor,
    recipe: backend_fp8.Fp8Recipe | None,
    reuse: bool | None,
) -> Callable[[], None]:
    """One forward and backward of the linear (bf16 where ``recipe`` is None). ``x`` is a leaf
    whose gradient accumulates across calls: one add a step, in place of the gradient a layer
    hands back to the one before it."""
    from megatron_rocm.runtime.backend._linear_function import LinearFunction

    def step() -> None:
        if recipe is None:
            out = LinearFunction.apply(x, w, True)
        else:
            out = backend_fp8.fp8_linear(x, w, True, recipe, reuse)
        out.backward(dy)

    return step


def measure(calls: int, device: str) -> dict[str, float]:
    """Host microseconds a call of each piece on ``device``; the Triton pieces on a GPU only
    (the interpreter's speed says nothing about a launch)."""
    dtype = torch.bfloat16
    fmts = fp8.formats("hybrid")
    fwd = fmts.forward
    x = torch.randn(SIZE, SIZE, device=device, dtype=dtype)
    w = torch.randn(SIZE, SIZE, device=device, dtype=dtype)
    x8, x_inv = fp8.quantize(x, fwd)
    w8, w_inv = fp8.quantize(w, fwd)
    us: dict[str, float] = {}
    on_gpu = device == "cuda" and launch.triton_available()
    if on_gpu:
        empty = _empty_kernel()
        us["triton_empty_launch"] = host_us(lambda: empty(x), calls, device)
        from megatron_rocm.runtime.kernels import fp8_triton

        history = example_history()
        fp8.quantize_transposed(x, fwd, 0, history)  # the first quantize starts the history
        fp8_max = float(torch.finfo(fwd).max)
        us["delayed_update"] = host_us(
            lambda: history.advance(fp8_max, 0, triton=True), calls, device
        )
        us["cast_transpose"] = host_us(
            lambda: fp8_triton.cast_transpose(
                x, history.scale, fwd, fp8_max, SIZE, history.current
            ),
            calls,
            device,
        )
        us["quantize_transposed_delayed"] = host_us(
            lambda: fp8.quantize_transposed(x, fwd, 0, history), calls, device
        )
    us["mm_bf16"] = host_us(lambda: torch.mm(x, w.t()), calls, device)
    us["fp8_mm"] = host_us(lambda: fp8.fp8_mm(x8, x_inv, w8.t(), w_inv, dtype), calls, device)
    xg = x.clone().requires_grad_()
    wp = torch.nn.Parameter(w.clone())
    wp.main_grad = torch.zeros(SIZE, SIZE, device=device, dtype=torch.float32)
    dy = torch.randn(SIZE, SIZE, device=device, dtype=dtype)

    current = backend_fp8.Fp8Recipe(formats=fmts)
    delayed = backend_fp8.Fp8Recipe(
        formats=fmts,
        delayed=backend_fp8.DelayedScaling(example_history(), example_history(), example_history()),
    )
    us["linear_bf16"] = host_us(_linear_step(xg, wp, dy, None, None), calls, device)
    for name, recipe in (("linear_fp8", current), ("linear_fp8_delayed", delayed)):
        _linear_step(xg, wp, dy, recipe, False)()  # quantize the weight once and keep it
        us[name] = host_us(_linear_step(xg, wp, dy, recipe, True), calls, device)
    return {key: round(value, 1) for key, value in us.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000, help="calls timed per piece (default 2000)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument(
        "--smoke", action="store_true", help="tiny CPU run (10 calls a piece): checks it works"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="then measure again under cProfile and print its top functions (the figures "
        "reported are the first, unprofiled measurement's)",
    )
    opts = p.parse_args(argv)
    if opts.calls < 1:
        print("bench_fp8_host: --calls must be 1 or more", file=sys.stderr)
        return 2
    device = fp8_device("bench_fp8_host", opts.smoke)
    if device is None:
        return 3
    calls = 10 if opts.smoke else opts.calls
    us = measure(calls, device)
    if opts.profile:  # a second pass: cProfile's own cost stays out of the figures
        profiler = cProfile.Profile()
        profiler.runcall(measure, calls, device)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    gpu = device_name(device)
    print(f"{gpu}: host microseconds a call ({SIZE} x {SIZE} tensors)")
    for key, value in us.items():
        print(f"{key:>28} {value:>8}")
    return report({"device": gpu, "size": SIZE, "calls": calls, "host_us": us}, opts.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
