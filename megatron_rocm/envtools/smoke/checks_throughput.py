"""Throughput probe of the first-run report: a bf16 MLP block's forward and backward on one GPU.

Tokens/s, TFLOP/s and MFU against the GPU's dense bf16 peak (``first_run.PEAK_TFLOPS``). The
block is a transformer MLP (hidden 4096, 4x up, 8192 tokens): ``6 x params x tokens`` FLOPs per
step, GEMMs only, so MFU here is what the GEMM libraries reach (hipBLASLt / cuBLAS), an upper
bound of a training run's. Only in ``smoke --full``; skipped without a GPU.
"""

from __future__ import annotations

import time

from megatron_rocm.envtools.smoke import first_run
from megatron_rocm.envtools.smoke.runner import Context, register

HIDDEN, TOKENS, STEPS, WARMUP = 4096, 8192, 20, 5


def probe(device: str = "cuda", hidden: int = HIDDEN, tokens: int = TOKENS) -> dict[str, float]:
    """Seconds per step of ``y = gelu(x @ W1) @ W2`` forward + backward, and its figures."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    kw = dict(device=device, dtype=torch.bfloat16)
    w1 = (torch.randn(hidden, 4 * hidden, generator=g, **kw) * 0.02).requires_grad_()
    w2 = (torch.randn(4 * hidden, hidden, generator=g, **kw) * 0.02).requires_grad_()
    x = torch.randn(tokens, hidden, generator=g, **kw).requires_grad_()

    def step() -> None:
        y = torch.nn.functional.gelu(x @ w1) @ w2
        y.backward(torch.ones_like(y))

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / STEPS
    flops = 6.0 * (w1.numel() + w2.numel()) * tokens
    return {
        "seconds_per_step": seconds,
        "tokens_per_s": tokens / seconds,
        "tflops": flops / seconds / 1e12,
    }


@register("throughput.mlp")
def check_throughput(ctx: Context) -> str:
    """bf16 MLP block forward + backward on GPU 0: tokens/s, TFLOP/s, MFU."""
    ctx.needs_gpu(1, "the throughput probe")
    import torch

    name = torch.cuda.get_device_properties(0).name
    figures = probe()
    peak = first_run.peak_tflops(name)
    figures["peak_tflops"] = peak or 0.0
    figures["mfu"] = figures["tflops"] / peak if peak else 0.0
    ctx.cache.setdefault("figures", {})["throughput.mlp"] = figures
    mfu = f"MFU {100 * figures['mfu']:.1f}% of {peak:.0f}" if peak else f"no peak known for {name}"
    return (
        f"{figures['tokens_per_s']:.0f} tokens/s, {figures['tflops']:.1f} TFLOP/s per GPU, {mfu} "
        f"(hidden {HIDDEN}, {TOKENS} tokens, bf16)"
    )
