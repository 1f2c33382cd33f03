"""scripts/training/power_summary.py on a hand-written nvidia-smi log."""

from __future__ import annotations

from pathlib import Path

from scripts.training import power_summary

HEADER = (
    "timestamp, clocks.current.sm [MHz], clocks.max.sm [MHz], clocks.current.memory [MHz], "
    "power.draw [W], power.limit [W], temperature.gpu, clocks_event_reasons.active"
)
ROWS = [
    "2026/11/29 08:12:25.102, 1980 MHz, 1980 MHz, 3201 MHz, 121.11 W, 700.00 W, 38, 0x0000000000000001",
    "2026/11/29 08:12:25.352, 1500 MHz, 1980 MHz, 3201 MHz, 650.00 W, 700.00 W, 60, 0x0000000000000004",
    "2026/11/29 08:12:25.602, 1600 MHz, 1980 MHz, 3201 MHz, 680.00 W, 700.00 W, 61, 0x000000000000000C",
    "2026/11/29 08:12:25.852, [N/A], 1980 MHz, 3201 MHz, [N/A], 700.00 W, 61, [N/A]",
    "2026/11/29 08:12:26.102, 1700 MHz, 1980 MHz, 3201 MHz, 690.00 W, 700.00 W, 62, 0x0000000000000000",
]  # fmt: skip


def _log(tmp_path: Path) -> Path:
    path = tmp_path / "smi.csv"
    path.write_text("\n".join([HEADER, *ROWS]) + "\n")
    return path


def test_only_samples_under_load_count_and_the_reasons_are_shares(tmp_path: Path, capsys) -> None:
    out_json = tmp_path / "p.json"
    assert power_summary.main([str(_log(tmp_path)), "--json", str(out_json)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(
        "3 samples under load: SM clock mean 1600 MHz (median 1600) of 1980 (81%)"
    )
    assert "power mean 673 W of 700 W" in line
    assert "software power cap 67%" in line and "hardware slowdown 33%" in line
    assert "GPU idle" not in line  # the idle sample is not under load


def test_a_log_without_load_or_without_a_file_exits_2(tmp_path: Path, capsys) -> None:
    assert power_summary.main([str(tmp_path / "missing.csv")]) == 2
    idle = tmp_path / "idle.csv"
    idle.write_text("\n".join([HEADER, ROWS[0]]) + "\n")
    assert power_summary.main([str(idle)]) == 2
    err = capsys.readouterr().err
    assert "no file" in err and "no sample at 50% of the power limit" in err


def test_gpu_sh_columns_and_unreported_reasons_still_count(tmp_path: Path, capsys) -> None:
    """gpu.sh's six columns; a GPU that reports no reasons ([Not Supported]) still has clocks."""
    log = tmp_path / "smi.csv"
    log.write_text(
        "timestamp, clocks.current.sm [MHz], clocks.max.sm [MHz], power.draw [W], "
        "power.limit [W], clocks_event_reasons.active\n"
        "2026/11/29 08:12:25.352, 1500 MHz, 1980 MHz, 600.00 W, 700.00 W, [Not Supported]\n"
    )
    assert power_summary.main([str(log)]) == 0
    line = capsys.readouterr().out
    assert (
        line.startswith("1 samples under load: SM clock mean 1500 MHz") and "reasons: none" in line
    )


def test_an_error_instead_of_samples_is_named_as_such(tmp_path: Path, capsys) -> None:
    log = tmp_path / "smi.csv"
    log.write_text('Field "clocks_event_reasons.active" is not a valid field to query.\n')
    assert power_summary.main([str(log)]) == 2
    assert "no readable sample" in capsys.readouterr().err
