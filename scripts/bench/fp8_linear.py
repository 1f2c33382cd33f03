#!/usr/bin/env python3
"""bf16 against FP8 (current and delayed scaling, ``torch._scaled_mm``) for the linears' GEMMs,
one GPU.

    python -m scripts.bench.fp8_linear [--shapes 8b|0.85b|MxNxK,...] [--format hybrid] [--json F]
    python -m scripts.bench.fp8_linear --smoke   # tiny CPU run, checks it works

A shape ``MxNxK`` is ``y[M, N] = x[M, K] W[N, K]^T``: M tokens, N output and K input features.
``8b`` is Llama-3 8B's four linears at 8192 tokens (one sequence of the example's 8k: QKV
4096 -> 6144, output 4096 -> 4096, fc1 4096 -> 2 x 14336, fc2 14336 -> 4096); ``0.85b`` the
0.85B Llama of ``scripts.training.train_small`` at micro-batch 16 x 2048. For each shape:

* ``gemm``: one GEMM alone, ``torch.mm`` in bf16 against ``torch._scaled_mm`` on operands
  already in FP8 (the ceiling the FP8 path can reach);
* ``quantize``: the input's quantization, eager torch against ``fp8_triton``'s three launches
  (what a GPU runs), and with the transpose the weight gradient needs (``quantize_transposed``);
  on a GPU also under delayed scaling (``quantize_delayed_transposed``: two launches, one read,
  with the 8B example's history of 1024 amaxes), and the cast-transpose alone, its integer
  encode against the hardware conversion on NVIDIA GPUs and, with the GPU's default cast,
  recording the input's amax as delayed scaling does (``cast_transpose_*``; TB/s count the
  bf16 read and both FP8 writes);
* ``linear``: forward and backward of one linear (three GEMMs) as training runs it, the
  native ``LinearFunction`` in bf16 against ``Fp8LinearFunction`` (quantization included),
  with the weight gradient accumulated into an fp32 ``main_grad``, under current scaling
  (``linear_fp8``) and delayed scaling (``linear_fp8_delayed``).

TFLOP/s count 2MNK per GEMM. Each time is the median of ``triton.testing.do_bench``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from megatron_rocm.runtime.backend import fp8 as backend_fp8
from megatron_rocm.runtime.kernels import fp8
from scripts.bench import timing as bench_timing
from scripts.bench.fp8_cli import device_name, fp8_device, report

SHAPES = {
    "8b": [(8192, 6144, 4096), (8192, 4096, 4096), (8192, 28672, 4096), (8192, 4096, 14336)],
    "0.85b": [(32768, 2560, 1536), (32768, 1536, 1536), (32768, 11008, 1536), (32768, 1536, 5504)],
}
SMOKE = [(48, 32, 64)]


def parse_shapes(text: str, prog: str = "bench_fp8_linear") -> list[tuple[int, int, int]]:
    """``--shapes``: named sets and ``MxNxK`` items; a bad item exits 2 with one line."""
    shapes: list[tuple[int, int, int]] = []
    for item in text.split(","):
        if item in SHAPES:
            shapes += SHAPES[item]
            continue
        try:
            m, n, k = (int(v) for v in item.lower().split("x"))
            if min(m, n, k) < 1:
                raise ValueError(item)
        except ValueError:
            print(
                f"{prog}: bad shape {item!r}: expected MxNxK (each at least 1), 8b or 0.85b",
                file=sys.stderr,
            )
            raise SystemExit(2) from None
        shapes.append((m, n, k))
    return shapes


def _linear_step(x, w, dy, fp8_recipe):  # noqa: ANN001, ANN202
    from megatron_rocm.runtime.backend._linear_function import LinearFunction

    def step() -> None:
        x.grad = None
        if fp8_recipe is None:
            out = LinearFunction.apply(x, w, True)
        else:
            out = backend_fp8.fp8_linear(x, w, True, fp8_recipe)
        out.backward(dy)

    return step


def example_history() -> fp8.AmaxHistory:
    """An amax history as upstream's 8B example configures it (1024 amaxes, ``max``)."""
    return fp8.AmaxHistory(1024, most_recent=False)


def _cast_transpose_ms(x: torch.Tensor, dtype: torch.dtype) -> dict[str, float]:
    """``fp8_triton``'s cast-transpose alone (scale known, as under delayed scaling), its
    integer encode against the hardware conversion where the GPU has one (NVIDIA, OCP
    formats; both write the same bytes, the GPU tests), and the default cast recording the
    amax (``RECORD``: what delayed scaling runs)."""
    from megatron_rocm.runtime.kernels import fp8_triton

    fp8_max = torch.finfo(dtype).max
    scale, _ = fp8_triton.scales(x, fp8_max, 1.0)  # margin 0: a factor of 2**0
    casts = {"cast_transpose_encode": False}
    if fp8_triton.HARDWARE_CAST and fp8_triton.cast_kind(dtype, x.device):
        casts["cast_transpose_hardware"] = True
    ms = {}
    for key, hardware in casts.items():
        saved, fp8_triton.HARDWARE_CAST = fp8_triton.HARDWARE_CAST, hardware
        try:
            ms[key] = bench_timing.median_ms(
                lambda: fp8_triton.cast_transpose(x, scale, dtype, fp8_max, x.shape[0]),
                x.device.type,
            )
        finally:
            fp8_triton.HARDWARE_CAST = saved
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    ms["cast_transpose_record"] = bench_timing.median_ms(  # delayed scaling's: amax recorded
        lambda: fp8_triton.cast_transpose(x, scale, dtype, fp8_max, x.shape[0], amax),
        x.device.type,
    )
    return ms


