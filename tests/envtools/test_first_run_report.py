"""The first-run report (``smoke --full --report DIR``) on the CPU: the GPU checks are reported
as skipped with their reason, never as passed, and the files carry versions and figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from megatron_rocm.commands.smoke import smoke  # noqa: E402
from megatron_rocm.envtools.smoke import catalog, first_run, runner  # noqa: E402
from megatron_rocm.errors import UsageError  # noqa: E402
from megatron_rocm.main import main  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the report")


def test_cpu_report_says_skipped_not_passed(tmp_path: Path) -> None:
    out = tmp_path / "report"
    code = smoke(
        str(tmp_path),
        only=["kernels.swiglu", "collectives.nccl", "throughput"],
        report_dir=str(out),
    )
    assert code == 0
    data = json.loads((out / "report.json").read_text())
    status = {c["name"]: c["status"] for c in data["checks"]}
    assert status == {
        "kernels.swiglu": "pass",
        "collectives.nccl": "skip",
        "throughput.mlp": "skip",
    }
    assert data["environment"]["torch"] == str(torch.__version__)
    assert data["environment"]["gpus"] == [] and data["figures"] == {}
    md = (out / "report.md").read_text()
    assert "| throughput.mlp | SKIP |" in md and "needs 1 GPU; no GPU visible" in md
    assert "1 passed, 0 failed, 2 skipped" in md


def test_throughput_runs_only_when_asked(tmp_path: Path) -> None:
    checks = catalog.load_checks()
    assert "throughput.mlp" in checks
    with pytest.raises(UsageError, match="--full or --only"):
        smoke(str(tmp_path), only=["kernels"], full=True)


def test_cli_takes_full_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    assert main(["smoke", str(tmp_path), "--full", "--report", str(tmp_path / "file")]) == 2
    assert "not a folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("AMD Instinct MI300X", 1307.0),
        ("AMD Instinct MI325X", 1307.0),
        ("AMD Instinct MI355X", 2500.0),
        ("AMD Instinct MI250X/MI250", 383.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_table(name: str, peak: float | None) -> None:
    assert first_run.peak_tflops(name) == peak


def test_markdown_lists_failures_and_figures() -> None:
    report = runner.Report(device="AMD Instinct MI300X (gfx942) x1, ROCm 7.2", torch="2.13.0")
    report.checks = [
        runner.CheckResult("kernels.rope", "pass", 1.0, "max error 0"),
        runner.CheckResult("training.llama.te", "fail", 2.0, "loss went up | nan"),
        runner.CheckResult("throughput.mlp", "pass", 3.0, "9000 tokens/s, 600.0 TFLOP/s"),
    ]
    env = {"torch": "2.13.0", "hip": "7.2", "triton": "3.6.0", "python": "3.12", "gpus": []}
    md = first_run.to_markdown(report, env)
    assert "1 failed" in md and "loss went up \\| nan" in md and "600.0 TFLOP/s" in md
    assert "ROCm 7.2" in md
