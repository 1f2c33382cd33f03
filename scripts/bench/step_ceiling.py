"""The GEMM + attention ceiling of one training micro-batch, op by op on one GPU.

    python -m scripts.bench.step_ceiling [--model 8b|0.85b] [--measured-ms MS] [--json F]
    python -m scripts.bench.step_ceiling --smoke      # tiny CPU run, checks it works

Each GEMM of a Llama layer (the fused QKV projection, the output projection, fc1 with its gate,
fc2) is timed alone in bf16 (``torch.mm``) as its forward, input gradient and weight gradient,
the LM head likewise, and the attention's forward + backward through the TE spec's
``sdpa_sbhd`` (torch's kernel choice, ``scripts/bench/attention.py``). The ceiling is
``layers x (the layer's GEMMs + attention) + the head``: what one micro-batch would take with no
other kernel and no idle GPU. Against the micro-batch's model FLOPs (Megatron's formula,
``train_small.flops_per_iteration``) it bounds MFU from above; ``--measured-ms`` (a training
run's time per micro-batch: its iteration time over the micro-batches each GPU runs) says how
far a run is from it. Timed op by op, the GPU idles between samples and its clock can
recover; a training step holds it at its power limit. ``--sustained S`` also runs the
micro-batch's ops back to back (every layer's GEMMs and attention, then the head) for ``S``
seconds and times the repetitions after the first: the ceiling at the clock the GPU
sustains. All in bf16 (the example's default is FP8; this is its bf16 ceiling).
Models: ``8b`` is upstream's Llama-3 8B example (32 layers, hidden 4096, ffn 14336, 32 heads
over 8 kv heads, seq 8192, micro-batch 1, vocabulary 128256; 128384 where the mock data's
NullTokenizer adds its end-of-document token, <= 0.19: 0.1% more head FLOPs); ``0.85b`` is
``train_small``'s Llama at micro-batch 16.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from scripts.bench import attention as bench_attention
from scripts.bench import timing as bench_timing
from scripts.training import train_small

PEAK_TFLOPS = train_small.PEAK_TFLOPS


@dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    seq: int
    micro_batch: int
    vocab: int

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch

    def gemms(self) -> list[tuple[str, int, int, int]]:
        """(name, M, N, K) of each forward GEMM: ``[M, K] @ [K, N]``; the last is the head."""
        head_dim = self.hidden // self.heads
        qkv = (self.heads + 2 * self.kv_heads) * head_dim
        t, h = self.tokens, self.hidden
        return [
            ("qkv", t, qkv, h),
            ("proj", t, h, h),
            ("fc1", t, 2 * self.ffn, h),
            ("fc2", t, h, self.ffn),
            ("head", t, self.vocab, h),
        ]

    @property
    def attention(self) -> bench_attention.Shape:
        return bench_attention.Shape(
            self.micro_batch, self.seq, self.heads, self.kv_heads, self.hidden // self.heads
        )

    def flops(self) -> float:
        shape = train_small.Shape(
            self.layers, self.hidden, self.ffn, self.heads, self.kv_heads, self.seq,
            self.micro_batch, self.micro_batch, self.vocab, 0.0,
        )  # fmt: skip
        return train_small.flops_per_iteration(shape, "llama", self.micro_batch, self.vocab)


MODELS = {
    "8b": Model(32, 4096, 14336, 32, 8, 8192, 1, 128256),
    "0.85b": Model(24, 1536, 5504, 12, 4, 2048, 16, 32000),
    "smoke": Model(2, 64, 128, 4, 2, 32, 2, 256),
}


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def _mfu(flops: float, ms: float) -> float:
    return round(flops / (ms / 1e3) / 1e12 / PEAK_TFLOPS, 4)


def gemm_calls(
    x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, main_grad: torch.Tensor
) -> dict[str, Callable[[], object]]:
    """A linear's three GEMMs in training: the forward ``x W^T``, the input gradient ``dy W``
    and the weight gradient added into the fp32 ``main_grad`` as gradient-accumulation fusion
    does (``kernels.grad_accum``), with the weight ``[N, K]`` as Megatron keeps it."""
    from megatron_rocm.runtime.kernels import grad_accum

    return {
        "forward": lambda: x @ w.t(),
        "input_grad": lambda: dy @ w,
        "weight_grad": lambda: grad_accum.wgrad_gemm_accum_fp32(x, dy, main_grad),
    }


def _weights(n: int, k: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A weight ``[N, K]`` and its fp32 ``main_grad``."""
    return (
        torch.randn(n, k, device=device, dtype=dtype),
        torch.zeros(n, k, device=device, dtype=torch.float32),
    )


def time_gemm(m: int, n: int, k: int, device: str, dtype: torch.dtype) -> dict[str, float]:
    """Milliseconds of each of ``gemm_calls``' GEMMs at ``[M, K] x [K, N]``, timed alone."""
    x = torch.randn(m, k, device=device, dtype=dtype)
    dy = torch.randn(m, n, device=device, dtype=dtype)
    w, main_grad = _weights(n, k, device, dtype)
    calls = gemm_calls(x, w, dy, main_grad)
    return {name: bench_timing.median_ms(call, device) for name, call in calls.items()}


