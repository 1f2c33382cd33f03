"""docs/performance.md's tables are the rendering of benchmarks/results/ (no hand-edited figure)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _renderer():
    spec = importlib.util.spec_from_file_location(
        "render_results", REPO / "scripts" / "render_results.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_performance_md_is_the_rendering_of_the_result_files() -> None:
    render = _renderer()
    text = render.DOC.read_text(encoding="utf-8")
    records = render.load()
    assert len(records) >= 20  # every area has figures; an empty folder would render nothing
    assert render.render(text, records) == text, "run: python3 scripts/render_results.py"


def test_every_record_shows_up_with_its_gpu_command_and_date() -> None:
    render = _renderer()
    text = render.DOC.read_text(encoding="utf-8")
    for record in render.load():
        row = next(line for line in text.splitlines() if line.startswith(f"| {record['name']} |"))
        assert record["gpu"] in row and record["date"] in row and "`" in row


def test_a_record_without_its_date_is_refused(tmp_path: Path) -> None:
    render = _renderer()
    record = {f: "x" for f in render.FIELDS} | {"area": "kernels", "date": ""}
    (tmp_path / "a.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match="missing date"):
        render.load(tmp_path)


def test_check_mode_fails_on_a_stale_doc(tmp_path: Path, monkeypatch) -> None:
    render = _renderer()
    stale = tmp_path / "performance.md"
    stale.write_text(f"x\n{render.BEGIN}\n| old | 1 |\n{render.END}\n")
    monkeypatch.setattr(render, "DOC", stale)
    monkeypatch.setattr(render, "REPO", tmp_path)
    assert render.main(["--check"]) == 1
    assert render.main([]) == 0 and render.main(["--check"]) == 0


def test_notes_render_numbered_under_their_table() -> None:
    render = _renderer()
    base = {f: "x" for f in render.FIELDS} | {"date": "2026-01-01"}
    records = [
        base | {"area": "kernels", "name": "a", "notes": "first detail"},
        base | {"area": "kernels", "name": "b"},
        base | {"area": "kernels", "name": "c", "notes": "second detail"},
        base | {"area": "training", "name": "d", "notes": "its own first"},
    ]
    text = render.tables(records)
    lines = text.splitlines()
    assert next(line for line in lines if line.startswith("| a |")).count("(note 1)") == 1
    assert "(note" not in next(line for line in lines if line.startswith("| b |"))
    assert "(note 2)" in next(line for line in lines if line.startswith("| c |"))
    assert "(note 1)" in next(line for line in lines if line.startswith("| d |"))
    kernels = text[text.index("### Kernels") :]
    assert "1. first detail" in kernels and "2. second detail" in kernels
    training = text[text.index("### Training") : text.index("### Kernels")]
    assert "1. its own first" in training and "detail" not in training


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"note": "misspelt"}, "unknown field note"),
        ({"notes": "two\nlines"}, "notes must be one line of text"),
        ({"notes": ["a list"]}, "notes must be one line of text"),
    ],
)
def test_a_malformed_record_is_refused(tmp_path: Path, extra: dict, message: str) -> None:
    render = _renderer()
    record = {f: "x" for f in render.FIELDS} | {"area": "kernels", "date": "2026-01-01"} | extra
    (tmp_path / "a.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=message):
        render.load(tmp_path)
