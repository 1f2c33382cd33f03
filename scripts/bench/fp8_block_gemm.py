#!/usr/bin/env python3
"""The three GEMMs of a block-scaled FP8 linear (``--fp8-recipe blockwise``) on the Triton
kernel that ROCm runs, against cuBLASLt's block-scaled kernels and bf16, one GPU.

    python -m scripts.bench.fp8_block_gemm [--shapes 8b|0.85b|MxNxK,...] [--json F]
    TRITON_INTERPRET=1 python -m scripts.bench.fp8_block_gemm --smoke   # CPU check

hipBLASLt has no block-scaled FP8 GEMM, so on ROCm every GEMM of block scaling runs on
``fp8_blockwise_triton.block_mm``; on an NVIDIA GPU the same kernel serves the problems
cuBLASLt computes wrong (``fp8_blockwise.cublaslt_takes``). This times it where it can be
compared. For each shape ``MxNxK`` (``fp8_linear``'s: ``y[M, N] = x[M, K] W[N, K]^T``):

* ``forward``: ``x`` in 1 x 128 blocks times the weight's 128 x 128 tiles, into bf16;
* ``dgrad``: the E5M2 output gradient in 1 x 128 blocks times the weight's tiles transposed;
* ``wgrad``: both over the tokens in 1 x 128 blocks, added into an fp32 ``main_grad``.

Paths: ``triton`` (the kernel), ``cublaslt`` (``torch._scaled_mm`` with the block scales, where
cuBLASLt takes the problem; the wgrad's product then added) and ``bf16`` (``torch.mm`` of the
same sizes, the speed FP8 has to beat). Each row gives milliseconds, TFLOP/s (2MNK) and the
largest error against fp32 math on the dequantized operands, relative to the largest value.
Times are medians of CUDA-graph replays.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_rocm.runtime.kernels import fp8
from megatron_rocm.runtime.kernels import fp8_blockwise as bw
from scripts.bench import timing as bench_timing
from scripts.bench.fp8_cli import (
    add_interpreted_smoke,
    device_name,
    fp8_device,
    interpreter_missing,
    report,
)
from scripts.bench.fp8_linear import SHAPES, parse_shapes

PROG = "bench_fp8_block_gemm"
SMOKE = [(96, 256, 300)]  # K past a multiple of 128, M past a tile


def _spread(rows: int, cols: int, low: float, device: str, g: torch.Generator) -> torch.Tensor:
    """Normal values times magnitudes from 10^low to 100 times that, growing along the rows and
    along the columns: every block and tile has a scale of its own."""
    across = torch.logspace(low, low + 1, cols, device=device)
    down = torch.logspace(0, 1, rows, device=device)[:, None]
    return torch.randn(rows, cols, device=device, generator=g) * across * down


def _operands(m: int, n: int, k: int, device: str) -> dict:
    """Quantized operands of one linear in the GPU's FP8 formats (``--fp8-format hybrid``:
    OCP on CUDA and gfx950, fnuz on gfx942)."""
    g = torch.Generator(device=device).manual_seed(0)
    fmt = fp8.formats("hybrid")
    x_rows, x_t = bw.quantize_rows(_spread(m, k, -1, device, g).bfloat16(), fmt.forward, True)
    dy_rows, dy_t = bw.quantize_rows(_spread(m, n, -4, device, g).bfloat16(), fmt.backward, True)
    w_tiles, w_t = bw.quantize_tiles(_spread(n, k, -3, device, g).bfloat16(), fmt.forward, True)
    return {
        "forward": (x_rows, w_tiles, True),
        "dgrad": (dy_rows, w_t, True),
        "wgrad": (dy_t, x_t, False),
    }


def _paths(a: bw.Blocks, b: bw.Blocks, b_tiles: bool, out: torch.Tensor, device: str) -> dict:
    """name -> a call writing (or, for the wgrad, adding) ``a @ b^T`` into ``out``."""
    from megatron_rocm.runtime.kernels import fp8_blockwise_triton as kernels

    add = not b_tiles
    paths: dict[str, Callable[[], object]] = {
        "triton": lambda: kernels.block_mm(a.data, a.inv, b.data, b.inv, b_tiles, out, add)
    }
    problem = bw._problem(a, b, b_tiles, out.dtype)
    if device == "cuda" and not torch.version.hip and bw.cublaslt_takes(problem):

        def cublaslt() -> None:
            product = bw._scaled_mm(a, b, b_tiles, out.dtype)
            if add:
                out.add_(product)
            else:
                out.copy_(product)

        paths["cublaslt"] = cublaslt
    if device == "cuda":
        lhs = torch.randn(a.data.shape, device=device, dtype=torch.bfloat16)
        rhs = torch.randn(b.data.shape, device=device, dtype=torch.bfloat16)
        paths["bf16"] = lambda: torch.mm(lhs, rhs.t())
    return paths


def bench_shape(shape: tuple[int, int, int], device: str) -> list[dict]:
    m, n, k = shape
    rows = []
    for gemm, (a, b, b_tiles) in _operands(m, n, k, device).items():
        want = bw._emulated(a, b, b_tiles)  # fp32 math on the dequantized operands
        rows_out, cols_out = want.shape
        dtype = torch.float32 if not b_tiles else torch.bfloat16
        start = torch.zeros(rows_out, cols_out, device=device, dtype=dtype)
        flops = 2 * rows_out * cols_out * a.data.shape[1]
        row: dict = {"shape": f"{m}x{n}x{k}", "gemm": gemm,
                     "mnk": [rows_out, cols_out, a.data.shape[1]]}  # fmt: skip
        for name, path in _paths(a, b, b_tiles, start, device).items():
            start.zero_()
            path()
            entry = {}
            if name != "bf16":  # the FP8 paths write (or add) into ``start``
                error = (start.float() - want).abs().max() / want.abs().max()
                entry["rel_error"] = float(f"{error.item():.3g}")
            ms = bench_timing.median_ms(path, device, cuda_graph=device == "cuda")
            entry.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
            row[name] = entry
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="8b,0.85b",
                   help=f"{', '.join(SHAPES)} or MxNxK, comma-separated")  # fmt: skip
    p.add_argument("--json", type=Path, help="also write the results here")
    add_interpreted_smoke(p)
    opts = p.parse_args(argv)
    if interpreter_missing(PROG, opts.smoke):
        return 2
    shapes = SMOKE if opts.smoke else parse_shapes(opts.shapes, PROG)
    device = fp8_device(PROG, opts.smoke)
    if device is None:
        return 3
    rows = [row for shape in shapes for row in bench_shape(shape, device)]
    for r in rows:
        print(
            f"{r['shape']:>18} {r['gemm']:>7} {'x'.join(map(str, r['mnk'])):>18}: "
            + ", ".join(
                f"{name} {r[name]['ms']} ms ({r[name]['tflops']} TFLOP/s"
                + (f", error {r[name]['rel_error']:.2g})" if "rel_error" in r[name] else ")")
                for name in ("triton", "cublaslt", "bf16")
                if name in r
            )
        )
    return report({"device": device_name(device), "rows": rows}, opts.json)


if __name__ == "__main__":
    sys.exit(main())
