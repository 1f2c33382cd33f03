"""The TE spec's causal attention at model shapes, one GPU: which SDPA kernel is fastest.

    python -m scripts.bench.attention [--shapes 0.85b,8b] [--variants ...] [--json F]
    python -m scripts.bench.attention --smoke      # tiny CPU run (math kernel), checks it works

Inputs are laid out as the TE spec hands them over: ``q`` ``[s, b, heads, d]``, ``k``/``v``
``[s, b, kv heads, d]`` (grouped: GQA), bf16. Variants, each forward + backward:

- ``te_spec``: ``te_sdpa.sdpa_sbhd`` with nothing forced, what training runs by default;
- ``flash``, ``efficient``, ``cudnn``: ``sdpa_sbhd`` with that kernel forced (as
  ``MEGATRON_ROCM_SDPA_BACKENDS`` forces it; grouped heads as ``sdpa_sbhd`` passes them);
- ``cudnn_op``: cuDNN's attention op called directly with grouped kv heads as they are
  (the context-parallel cuDNN block kernel, ``backend.cp.block_attention.CudnnKernel``).

TFLOP/s counts causal attention as half the square: ``2 * b * heads * s^2 * d`` forward,
2.5 times that backward. ``max diff`` is against ``te_spec``'s output (on the CPU, against
the math kernel's). A variant that cannot run at a shape reports its error instead.
Shapes: ``0.85b`` (``train_small``'s Llama: micro-batch 16, s 2048, 12 heads over 4 kv heads,
d 128) and ``8b`` (upstream's Llama-3 8B example: micro-batch 1, s 8192, 32 over 8, d 128).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rocm.runtime.backend import te_sdpa
from scripts.bench import timing as bench_timing


@dataclass(frozen=True)
class Shape:
    batch: int
    seq: int
    heads: int
    kv_heads: int
    dim: int

    @property
    def flops(self) -> float:
        """Forward + backward of causal attention (half the square, backward 2.5x)."""
        return 3.5 * 2 * self.batch * self.heads * self.seq**2 * self.dim


SHAPES = {
    "0.85b": Shape(16, 2048, 12, 4, 128),
    "8b": Shape(1, 8192, 32, 8, 128),
    "smoke": Shape(1, 64, 4, 2, 16),
}
VARIANTS = ("te_spec", "flash", "efficient", "cudnn", "cudnn_op")


def _sdpa_sbhd(kernels: str | None) -> Callable[..., torch.Tensor]:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return te_sdpa.sdpa_sbhd(q, k, v, mask_type="causal", kernels=kernels)

    return run


def _cudnn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from megatron_rocm.runtime.backend.cp.block_attention import CudnnKernel

    kernel = CudnnKernel()
    bq, bk, bv = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    reason = kernel.unsupported(bq, bk, bv, 0.0)
    if reason:
        raise RuntimeError(f"cuDNN {reason}")
    out = _BlockAttention.apply(kernel, bq, bk, bv, 1.0 / math.sqrt(q.shape[-1]))
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)  # as sdpa_sbhd's


class _BlockAttention(torch.autograd.Function):
    """One block kernel as a whole causal attention: its forward, and its backward."""

    @staticmethod
    def forward(ctx, kernel, q, k, v, scale):  # noqa: ANN001, ANN205
        out, lse, state = kernel.forward(q, k, v, causal=True, scale=scale, dropout_p=0.0)
        ctx.kernel, ctx.scale, ctx.state = kernel, scale, state
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        grads = ctx.kernel.backward(
            dout, q, k, v, out, lse, ctx.state, causal=True, scale=ctx.scale, dropout_p=0.0
        )
        return None, *grads, None


def variant_fn(name: str) -> Callable[..., torch.Tensor]:
    if name == "te_spec":
        return _sdpa_sbhd(None)
    if name == "cudnn_op":
        return _cudnn_op
    return _sdpa_sbhd(name)


def inputs(shape: Shape, device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def make(heads: int) -> torch.Tensor:
        size = (shape.seq, shape.batch, heads, shape.dim)
        return torch.randn(size, generator=gen, device=device).to(dtype)

    return make(shape.heads), make(shape.kv_heads), make(shape.kv_heads)


def forward_backward(
    fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> Callable[[], object]:
    """One training step of attention ``fn`` on ``q``, ``k``, ``v``: the forward and its
    backward against a fixed random output gradient, the input gradients returned, not
    accumulated into ``.grad`` (as in training)."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    grad = torch.randn_like(fn(*leaves))
    return lambda: torch.autograd.grad(fn(*leaves), leaves, grad)


def measure(
    name: str, shape_name: str, device: str, iters: int, shape: Shape | None = None
) -> dict:
    """One variant's forward + backward at ``SHAPES[shape_name]`` (or ``shape``, so named)."""
    shape = shape or SHAPES[shape_name]
    q, k, v = inputs(shape, device)
    fn = variant_fn(name)
    row: dict = {"variant": name, "shape": shape_name, **shape.__dict__}
    try:
        step = forward_backward(fn, q, k, v)
        ms = bench_timing.sampled_ms(step, iters, device, warmup=3)
        with torch.no_grad():
            reference = _sdpa_sbhd("math" if device == "cpu" else None)(q, k, v)
            diff = (fn(q, k, v).float() - reference.float()).abs().max().item()
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot run is a result
        row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        return row
    row.update(ms=round(ms, 4), tflops=round(shape.flops / ms / 1e9, 1), max_diff=diff)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="0.85b,8b", help="comma list of " + ", ".join(SHAPES))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", type=Path, help="write the rows here (JSON lines)")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run: checks it works")
    args = parser.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    shapes = ["smoke"] if args.smoke else args.shapes.split(",")
    variants = ["te_spec", "math", "cudnn_op"] if args.smoke else args.variants.split(",")
    unknown = [s for s in shapes if s not in SHAPES] + [
        v for v in variants if v not in (*VARIANTS, "math")
    ]
    if unknown:
        print(f"attention: unknown shape or variant {unknown[0]!r}", file=sys.stderr)
        return 2
    if device == "cuda" and not torch.cuda.is_available():
        print("attention: needs a GPU (use --smoke on the CPU)", file=sys.stderr)
        return 3
    rows = [
        measure(v, s, device, 2 if args.smoke else args.iters) for s in shapes for v in variants
    ]
    print(
        "| shape | variant | ms (fwd+bwd) | TFLOP/s | max diff vs te_spec |\n|---|---|---|---|---|"
    )
    for r in rows:
        figures = r.get("error") or f"{r['ms']} | {r['tflops']} | {r['max_diff']:.2e}"
        print(f"| {r['shape']} | {r['variant']} | {figures} |")
    if args.json:
        args.json.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
