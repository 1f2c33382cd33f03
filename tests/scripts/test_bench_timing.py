"""scripts/bench/timing.py, the kernel benchmarks' shared timer, on the CPU path."""

from __future__ import annotations

import os
import time

import pytest

torch = pytest.importorskip("torch")
from scripts.bench import timing as bench_timing  # noqa: E402


def test_cpu_timing_times_the_second_call_only() -> None:
    calls = []

    def slow_second_call() -> None:
        calls.append(1)
        if len(calls) == 2:
            time.sleep(0.02)

    ms = bench_timing.median_ms(slow_second_call, "cpu")
    assert len(calls) == 2 and 15 < ms < 2000


def test_copy_bandwidth_counts_read_and_write(monkeypatch: pytest.MonkeyPatch) -> None:
    def two_ms(fn, device, **timing):  # noqa: ANN001, ANN003, ANN202
        fn()
        return 2.0

    monkeypatch.setattr(bench_timing, "median_ms", two_ms)
    # 1e6 bytes read + 1e6 written in 2 ms: 1 GB/s
    assert bench_timing.copy_bandwidth(1_000_000, "cpu") == pytest.approx(1.0)


def test_environment_sets_the_variables_then_restores_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "auto")
    monkeypatch.delenv("MEGATRON_ROCM_TRITON_NORMS", raising=False)
    with pytest.raises(RuntimeError, match="inside"):
        with bench_timing.environment(
            MEGATRON_ROCM_KERNELS="reference", MEGATRON_ROCM_TRITON_NORMS="LayerNorm"
        ):
            assert os.environ["MEGATRON_ROCM_KERNELS"] == "reference"
            assert os.environ["MEGATRON_ROCM_TRITON_NORMS"] == "LayerNorm"
            raise RuntimeError("inside")
    assert os.environ["MEGATRON_ROCM_KERNELS"] == "auto"
    assert "MEGATRON_ROCM_TRITON_NORMS" not in os.environ


def test_sampled_ms_leaves_out_the_warmup_and_takes_the_median_on_the_wall_clock() -> None:
    delays = iter([0.3, 0.001, 0.03, 0.001])  # a slow warm-up call, then one slow sample of three

    def call() -> None:
        time.sleep(next(delays))

    ms = bench_timing.sampled_ms(call, 3, "cpu", warmup=1)
    assert 0.5 < ms < 25  # the median sample: neither the warm-up nor the slow one


def test_the_patch_tool_benchmark_times_without_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None; from scripts.bench import check, timing; "
        "print(timing.sampled_ms(lambda: None, 2))"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_host_time_averages_the_timed_calls_after_the_warm_up() -> None:
    calls = []

    def two_ms_after_the_warm_up() -> None:
        calls.append(1)
        if len(calls) > 20:
            time.sleep(0.002)

    us = bench_timing.host_us(two_ms_after_the_warm_up, 5, "cpu")
    assert len(calls) == 25 and 1900 < us < 200_000