def micro_batch_ops(model: Model, device: str, dtype: torch.dtype) -> list:
    """The micro-batch's GEMM and attention calls in training order, as closures:
    ``layers`` x (each layer GEMM's ``gemm_calls``, the attention's forward + backward), then
    the head's. Each layer has its own weights and fp32 ``main_grad`` (one set for all would
    stay in L2 from layer to layer); the activations and their gradients are one set per
    shape, as their sizes dwarf the cache anyway."""
    activations: dict[tuple[int, int], torch.Tensor] = {}

    def activation(rows: int, cols: int) -> torch.Tensor:
        if (rows, cols) not in activations:
            activations[rows, cols] = torch.randn(rows, cols, device=device, dtype=dtype)
        return activations[rows, cols]

    def gemm(m: int, n: int, k: int) -> list:
        w, main_grad = _weights(n, k, device, dtype)
        return list(gemm_calls(activation(m, k), w, activation(m, n), main_grad).values())

    attention = bench_attention.forward_backward(
        bench_attention.variant_fn("te_spec"), *bench_attention.inputs(model.attention, device)
    )
    gemms = model.gemms()
    ops = []
    for _ in range(model.layers):
        ops += [op for _, m, n, k in gemms[:-1] for op in gemm(m, n, k)]
        ops.append(attention)
    return ops + gemm(*gemms[-1][1:])


def sustained_ms(model: Model, device: str, seconds: float) -> tuple[float, int]:
    """(ms per micro-batch, repetitions timed): the micro-batch's ops back to back, repeated
    for ``seconds`` (at least three repetitions), the first left out."""
    import time

    ops = micro_batch_ops(model, device, _dtype(device))

    def once() -> None:
        for op in ops:
            op()

    times = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < seconds:
        times.append(bench_timing.sampled_ms(once, 1, device))
    return sum(times[1:]) / len(times[1:]), len(times) - 1


def ceiling(model: Model, device: str, iters: int) -> dict:
    rows = []
    for name, m, n, k in model.gemms():
        ms = time_gemm(m, n, k, device, _dtype(device))
        total = sum(ms.values())
        rows.append({"op": name, "shape": [m, n, k], "ms": round(total, 4), **ms,
                     "tflops": round(3 * 2 * m * n * k / total / 1e9, 1)})  # fmt: skip
    attn_shape = model.attention
    attn = bench_attention.measure("te_spec", "model", device, iters, shape=attn_shape)
    if "error" in attn:
        raise RuntimeError(f"attention: {attn['error']}")
    rows.append({"op": "attention", "shape": attn_shape.__dict__, "ms": attn["ms"],
                 "tflops": attn["tflops"]})  # fmt: skip
    per_layer = sum(r["ms"] for r in rows if r["op"] != "head")
    head = next(r["ms"] for r in rows if r["op"] == "head")
    step_ms = model.layers * per_layer + head
    flops = model.flops()
    return {
        "rows": rows,
        "layer_ms": round(per_layer, 4),
        "ceiling_ms": round(step_ms, 3),
        "model_tflop": round(flops / 1e12, 3),
        "ceiling_mfu": _mfu(flops, step_ms),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("8b", "0.85b"), default="8b")
    parser.add_argument("--measured-ms", type=float, help="a run's time per micro-batch")
    parser.add_argument("--iters", type=int, default=20, help="attention timing samples")
    parser.add_argument(
        "--sustained", type=float, default=0.0, metavar="S",
        help="also run the micro-batch's ops back to back for S seconds (the clock the GPU holds)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run: checks it works")
    args = parser.parse_args(argv)
    if args.measured_ms is not None and args.measured_ms <= 0:
        parser.error("--measured-ms must be positive")
    if args.sustained < 0:
        parser.error("--sustained must be 0 or more seconds")
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("step_ceiling: needs a GPU (use --smoke on the CPU)", file=sys.stderr)
        return 3
    name = "smoke" if args.smoke else args.model
    result = {"model": name, **ceiling(MODELS[name], device, 2 if args.smoke else args.iters)}
    if args.measured_ms:
        result["measured_ms"] = args.measured_ms
        result["of_ceiling"] = round(result["ceiling_ms"] / args.measured_ms, 4)
    if args.sustained:
        ms, reps = sustained_ms(MODELS[name], device, args.sustained)
        result.update(sustained_ms=round(ms, 3), sustained_reps=reps,
                      sustained_mfu=_mfu(MODELS[name].flops(), ms))  # fmt: skip
    print("| op | M x N x K | fwd + dgrad + wgrad ms | TFLOP/s |\n|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['op']} | {r['shape']} | {r['ms']} | {r['tflops']} |")
    print(
        f"\n{name}: one layer {result['layer_ms']} ms, a micro-batch at least "
        f"{result['ceiling_ms']} ms ({result['model_tflop']} TFLOP: MFU at most "
        f"{result['ceiling_mfu']:.1%} of {PEAK_TFLOPS:g})"
        + (
            f"; the run takes {args.measured_ms} ms, the ceiling is {result['of_ceiling']:.1%} of it"
            if args.measured_ms
            else ""
        )  # fmt: skip
    )
    if args.sustained:
        print(
            f"{name}: back to back for {args.sustained:g} s ({result['sustained_reps']} micro-batches "
            f"timed), a micro-batch takes {result['sustained_ms']} ms (MFU at most "
            f"{result['sustained_mfu']:.1%}): {result['sustained_ms'] / result['ceiling_ms']:.2f}x "
            "the op-by-op ceiling"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
