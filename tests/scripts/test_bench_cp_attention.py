"""scripts/bench/cp_attention.py on two gloo ranks (``--cpu``): the script, not the numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.full]
REPO = Path(__file__).resolve().parents[2]
MODULE = "scripts.bench.cp_attention"


def _bench(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "cp.jsonl"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", MODULE, "--cpu", "--iters", "1", "--json", str(out), *args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_every_case_reports_its_costliest_ops(tmp_path: Path) -> None:
    records = _bench(tmp_path, "--lengths", "128", "--comm", "p2p,all_gather,a2a", "--ops", "5")
    cases = [r["case"] for r in records]
    assert cases == [
        "sdpa_1gpu", "cp2_p2p_cpu_flash", "cp2_all_gather_cpu_flash", "cp2_a2a_cpu_flash"
    ]  # fmt: skip
    for record in records:
        ops = record["top_ops"]
        assert 1 <= len(ops) <= 5, record
        assert all(ms > 0 and calls > 0 for _, ms, calls in ops), ops
        assert [ms for _, ms, _ in ops] == sorted((ms for _, ms, _ in ops), reverse=True)
        # the attention kernel itself is among the costliest ops of every case
        assert any("scaled_dot_product" in name for name, _, _ in ops), ops
    for record in records[1:]:
        assert record["max_abs_err"] < 1e-5  # fp32 on the CPU: the CP result is the 1-rank one


def test_each_case_says_how_its_blocks_took_the_grouped_kv_heads(tmp_path: Path) -> None:
    """``KERNEL:expanded`` makes the blocks expand them; no CPU kernel takes them grouped."""
    records = _bench(
        tmp_path, "--lengths", "64", "--comm", "p2p,a2a", "--kernels", "math,math:expanded"
    )
    got = [(r["case"], r["kernel"], r["kv_heads"]) for r in records[1:]]
    assert got == [
        ("cp2_p2p_math", "math", "expanded"),
        ("cp2_p2p_math_expanded", "math", "expanded"),
        ("cp2_a2a_math", "math", "expanded"),
        ("cp2_a2a_math_expanded", "math", "expanded"),
    ]
    assert all(r["max_abs_err"] < 1e-5 for r in records[1:])


def test_grouped_heads_forces_expansion_for_one_case_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from megatron_rocm.runtime.backend.cp import block_attention as blocks

    monkeypatch.setattr(blocks, "is_hip", lambda: False)  # a ROCm build of torch says True

    bench = importlib.import_module(MODULE)
    from megatron_rocm.runtime.backend.cp.block_attention import KERNELS

    flash = KERNELS["flash"]  # takes grouped heads natively off ROCm
    q, k = torch.empty(1, 4, 2, 8), torch.empty(1, 2, 2, 8)
    with bench.grouped_heads(flash, q, k, expanded=False) as kv_heads:
        assert kv_heads == "native"
    with bench.grouped_heads(flash, q, k, expanded=True) as kv_heads:
        assert kv_heads == "expanded" and flash._heads(q, k, k)[0].shape[1] == 4
    assert flash.native_gqa(q, k) and "native_gqa" not in vars(flash)


def test_heads_set_the_shape_and_the_flop_count(tmp_path: Path) -> None:
    """``--heads 8/2``: every case runs with that shape and says so; TFLOP/s count 8 heads."""
    records = _bench(tmp_path, "--lengths", "64", "--comm", "p2p", "--heads", "8/2")
    assert {r["heads"] for r in records} == {"8/2"}
    flops = 3.5 * 4 * 1 * 8 * 64 * 64 * 128 / 2  # forward 4bhL^2d/2 (causal), backward 2.5x
    assert {r["gflop"] for r in records} == {round(flops / 1e9, 3)}
    assert all(r["max_abs_err"] < 1e-5 for r in records[1:])


def test_a2a_cases_per_head_group_count(tmp_path: Path) -> None:
    """``--a2a-stages``: one a2a case per count asked for, each saying how many groups ran
    (8/4 heads over two ranks: two kv heads each, so at most two; unset, two through the
    process group, which gloo takes)."""
    records = _bench(
        tmp_path, "--lengths", "64", "--comm", "a2a", "--heads", "8/4", "--a2a-stages",
        "1,4,default",
    )  # fmt: skip
    got = [(r["case"], r["stages"]) for r in records[1:]]
    assert got == [("cp2_a2a_cpu_flash_s1", 1), ("cp2_a2a_cpu_flash_s4", 2),
                   ("cp2_a2a_cpu_flash", 2)]  # fmt: skip
    assert all(r["max_abs_err"] < 1e-5 for r in records[1:])


def test_a2a_cases_per_transport_say_which_ran(tmp_path: Path) -> None:
    """``--a2a-transports``: one a2a case per transport asked for; on gloo (the CPU) ``auto``
    exchanges through the process group, and the case says so."""
    records = _bench(
        tmp_path, "--lengths", "64", "--comm", "a2a", "--heads", "8/4", "--a2a-transports",
        "auto,process-group",
    )  # fmt: skip
    got = [(r["case"], r["transport"]) for r in records[1:]]
    assert got == [("cp2_a2a_cpu_flash", "process-group"),
                   ("cp2_a2a_cpu_flash_process-group", "process-group")]  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [
        ["--heads", "6/4"],
        ["--heads", "64"],
        ["--heads", "0/8"],
        ["--a2a-stages", "0"],
        ["--a2a-transports", "nccl"],
    ],
)
def test_bad_shapes_and_stage_counts_are_refused_before_any_set_up(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", MODULE, "--cpu", *args], capture_output=True,
                          text=True, cwd=REPO)  # fmt: skip
    assert done.returncode == 2 and args[0] in done.stderr and "Traceback" not in done.stderr
