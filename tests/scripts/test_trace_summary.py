"""scripts/training/trace_summary.py on a small hand-made Chrome trace: busy/idle and the idle gap's cause."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from scripts.training import trace_summary


def _ev(
    cat: str, name: str, ts: float, dur: float, tid: int | None = None, corr: int | None = None
) -> dict:
    """One complete ("X") trace event; ``corr`` ties a kernel to its launch."""
    event: dict = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if tid is not None:
        event["tid"] = tid
    if corr is not None:
        event["args"] = {"correlation": corr}
    return event


def _write(path: Path, events: list[dict]) -> Path:
    with gzip.open(path, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    return path


def _trace(path: Path) -> Path:
    events = [
        _ev("kernel", "nvjet_sm90_gemm", 0, 100, corr=1),
        _ev("kernel", "triton_poi_fused_add_0", 50, 100, corr=2),
        _ev("kernel", "cudnn_sdpa_fprop", 400, 100, corr=3),
        _ev("cuda_runtime", "cudaLaunchKernel", 390, 5, tid=7, corr=3),
        _ev("python_function", "megatron/core/transformer/attention.py(100): forward", 300, 200, tid=7),
        _ev("python_function", "threading.py(1000): run", 0, 600, tid=7),
        _ev("cpu_op", "aten::_cudnn_attention_forward", 380, 30, tid=7),
    ]  # fmt: skip
    return _write(path, events)


def test_busy_idle_families_and_the_gap_behind_the_attention(tmp_path: Path, capsys) -> None:
    assert trace_summary.main([str(_trace(tmp_path / "t.json.gz"))]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "GPU span 0.5 ms, busy 0.2 ms, idle 0.2 ms (3 kernels)"
    assert "| gemm | 0.1 | 33.3% |" in out and "| attention | 0.1 | 33.3% |" in out
    gap = next(line for line in out.splitlines() if line.startswith("| 0.25 |"))
    # the op and our/Megatron's frame that launched the kernel after the gap; not threading.py
    assert "aten::_cudnn_attention_forward < attention.py(100): forward" in gap
    assert "threading" not in gap
    # the kernel table names where each kernel was launched from; "?" where no launch is traced
    rows = {line.split(" | ")[0]: line for line in out.splitlines() if line.startswith("| ")}
    assert rows["| cudnn_sdpa_fprop"].endswith(
        "| 0.10 | 1 | aten::_cudnn_attention_forward < attention.py(100): forward |"
    )
    assert rows["| nvjet_sm90_gemm"].endswith("| 0.10 | 1 | ? |")


def test_unreadable_trace_is_one_line_and_exit_1(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert trace_summary.main([str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trace_summary: cannot read")


@pytest.mark.parametrize(
    ("kernel", "expected"),
    [
        (
            "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128",
            "attention",
        ),
        ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*)", "attention"),
        ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "gemm"),
        ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64>", "gemm"),
        ("triton_poi_fused_mul_silu_split_0", "triton"),
        ("Memcpy PtoP (Device -> Device)", "exchange"),
        (
            "c10d::symmetric_memory::barrier_kernel(unsigned int**, int, int, int, unsigned long)",
            "exchange",
        ),  # fmt: skip
        ("Memcpy DtoD (Device -> Device)", "copy"),
    ],
)
def test_family_of_real_kernel_names(kernel: str, expected: str) -> None:
    """cuDNN's attention kernels carry "sm90" and "wgmma" too: they are attention, not GEMM."""
    assert trace_summary.family(kernel) == expected


