#!/usr/bin/env python3
"""The FP8 weight gradient added into ``main_grad`` by its own GEMM (a Triton kernel) against
``torch._scaled_mm`` followed by ``main_grad.add_``, the FP8 linear's way, one GPU.

    python -m scripts.bench.fp8_wgrad_accum [--shapes 8b|0.85b|MxNxK,...] [--blocks] [--json F]
    TRITON_INTERPRET=1 python -m scripts.bench.fp8_wgrad_accum --smoke [--blocks]   # CPU check

``torch._scaled_mm`` cannot accumulate into its output, so with gradient-accumulation fusion
the FP8 linear writes its weight gradient in fp32 and adds it into ``main_grad``: one more
pass over the weight's size a micro-batch, which the bf16 path's GEMM does not make. A GEMM
that adds in its epilogue saves that pass. The question is its accumulation: Hopper's FP8
tensor cores sum a dot product in reduced precision unless the kernel promotes the partial
sums to fp32 every few K steps, as cuBLASLt does by default (``torch._scaled_mm`` without
``use_fast_accum``, and TE for its weight gradients). Triton promotes every
``max_num_imprecise_acc`` elements of K when asked (``tl.dot``), else sums all of K in the
tensor cores' precision.

For each shape ``MxNxK`` (``fp8_linear``'s: the weight gradient ``[N, K]`` reduces over the M
tokens) and each ``main_grad`` dtype (fp32, and bf16 as ``--grad-reduce-in-bf16`` makes it):
``torch`` (``_scaled_mm`` in fp32, then ``add_``), ``torch_fast`` (the same with
``use_fast_accum``), ``blaslt`` (on a GPU: ``kernels.fp8_accumulate``, cuBLASLt or hipBLASLt
adding in the GEMM's epilogue, what the FP8 linears use), ``triton_fast`` (the Triton GEMM,
whole-K accumulation in the tensor cores) and ``triton_promoted`` (promoted after every tile of
128 tokens):
milliseconds, TFLOP/s (2MNK) and the largest error against fp32 math on the same FP8 operands,
relative to the result's largest magnitude. Times are medians of CUDA-graph replays.

``--blocks``: block scaling's weight gradient (``--fp8-recipe blockwise``), both operands with
an inverse scale per 128 tokens (powers of two that differ block by block): ``torch``
(``_scaled_mm`` with the 1 x 128 scales, then ``add_``), ``blaslt`` (``accumulate(blocks=True)``:
cuBLASLt's 1 x 128 scale modes with ``beta = 1``, what the block-scaled linears run on CUDA)
and ``triton_block`` (``fp8_blockwise_triton.block_mm`` adding into ``main_grad``, what they
run on ROCm).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from megatron_rocm.runtime.kernels import fp8_accumulate, fp8_blockwise
from scripts.bench import timing as bench_timing
from scripts.bench.fp8_cli import (
    add_interpreted_smoke,
    device_name,
    fp8_device,
    interpreter_missing,
    report,
)
from scripts.bench.fp8_linear import parse_shapes

SMOKE = [(80, 150, 40)]  # a partial tile on every side, more tiles of N than one group
# (BLOCK_N, BLOCK_K, BLOCK_T, warps, stages): the best of a small sweep on an H200; the
# smoke run's tiles are small enough for the interpreter
TILES = {"cuda": (128, 256, 128, 8, 3), "cpu": (16, 16, 32, 4, 1)}


@triton.jit
def _wgrad_accumulate(
    dy_t, x_t, main_grad, dy_inv, x_inv, N, K, T,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, GROUP: tl.constexpr,
    PROMOTE: tl.constexpr,
):  # fmt: skip
    """``main_grad[N, K] += dy_inv * x_inv * dy_t[N, T] @ x_t[K, T]^T``, both FP8 operands
    row-major with the tokens contiguous (the layouts ``quantize_transposed`` writes)."""
    pid = tl.program_id(0)
    tiles_n, tiles_k = tl.cdiv(N, BLOCK_N), tl.cdiv(K, BLOCK_K)
    per_group = GROUP * tiles_k
    first_n = (pid // per_group) * GROUP
    group_n = tl.minimum(tiles_n - first_n, GROUP)
    pid_n = first_n + (pid % per_group) % group_n
    pid_k = (pid % per_group) // group_n
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rt = tl.arange(0, BLOCK_T)
    a = dy_t + (rn % N)[:, None].to(tl.int64) * T + rt[None, :]
    b = x_t + (rk % K)[:, None].to(tl.int64) * T + rt[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for step in range(0, tl.cdiv(T, BLOCK_T)):
        inside = rt[None, :] < T - step * BLOCK_T
        acc = tl.dot(
            tl.load(a, mask=inside, other=0.0),
            tl.trans(tl.load(b, mask=inside, other=0.0)),
            acc,
            max_num_imprecise_acc=PROMOTE,
        )
        a += BLOCK_T
        b += BLOCK_T
    acc = acc * (tl.load(dy_inv) * tl.load(x_inv))
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    out = main_grad + rn[:, None].to(tl.int64) * K + rk[None, :]
    total = tl.load(out, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(out, total.to(main_grad.dtype.element_ty), mask=mask)


def wgrad_accumulate(
    dy_t: torch.Tensor,
    x_t: torch.Tensor,
    main_grad: torch.Tensor,
    dy_inv: torch.Tensor,
    x_inv: torch.Tensor,
    promote: bool,
) -> None:
    """``_wgrad_accumulate`` on contiguous operands, in place on ``main_grad``; ``promote``:
    the partial sums promoted to fp32 after every tile of tokens, else summed over all of them
    in the tensor cores' precision."""
    (n, t), k = dy_t.shape, x_t.shape[0]
    block_n, block_k, block_t, warps, stages = TILES[main_grad.device.type]
    grid = (triton.cdiv(n, block_n) * triton.cdiv(k, block_k),)
    _wgrad_accumulate[grid](
        dy_t, x_t, main_grad, dy_inv, x_inv, n, k, t, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_T=block_t, GROUP=8, PROMOTE=block_t if promote else None, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def torch_accumulate(
    dy_t: torch.Tensor,
    x_t: torch.Tensor,
    main_grad: torch.Tensor,
    dy_inv: torch.Tensor,
    x_inv: torch.Tensor,
    fast: bool = False,
) -> None:
    """The FP8 linear's way: the GEMM in fp32, then an add (fp32 emulation on the CPU).
    ``fast``: ``use_fast_accum``, the whole sum in the tensor cores' precision (what the FP8
    linear does not use for its weight gradient)."""
    if dy_t.is_cuda:
        wgrad = torch._scaled_mm(
            dy_t, x_t.t(), scale_a=dy_inv, scale_b=x_inv, out_dtype=torch.float32,
            use_fast_accum=fast,
        )  # fmt: skip
    else:
        wgrad = (dy_t.float() @ x_t.float().t()) * (dy_inv * x_inv)
    main_grad.add_(wgrad)


def blas_accumulate(
    dy_t: torch.Tensor,
    x_t: torch.Tensor,
    main_grad: torch.Tensor,
    dy_inv: torch.Tensor,
    x_inv: torch.Tensor,
) -> None:
    """The FP8 linears' way on a GPU: the BLAS adds into ``main_grad`` in the GEMM itself."""
    if not fp8_accumulate.accumulate(main_grad, dy_t, dy_inv, x_t.t(), x_inv):
        raise RuntimeError("fp8_accumulate declined: this GPU's BLAS path is not available")


def _block_inverses(tokens: int, rows: int, low: int, device: str) -> torch.Tensor:
    """Inverse scales [ceil(tokens/128), rows], powers of two from 2^low to 2^(low+3)."""
    powers = torch.randint(low, low + 4, (-(-tokens // 128), rows), device=device)
    return torch.exp2(powers.float())


def _dequantized(data: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """fp32 values of ``data`` [rows, tokens] with 1 x 128 inverse scales [blocks, rows]."""
    return fp8_blockwise.dequantize_rows(fp8_blockwise.Blocks(data, inv.t()))


def block_paths(dy_t, x_t, dy_inv, x_inv, device):  # noqa: ANN001, ANN201
    """The block-scaled weight gradient's ways of adding into ``main_grad``."""
    from megatron_rocm.runtime.kernels import fp8_blockwise_triton

    def torch_add(g: torch.Tensor) -> None:
        if device == "cuda":
            product = torch._scaled_mm(dy_t, x_t.t(), scale_a=dy_inv.t(), scale_b=x_inv,
                                       out_dtype=torch.float32)  # fmt: skip
        else:
            product = _dequantized(dy_t, dy_inv) @ _dequantized(x_t, x_inv).t()
        g.add_(product)

    def blas(g: torch.Tensor) -> None:
        if not fp8_accumulate.accumulate(g, dy_t, dy_inv, x_t.t(), x_inv, blocks=True):
            raise RuntimeError(
                "fp8_accumulate declined: cuBLASLt's block-scaled path is not available"
            )

    paths = {
        "torch": torch_add,
        "blaslt": blas,
        "triton_block": lambda g: fp8_blockwise_triton.block_mm(
            dy_t, dy_inv.t(), x_t, x_inv.t(), False, g, True
        ),
    }
    if device != "cuda":
        del paths["blaslt"]
    return paths


def bench_shape(
    shape: tuple[int, int, int], grad_dtype: torch.dtype, device: str, blocks: bool = False
) -> dict:
    tokens, n, k = shape
    torch.manual_seed(0)
    dy_t = torch.randn(n, tokens, device=device).to(torch.float8_e5m2)
    x_t = torch.randn(k, tokens, device=device).to(torch.float8_e4m3fn)
    start = torch.randn(n, k, device=device).to(grad_dtype)
    if blocks:
        dy_inv = _block_inverses(tokens, n, -10, device)
        x_inv = _block_inverses(tokens, k, -8, device)
        product = _dequantized(dy_t, dy_inv) @ _dequantized(x_t, x_inv).t()
        # a start of the product's own size: against a larger one a wrong sum hides in bf16
        start = (torch.randn(n, k, device=device) * product.abs().max()).to(grad_dtype)
        want = start.float() + product
        return _timed(shape, grad_dtype, device, start, want,
                      block_paths(dy_t, x_t, dy_inv, x_inv, device))  # fmt: skip
    dy_inv = torch.tensor(0.5, device=device)
    x_inv = torch.tensor(0.25, device=device)
    want = start.float() + (dy_t.float() @ x_t.float().t()) * (dy_inv * x_inv)
    paths = {
        "torch": lambda g: torch_accumulate(dy_t, x_t, g, dy_inv, x_inv),
        "torch_fast": lambda g: torch_accumulate(dy_t, x_t, g, dy_inv, x_inv, fast=True),
        "blaslt": lambda g: blas_accumulate(dy_t, x_t, g, dy_inv, x_inv),
        "triton_fast": lambda g: wgrad_accumulate(dy_t, x_t, g, dy_inv, x_inv, False),
        "triton_promoted": lambda g: wgrad_accumulate(dy_t, x_t, g, dy_inv, x_inv, True),
    }
    if device != "cuda":
        del paths["blaslt"]
    return _timed(shape, grad_dtype, device, start, want, paths)


def _timed(
    shape: tuple[int, int, int],
    grad_dtype: torch.dtype,
    device: str,
    start: torch.Tensor,
    want: torch.Tensor,
    paths: dict,
) -> dict:
    """Each path's time, TFLOP/s and error against ``want`` (fp32 math from ``start``)."""
    tokens, n, k = shape
    row: dict = {"shape": f"{tokens}x{n}x{k}", "main_grad": str(grad_dtype).removeprefix("torch.")}
    scratch = torch.zeros_like(start)
    for name, path in paths.items():
        got = start.clone()
        path(got)
        error = ((got.float() - want).abs().max() / want.abs().max()).item()
        ms = bench_timing.median_ms(lambda p=path: p(scratch), device, cuda_graph=device == "cuda")
        row[name] = {
            "ms": round(ms, 4),
            "tflops": round(2 * tokens * n * k / ms / 1e9, 1),
            "rel_error": float(f"{error:.3g}"),
        }
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="8b", help="8b, 0.85b or MxNxK, comma-separated")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument(
        "--blocks",
        action="store_true",
        help="block scaling's 1 x 128 scales (--fp8-recipe blockwise)",
    )
    add_interpreted_smoke(p)
    opts = p.parse_args(argv)
    if interpreter_missing("bench_fp8_wgrad_accum", opts.smoke):
        return 2
    shapes = SMOKE if opts.smoke else parse_shapes(opts.shapes, "bench_fp8_wgrad_accum")
    device = fp8_device("bench_fp8_wgrad_accum", opts.smoke)
    if device is None:
        return 3
    rows = [
        bench_shape(shape, dtype, device, opts.blocks)
        for shape in shapes
        for dtype in (torch.float32, torch.bfloat16)
    ]
    for r in rows:
        print(
            f"{r['shape']:>18} main_grad {r['main_grad']:>8}: "
            + ", ".join(
                f"{name} {r[name]['ms']} ms ({r[name]['tflops']} TFLOP/s, error "
                f"{r[name]['rel_error']:.2g})"
                for name in (
                    "torch",
                    "torch_fast",
                    "blaslt",
                    "triton_fast",
                    "triton_promoted",
                    "triton_block",
                )  # fmt: skip
                if name in r
            )
        )
    return report({"device": device_name(device), "blocks": opts.blocks, "rows": rows}, opts.json)


if __name__ == "__main__":
    sys.exit(main())
