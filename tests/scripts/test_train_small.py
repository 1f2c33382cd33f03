"""scripts/training/train_small.py's log reading: iteration records, the run verdict, and the error a
failed run reports; and the pretrain_gpt.py flags its parallel options become. The log lines
are written here in Megatron's format, not copied from it."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
from megatron_log import iteration_line


@pytest.fixture(scope="module")
def ts():
    return importlib.import_module("scripts.training.train_small")


def iteration(i: int, loss: str, ms: float, nan: int = 0) -> str:
    return iteration_line(i, 12, loss, ms=ms, tflops=182.5, nan=nan)


def summarize(ts, lines: list[str]) -> tuple[dict, list[str]]:
    records, _ = ts.parse_log(lines)
    return ts.summarize(
        records, flops_per_iter=1e12, tokens_per_iter=1000, ngpus=1, peak_tflops=989.0
    )


def test_a_good_run_is_ok_and_times_skip_warmup(ts) -> None:
    lines = [iteration(i, f"{10 - i}.0E+00", 5000.0 if i <= 3 else 100.0) for i in range(1, 9)]
    summary, problems = summarize(ts, lines)
    assert problems == []
    assert summary["iterations"] == 8 and summary["mean_iter_ms"] == 100.0
    assert summary["tflops_per_gpu"] == 10.0 and summary["megatron_tflops_per_gpu"] == 182.5


def test_median_beside_the_mean_one_slow_iteration(ts) -> None:
    """A single GC-length stall moves the mean, not the median; both are reported."""
    times = [5000.0, 5000.0, 5000.0, 100.0, 100.0, 100.0, 100.0, 140.0]
    lines = [iteration(i, f"{10 - i}.0E+00", ms) for i, ms in enumerate(times, start=1)]
    summary, _ = summarize(ts, lines)
    assert summary["mean_iter_ms"] == 108.0 and summary["median_iter_ms"] == 100.0
    assert summary["tokens_per_s_at_median"] == 10000.0  # 1000 tokens in 100 ms
    assert summary["mfu_at_median"] == round(10.0 / 989.0, 4)
    assert summary["mfu"] == round(1e12 / 0.108 / 1e12 / 989.0, 4)


def test_flat_or_nan_loss_is_a_failure(ts) -> None:
    _, flat = summarize(ts, [iteration(i, "5.0E+00", 100.0) for i in range(1, 9)])
    assert any("did not decrease" in p for p in flat)
    _, nan = summarize(ts, [iteration(i, "nan", 100.0, nan=1) for i in range(1, 9)])
    assert nan == ["loss is not finite"]


@pytest.mark.parametrize("shown", [format(float("nan"), ".6E"), format(float("-inf"), ".6E")])
def test_non_finite_losses_as_megatron_prints_them_are_read(ts, shown: str) -> None:
    assert shown in ("NAN", "-INF")  # {:.6E}, Megatron's format for the loss
    records, _ = ts.parse_log([iteration(1, shown, 100.0)])
    assert records[0].loss is not None and not math.isfinite(records[0].loss)


def test_last_exception_reads_megatron_list_tracebacks(ts) -> None:
    lines = [
        "WARNING: nothing wrong here",
        "['Traceback (most recent call last):\\n', '  File \"x.py\", line 1\\n', "
        "'torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB.\\n']",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "  exitcode  : 1 (pid: 8806)",
    ]
    assert ts.last_exception(lines) == (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB."
    )
    assert ts.last_exception(["ModuleNotFoundError: No module named 'pydantic'"]) == (
        "ModuleNotFoundError: No module named 'pydantic'"
    )
    assert ts.last_exception(["all good", "iteration 1/ 2 |"]) is None


def dry_run(ts, capsys, tmp_path: Path, *args: str) -> list[str]:
    """The pretrain_gpt.py arguments train_small.py would launch."""
    assert ts.main([str(tmp_path), "--dry-run", *args]) == 0
    shown = capsys.readouterr().out.strip().split(" && ", 1)[1].split()
    return shown[shown.index("pretrain_gpt.py") + 1 :]


def test_pipeline_and_virtual_stages_become_upstream_flags(ts, capsys, tmp_path: Path) -> None:
    args = dry_run(
        ts, capsys, tmp_path, "--nproc", "4", "--tp", "2", "--sp", "--pp", "2", "--vpp", "2"
    )
    assert "--pipeline-model-parallel-size=2" in args
    # 12 layers over 2 pipeline ranks x 2 virtual stages: 3 layers a stage, the flag that
    # every tag from core_v0.12.0 to main accepts
    assert "--num-layers-per-virtual-pipeline-stage=3" in args
    assert "--tensor-model-parallel-size=2" in args and "--sequence-parallel" in args
    # data-parallel size 4 // (2 x 2) = 1: the preset's global batch 8, not 16
    assert "--global-batch-size=8" in args


def test_without_pp_nothing_changes(ts, capsys, tmp_path: Path) -> None:
    args = dry_run(ts, capsys, tmp_path, "--nproc", "4", "--tp", "2")
    assert not [a for a in args if "pipeline" in a]
    assert "--global-batch-size=16" in args  # DP 2 x 8


def test_data_path_replaces_mock_data(ts, capsys, tmp_path: Path) -> None:
    (tmp_path / "corpus.idx").write_bytes(b"")
    (tmp_path / "corpus.bin").write_bytes(b"")
    args = dry_run(ts, capsys, tmp_path, "--data-path", str(tmp_path / "corpus"))
    assert f"--data-path={tmp_path / 'corpus'}" in args and "--mock-data" not in args
    assert "--mock-data" in dry_run(ts, capsys, tmp_path)


def test_a_data_path_without_its_index_is_refused(ts, capsys, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        ts.main([str(tmp_path), "--dry-run", "--data-path", str(tmp_path / "missing")])
    assert e.value.code == 2 and f"no {tmp_path / 'missing'}.idx" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "4", "--tp", "2", "--pp", "4"], "not a multiple of --tp 2 x --cp 1 x --pp 4"),
        (["--nproc", "2", "--vpp", "2"], "--vpp needs --pp 2 or more"),
        (["--nproc", "2", "--pp", "2", "--vpp", "4"], "does not divide the 12 layers"),
        (["--pp", "0"], "--pp must be 1 or more"),
    ],
)
def test_bad_parallel_sizes_are_refused(ts, capsys, args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as stop:
        ts.parse_cli(["tree", *args])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
