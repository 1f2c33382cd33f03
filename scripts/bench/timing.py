"""The one timing harness of every benchmark in ``scripts/bench/``.

``median_ms`` (the kernel benchmarks): on a GPU the median of ``triton.testing.do_bench`` (or of
CUDA-graph replays, which leave out the host's launch overhead); the ``--smoke`` runs on the CPU
under the Triton interpreter take one wall-clock sample after a warm-up call, to check the
script works. ``sampled_ms`` (the attention, GEMM and patch-tool benchmarks): the median of
``iters`` calls, each between two CUDA events on a GPU or on the wall clock elsewhere.
``host_us`` (the host-time benchmark): microseconds a call on the wall clock, many calls
between two synchronizations. ``environment`` sets the runtime's selector variables
(``MEGATRON_ROCM_KERNELS``, ...) for one provider's timings and puts them back.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any


def median_ms(
    fn: Callable[[], object], device: str, *, cuda_graph: bool = False, rep: int = 50
) -> float:
    """Milliseconds one call of ``fn`` takes on ``device`` ("cuda" or "cpu")."""
    if device == "cpu":
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    if cuda_graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def copy_bandwidth(nbytes: int, device: str, **timing: object) -> float:
    """GB/s of a device-to-device copy of ``nbytes``, counting read + write: the yardstick the
    benchmarks report their bandwidth against."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / median_ms(lambda: dst.copy_(src), device, **timing) / 1e6


def sampled_ms(fn: Callable[[], object], iters: int, device: Any = "cpu", warmup: int = 0) -> float:
    """Median milliseconds of ``iters`` calls of ``fn`` after ``warmup`` untimed ones: CUDA
    events around each call when ``device`` is a CUDA/ROCm device ("cuda" or a
    ``torch.device``), the wall clock otherwise (torch is then not needed)."""
    gpu = getattr(device, "type", device) == "cuda"
    for _ in range(warmup):
        fn()
    samples = []
    if not gpu:
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)
    import torch

    torch.cuda.synchronize()
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def host_us(fn: Callable[[], object], calls: int, device: Any) -> float:
    """Microseconds one call of ``fn`` takes on the wall clock, ``calls`` in a row after 20
    warm-up calls, the device synchronized once before and once after: the host's cost where
    ``fn``'s kernels are shorter than their launches (``fp8_host.py``)."""
    if getattr(device, "type", device) == "cuda":
        import torch

        sync = torch.cuda.synchronize
    else:
        sync = lambda: None  # noqa: E731 - nothing queued to wait for
    for _ in range(20):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set these environment variables for the block, then restore each (unset if it was)."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        os.environ.update(values)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
