"""The matrix over refs it cannot check, and --out values it cannot write into.

One odd ref (a branch that is not a Megatron-LM tree, a patched fork's own commit) must be one
row that says why, not the end of a run over hundreds of refs; and several formats with
``--out`` naming an existing file is a usage error found before the work.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from toyrepo import apply_argv, run

from megatron_rocm.errors import EXIT_ENVIRONMENT, EXIT_FAILED, EXIT_OK, EXIT_USAGE
from megatron_rocm.main import main
from megatron_rocm.patchtool.matrix import broken_cells, build_matrix, select_refs, status_of
from megatron_rocm.patchtool.report import render
from megatron_rocm.patchtool.series import load_series


def add_non_megatron_refs(upstream: Path) -> str:
    """A tag and a branch on a commit whose tree has no megatron/core/package_info.py (its
    root is core_v0.1.0's fusions folder), like ``megatron-main-before-moe`` upstream."""
    tree = run("rev-parse", "core_v0.1.0:megatron/core/fusions", cwd=upstream)
    commit = run("commit-tree", tree, "-m", "not a Megatron tree", cwd=upstream)
    run("tag", "not-megatron", commit, cwd=upstream)
    run("branch", "docs-only", commit, cwd=upstream)
    return commit


def matrix_argv(source: Path, series: Path, *extra: str) -> list[str]:
    return ["matrix", "--source", str(source), "--series", str(series), "--no-scan", *extra]


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


def test_non_megatron_ref_is_an_error_row_and_the_run_goes_on(toy):
    _, upstream, series_dir = toy
    commit = add_non_megatron_refs(upstream)
    specs = select_refs(upstream, ["not-megatron", "core_v0.[12].0"])
    m = build_matrix(upstream, specs, load_series(series_dir), source="t")
    assert [r.name for r in m.rows] == ["core_v0.1.0", "core_v0.2.0", "not-megatron"]
    bad = m.rows[-1]
    assert f"package_info.py is missing at {commit[:12]}" in bad.error
    assert bad.report.patches == [] and m.error_rows == [bad] and m.broken_rows == []
    assert not m.ok  # a ref that was not checked is no pass
    assert "3 refs x 2 patches: 2 apply, 1 error (not-megatron)" in m.summary()
    assert [s.ref for s in m.surface.refs] == ["core_v0.1.0", "core_v0.2.0"]
    data = json.loads(render(m, "json"))
    row = data["refs"][-1]
    assert (row["ref"], row["ok"], row["patches"]) == ("not-megatron", False, [])
    assert "not a Megatron-LM tree" in row["error"]
    assert data["refs"][0]["error"] == "" and broken_cells(data) == set()


def test_error_rows_in_every_format(toy):
    _, upstream, series_dir = toy
    add_non_megatron_refs(upstream)
    specs = select_refs(upstream, ["docs-only", "core_v0.3.0"])
    m = build_matrix(upstream, specs, load_series(series_dir), source="t", scan=False)
    md = render(m, "md")
    assert "1 of 2 refs break, 1 of 2 refs could not be checked" in md
    assert "| **docs-only** | — | ❌ error: not a Megatron-LM tree" in md
    html = render(m, "html")
    assert '<td class="cell fail" colspan="2"><b>error</b>: not a Megatron-LM tree' in html
    root = ET.fromstring(render(m, "junit").encode())
    assert root.get("errors") == "1"
    suite = next(s for s in root.iter("testsuite") if s.get("name") == "docs-only")
    assert suite.get("errors") == "1" and suite.find("testcase/error") is not None


def test_cli_star_reports_every_ref_and_exits_by_the_breaks(toy, capsys):
    _, upstream, series = toy
    add_non_megatron_refs(upstream)
    assert main(matrix_argv(upstream, series, "--tags", "*")) == EXIT_FAILED  # 0.3.0 breaks
    out = capsys.readouterr()
    assert "9 refs x 2 patches: 3 apply, 4 break" in out.out
    assert "2 error (not-megatron, docs-only)" in out.out
    assert "core_v0.6.0" in out.out and "Traceback" not in out.err


def test_cli_only_unchecked_refs_exit_3_with_one_line(toy, capsys, tmp_path):
    _, upstream, series = toy
    add_non_megatron_refs(upstream)
    out = tmp_path / "r.json"
    argv = matrix_argv(upstream, series, "--tags", "docs-only", "core_v0.[12].0")
    assert main([*argv, "--format", "json", "--out", str(out)]) == EXIT_ENVIRONMENT
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "1 ref(s) not checked: docs-only: not a Megatron-LM tree" in err
    assert [r["ref"] for r in json.loads(out.read_text())["refs"]] == [
        "core_v0.1.0",
        "core_v0.2.0",
        "docs-only",
    ]
    assert "2 apply, 1 error (docs-only)" in captured.out
    assert main(matrix_argv(upstream, series, "--tags", "core_v0.[12].0")) == EXIT_OK


def test_patched_fork_commit_is_an_error_row_not_droppable(toy, capsys):
    root, upstream, series = toy
    fork = root / "fork"
    assert main(apply_argv(upstream, series, fork)) == 0
    capsys.readouterr()
    # with the scan on: a fork's tree must not feed the CUDA-surface report either
    argv = ["matrix", "--source", str(fork), "--series", str(series)]
    assert main([*argv, "--tags", "rocm/*", "core_v0.2.0"]) == EXIT_ENVIRONMENT
    out = capsys.readouterr()
    assert "droppable:" not in out.out and "already-applied v0.1" not in out.out
    assert "2 refs x 2 patches: 1 apply, 1 error (rocm/core_v0.2.0)" in out.out
    assert "rocm/core_v0.2.0: a patched fork's commit, not upstream" in out.err
    m = build_matrix(
        fork, select_refs(fork, ["rocm/*", "core_v0.2.0"]), load_series(series), source="t"
    )
    assert [r.name for r in m.rows] == ["core_v0.2.0", "rocm/core_v0.2.0"]
    assert {status_of(p) for p in m.rows[0].report.patches} == {"offset"}
    assert m.rows[1].error.startswith("a patched fork's commit, not upstream")
    assert [s.ref for s in m.surface.refs] == ["core_v0.2.0"]
    assert all(m.droppable(p) == [] for p in m.patch_ids)


@pytest.mark.parametrize(
    ("formats", "suffix", "message"),
    [
        (["md", "json"], "", "is a file; several --format values need a folder"),
        (["md"], "/", "ends with '/' (a folder) but"),
    ],
)
def test_out_file_where_a_folder_is_needed_is_usage(
    toy, capsys, matrix_runs, formats, suffix, message
):
    _, upstream, series = toy
    existing = upstream.parent / "existing.md"
    existing.write_text("keep me\n")
    fmt = [arg for f in formats for arg in ("--format", f)]
    argv = matrix_argv(upstream, series, *fmt, "--out", f"{existing}{suffix}")
    assert main(argv) == EXIT_USAGE
    assert message in one_line(capsys)
    assert matrix_runs == [] and existing.read_text() == "keep me\n"