def _rank_trace(path: Path, gemm_us: float) -> Path:
    """A step: a GEMM, an exchange that waits, then a reduce-scatter beside the next GEMM
    (milliseconds, as the trace's microseconds)."""
    ms = 1000
    events = [
        _ev("kernel", "nvjet_sm90_gemm", 0, gemm_us),
        _ev(
            "kernel", "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 100 * ms, 100 * ms
        ),
        _ev("kernel", "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(x)", 150 * ms, 150 * ms),
        _ev("kernel", "nvjet_sm90_gemm", 250 * ms, 50 * ms),
    ]
    with gzip.open(path, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    return path


def test_exposed_communication_is_what_no_compute_runs_beside() -> None:
    kernels = trace_summary.gpu_kernels(json.loads(json.dumps([
        _ev("kernel", "nvjet_sm90_gemm", 0, 100),
        _ev("kernel", "ncclDevKernel_SendRecv(x)", 100, 100),
        _ev("kernel", "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(x)", 150, 150),
        _ev("kernel", "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(x)", 160, 20),  # inside the other
        _ev("kernel", "nvjet_sm90_gemm", 250, 50),
    ])))  # fmt: skip
    got = trace_summary.exposure(kernels)
    assert got == {
        "compute": 150.0,
        "compute beside communication": 50.0,
        "exposed SendRecv": 100.0,  # 100-200: nothing beside it
        "exposed ReduceScatter": 100.0,  # 150-300 less the GEMM at 250-300
    }


def test_copy_engine_exchanges_count_as_communication() -> None:
    """a2a on copy engines: the peer copies and the barrier before them are communication, the
    packing copy before the barrier is compute."""
    kernels = trace_summary.gpu_kernels([
        _ev("kernel", "void at::native::elementwise_kernel<128, 2>(copy)", 0, 50),
        _ev("kernel", "c10d::symmetric_memory::barrier_kernel(unsigned int**)", 50, 30),
        {**_ev("kernel", "Memcpy PtoP (Device -> Device)", 80, 200), "cat": "gpu_memcpy"},
        _ev("kernel", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 280, 1000),
    ])  # fmt: skip
    assert trace_summary.exposure(kernels) == {
        "compute": 1050.0,
        "compute beside communication": 0.0,
        "exposed symmetric-memory barrier": 30.0,
        "exposed copy-engine copy": 200.0,
    }


def test_two_ranks_compared_name_the_kernel_that_took_longer(tmp_path: Path, capsys) -> None:
    fast = _rank_trace(tmp_path / "rank-0.json.gz", gemm_us=100_000)
    slow = _rank_trace(tmp_path / "rank-1.json.gz", gemm_us=130_000)
    assert trace_summary.main([str(fast), "--against", str(slow)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "| gemm | 150.0 | 180.0 | +30.0 |" in out
    kernels = out[
        out.index("| kernel | this rank ms (calls) | other rank ms (calls) | other - this |") + 2 :
    ]
    assert kernels[0] == "| nvjet_sm90_gemm | 150.00 (2) | 180.00 (2) | +30.00 |"
    # the slower rank's longer GEMM runs beside the exchange: less of it is exposed there
    assert "| exposed SendRecv | 100.0 | 70.0 | -30.0 |" in out
    assert "| exposed ReduceScatter | 100.0 | 100.0 | +0.0 |" in out


def test_a_second_trace_without_kernels_is_one_line_and_exit_1(tmp_path: Path, capsys) -> None:
    fast = _rank_trace(tmp_path / "rank-0.json.gz", gemm_us=100_000)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": []}))
    assert trace_summary.main([str(fast), "--against", str(empty)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["trace_summary: a trace has no GPU events to compare"]


def test_paired_calls_show_differences_that_alternate_between_the_ranks() -> None:
    """One rank's GEMM is slower on the first call, the other's on the second: the totals are
    equal, the per-call differences are not; the exchange is not paired, a kernel called a
    different number of times on the two ranks neither."""
    ms = 1000
    ours = trace_summary.gpu_kernels([
        _ev("kernel", "nvjet_sm90_gemm", 0, 100 * ms),
        _ev("kernel", "ncclDevKernel_SendRecv(x)", 100 * ms, 10 * ms),
        _ev("kernel", "nvjet_sm90_gemm", 200 * ms, 130 * ms),
        _ev("kernel", "triton_poi_fused_add_0", 400 * ms, 5 * ms),
    ])  # fmt: skip
    theirs = trace_summary.gpu_kernels([
        _ev("kernel", "nvjet_sm90_gemm", 0, 130 * ms),
        _ev("kernel", "ncclDevKernel_SendRecv(x)", 130 * ms, 40 * ms),
        _ev("kernel", "nvjet_sm90_gemm", 200 * ms, 100 * ms),
    ])  # fmt: skip
    lines = trace_summary.pace(ours, theirs, top=5)
    assert lines[0] == (
        "Paired calls: the other rank took 30.0 ms longer where it was slower, this rank 30.0 ms"
        " where it was (net +0.0 ms); 1 kernel name(s), 5.0 ms, called unequally often, not"
        " paired."
    )
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert rows == ["| nvjet_sm90_gemm | 2 | 30.00 | 30.00 | +30.00 |"]


def _host_trace(path: Path) -> Path:
    """Four idle gaps: 100-400 us while the host computes the gradient norm's inputs, ended by
    a kernel launched through the driver (as Inductor's Triton kernels are); 500-600 behind a
    kernel launched at 450, before the gap (it waited on the GPU); 650-800 behind a launch on a
    thread with no recorded frames; 850-1000 behind a launch call that began before the gap and
    lasted through it (a module load, say)."""
    events = [
        _ev("kernel", "nvjet_sm90_gemm", 0, 100, corr=1),
        _ev("kernel", "triton_poi_fused_add_0", 400, 100, corr=2),
        _ev("cuda_driver", "cuLaunchKernel", 390, 5, tid=7, corr=2),
        _ev("kernel", "multi_tensor_apply_kernel", 600, 50, corr=3),
        _ev("cuda_runtime", "cudaLaunchKernel", 450, 5, tid=7, corr=3),
        _ev("kernel", "elementwise_kernel", 800, 50, corr=4),
        _ev("cuda_runtime", "cudaLaunchKernel", 700, 5, tid=9, corr=4),
        _ev("kernel", "triton_red_fused_1", 1000, 50, corr=5),
        _ev("cuda_driver", "cuLaunchKernel", 840, 100, tid=7, corr=5),
        _ev("python_function", "megatron/training/training.py(900): train_step", 0, 1100, tid=7),
        _ev("python_function", "megatron/core/optimizer/clip_grads.py(55): get_grad_norm_fp32", 90, 290, tid=7),
        _ev("python_function", "megatron/core/utils.py(10): param_is_not_shared", 120, 20, tid=7),
        # running at the gap's midpoint but for 10 of its 290 us: not what the GPU waited on
        _ev("python_function", "megatron/core/utils.py(20): tiny_helper", 240, 10, tid=7),
    ]  # fmt: skip
    return _write(path, events)


def test_what_the_host_ran_while_the_gpu_waited(tmp_path: Path, capsys) -> None:
    assert trace_summary.main([str(_host_trace(tmp_path / "t.json.gz"))]) == 0
    lines = capsys.readouterr().out.splitlines()
    gap = next(line for line in lines if line.startswith("| 0.30 |"))
    # launched through the driver: still attributed; the host spent the gap in the norm's
    # setup: the innermost frame covering most of the gap, not a short one inside it
    assert gap.endswith("| clip_grads.py(55): get_grad_norm_fp32 < training.py(900): train_step |")
    assert "tiny_helper" not in gap and "| ? |" not in gap
    late = next(line for line in lines if line.startswith("| 0.10 |"))
    assert late.endswith("| (launched before the gap: it waited on the GPU) |")
    frameless = next(line for line in lines if line.startswith("| 0.15 | elementwise_kernel |"))
    assert frameless == "| 0.15 | elementwise_kernel | ? | ? |"
    straddling = next(line for line in lines if line.startswith("| 0.15 | triton_red_fused_1 |"))
    assert straddling.endswith("| cuLaunchKernel |")  # the host was inside the launch call
    # the whole iteration's idle time by host frame
    table = lines.index("| idle ms (gaps of 20 us or more) | gaps | host frame the GPU waited on |")
    assert lines[table + 2 : table + 6] == [
        "| 0.30 | 1 | clip_grads.py(55): get_grad_norm_fp32 |",
        "| 0.15 | 1 | ? |",
        "| 0.15 | 1 | cuLaunchKernel |",
        "| 0.10 | 1 | (launched before the gap: it waited on the GPU) |",
    ]


def test_a_kernel_launched_from_two_places_names_the_costlier_with_its_share(
    tmp_path: Path, capsys
) -> None:
    events = [
        _ev("kernel", "_forward", 0, 300, corr=1),
        _ev("kernel", "_forward", 400, 100, corr=2),
        _ev("cuda_driver", "cuLaunchKernel", -10, 5, tid=7, corr=1),
        _ev("cuda_driver", "cuLaunchKernel", 390, 5, tid=7, corr=2),
        _ev("python_function", "megatron_rocm/kernels/swiglu.py(58): forward", -20, 30, tid=7),
        _ev("python_function", "megatron_rocm/kernels/norm.py(203): forward", 380, 30, tid=7),
    ]  # fmt: skip
    assert trace_summary.main([str(_write(tmp_path / "t.json.gz", events))]) == 0
    row = next(
        line for line in capsys.readouterr().out.splitlines() if line.startswith("| _forward")
    )
    assert row == "| _forward | 0.40 | 2 | swiglu.py(58): forward (75%) |"