def bench_shape(shape: tuple[int, int, int], fmt: str, device: str) -> dict:
    m, n, k = shape
    dtype = torch.bfloat16
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
    dy = torch.randn(m, n, device=device, dtype=dtype)
    formats = fp8.formats(fmt)
    x8, x_inv = fp8.quantize(x, formats.forward)
    w8, w_inv = fp8.quantize(w, formats.forward)
    flop = 2.0 * m * n * k

    def tflops(ms: float, gemms: int = 1) -> float:
        return gemms * flop / ms / 1e9

    ms = {
        "gemm_bf16": bench_timing.median_ms(lambda: torch.mm(x, w.t()), device),
        "gemm_fp8": bench_timing.median_ms(
            lambda: fp8.fp8_mm(x8, x_inv, w8.t(), w_inv, dtype, fast_accum=True), device
        ),
    }
    ms["quantize_eager"] = bench_timing.median_ms(
        lambda: fp8.quantize(x, formats.forward, triton=False), device
    )
    if device == "cuda":  # the interpreter's speed means nothing: GPU runs only
        ms["quantize_triton"] = bench_timing.median_ms(
            lambda: fp8.quantize(x, formats.forward, triton=True), device
        )
        ms["quantize_transposed"] = bench_timing.median_ms(
            lambda: fp8.quantize_transposed(x, formats.forward), device
        )
        history = example_history()
        fp8.quantize_transposed(x, formats.forward, 0, history)  # the first: current scaling
        ms["quantize_delayed_transposed"] = bench_timing.median_ms(
            lambda: fp8.quantize_transposed(x, formats.forward, 0, history), device
        )
        ms |= _cast_transpose_ms(x, formats.forward)
    xg = x.clone().requires_grad_()
    wp = torch.nn.Parameter(w.clone())
    wp.main_grad = torch.zeros(n, k, device=device, dtype=torch.float32)
    recipe = backend_fp8.Fp8Recipe(formats=formats)
    ms["linear_bf16"] = bench_timing.median_ms(_linear_step(xg, wp, dy, None), device)
    ms["linear_fp8"] = bench_timing.median_ms(_linear_step(xg, wp, dy, recipe), device)
    delayed = backend_fp8.Fp8Recipe(
        formats=formats,
        delayed=backend_fp8.DelayedScaling(example_history(), example_history(), example_history()),
    )
    ms["linear_fp8_delayed"] = bench_timing.median_ms(_linear_step(xg, wp, dy, delayed), device)
    out = backend_fp8.fp8_linear(x, w, False, recipe)
    rel = (out.float() - x.float() @ w.float().t()).norm() / (x.float() @ w.float().t()).norm()
    return {
        "shape": f"{m}x{n}x{k}",
        "ms": {key: round(v, 4) for key, v in ms.items()},
        "tflops": {
            "gemm_bf16": round(tflops(ms["gemm_bf16"]), 1),
            "gemm_fp8": round(tflops(ms["gemm_fp8"]), 1),
            "linear_bf16": round(tflops(ms["linear_bf16"], 3), 1),
            "linear_fp8": round(tflops(ms["linear_fp8"], 3), 1),
            "linear_fp8_delayed": round(tflops(ms["linear_fp8_delayed"], 3), 1),
        },
        "speedup": {
            "gemm": round(ms["gemm_bf16"] / ms["gemm_fp8"], 3),
            "linear": round(ms["linear_bf16"] / ms["linear_fp8"], 3),
            "linear_delayed": round(ms["linear_bf16"] / ms["linear_fp8_delayed"], 3),
        },
        "cast_transpose_tbs": {
            key.removeprefix("cast_transpose_"): round(4 * m * k / v / 1e9, 2)
            for key, v in ms.items()
            if key.startswith("cast_transpose_")
        },
        "fp8_forward_rel_error": round(rel.item(), 5),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="8b,0.85b", help="8b, 0.85b or MxNxK, comma-separated")
    p.add_argument("--format", choices=("hybrid", "e4m3"), default="hybrid")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run: checks the script works")
    opts = p.parse_args(argv)
    shapes = SMOKE if opts.smoke else parse_shapes(opts.shapes)
    device = fp8_device("bench_fp8_linear", opts.smoke)
    if device is None:
        return 3
    rows = [bench_shape(s, opts.format, device) for s in shapes]
    gpu = device_name(device)
    print(f"{gpu}, --fp8-format {opts.format}, TFLOP/s (linear: fwd + dgrad + wgrad)")
    print(f"{'MxNxK':>18} {'gemm bf16':>10} {'gemm fp8':>9} {'x':>6} "
          f"{'lin bf16':>9} {'lin fp8':>8} {'x':>6} {'delayed':>8} {'x':>6} "
          f"{'fwd err':>8}")  # fmt: skip
    for r in rows:
        t, s = r["tflops"], r["speedup"]
        print(f"{r['shape']:>18} {t['gemm_bf16']:>10} {t['gemm_fp8']:>9} {s['gemm']:>6} "
              f"{t['linear_bf16']:>9} {t['linear_fp8']:>8} {s['linear']:>6} "
              f"{t['linear_fp8_delayed']:>8} {s['linear_delayed']:>6} "
              f"{r['fp8_forward_rel_error']:>8}")  # fmt: skip
    for r in rows:
        if r["cast_transpose_tbs"]:
            casts = ", ".join(f"{k} {v} TB/s" for k, v in r["cast_transpose_tbs"].items())
            print(f"{r['shape']:>18} cast-transpose of x: {casts}")
    return report({"device": gpu, "format": opts.format, "rows": rows}, opts.json)


if __name__ == "__main__":
    sys.exit(main())
