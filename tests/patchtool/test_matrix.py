"""The matrix over a small upstream built here: drift, conflict, deleted file, already upstream.

Upstream history (one repo, tags in order):
  core_v0.11.0  below the default minimum
  core_v0.12.0  the base every patch was written against (all clean)
  core_v0.13.0  drift.py gains lines on top (offset); conflict.py's patched line changes
                (conflict); upstream.py gets exactly our change (already applied)
  core_v0.14.0  gone.py is deleted (file-gone)
  main          version 0.15.0, like 0.14
  core_r0.13.0  a non-release tag (never selected by default)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rocm.commands.matrix import matrix as matrix_cmd
from megatron_rocm.errors import UsageError
from megatron_rocm.main import main
from megatron_rocm.patchtool import gitcmd
from megatron_rocm.patchtool.matrix import (
    build_matrix,
    list_refs,
    new_breaks,
    select_refs,
    status_of,
)
from megatron_rocm.patchtool.report import render
from megatron_rocm.patchtool.series import load_series

ROOT = Path(__file__).resolve().parents[2]
PATCHES = ("p-drift", "p-conflict", "p-gone", "p-upstream")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, check=True, capture_output=True, text=True
    ).stdout


def numbered(name: str, n: int = 20) -> str:
    return "".join(f"{name}_{i} = {i}\n" for i in range(1, n + 1))


def write(repo: Path, rel: str, text: str) -> None:
    p = repo / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def version_file(minor: int) -> str:
    return f"MAJOR = 0\nMINOR = {minor}\nPATCH = 0\nPRE_RELEASE = ''\n"


def commit_tag(repo: Path, tag: str | None, msg: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", msg)
    if tag:
        git(repo, "tag", tag)


def make_patch(repo: Path, rel: str, old: str, new: str) -> str:
    """A diff from the work tree (at the base tag) with our pinned diff options."""
    p = repo / rel
    text = p.read_text()
    assert old in text
    p.write_text(text.replace(old, new))
    diff = subprocess.run(
        ["git", *gitcmd.DIFF_ARGS], cwd=repo, check=True, capture_output=True, text=True
    ).stdout
    git(repo, "checkout", "--", rel)
    return diff


@pytest.fixture
def upstream(tmp_path: Path) -> tuple[Path, Path]:
    """(repo, series dir)."""
    repo = tmp_path / "upstream"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    write(repo, "megatron/core/package_info.py", version_file(11))
    for name in ("drift", "conflict", "upstream"):
        write(repo, f"megatron/core/{name}.py", numbered(name))
    write(repo, "megatron/legacy/gone.py", numbered("gone"))
    commit_tag(repo, "core_v0.11.0", "0.11")
    write(repo, "megatron/core/package_info.py", version_file(12))
    commit_tag(repo, "core_v0.12.0", "0.12")

    series = tmp_path / "series"
    diffs = {
        "p-drift": make_patch(
            repo, "megatron/core/drift.py", "drift_10 = 10\n", "drift_10 = 'ROCM'\n"
        ),
        "p-conflict": make_patch(
            repo, "megatron/core/conflict.py", "conflict_10 = 10\n", "conflict_10 = 'ROCM'\n"
        ),
        "p-gone": make_patch(
            repo, "megatron/legacy/gone.py", "gone_10 = 10\n", "gone_10 = 'ROCM'\n"
        ),
        "p-upstream": make_patch(
            repo, "megatron/core/upstream.py", "upstream_10 = 10\n", "upstream_10 = 'ROCM'\n"
        ),
    }
    for pid, diff in diffs.items():
        write(series, f"{pid}/v0.12.diff", diff)
        write(
            series,
            f"{pid}/patch.toml",
            f'id = "{pid}"\nreason = "test {pid}"\nupstream = "not-submitted"\n\n'
            '[[variant]]\ndiff = "v0.12.diff"\nsince = "0.12.0"\n',
        )
    write(series, "series", "\n".join(PATCHES) + "\n")

    write(repo, "megatron/core/package_info.py", version_file(13))
    drift = repo / "megatron/core/drift.py"
    drift.write_text("# new header\n# more\n# lines\n" + drift.read_text())
    conflict = repo / "megatron/core/conflict.py"
    conflict.write_text(conflict.read_text().replace("conflict_10 = 10\n", "conflict_10 = 11\n"))
    up = repo / "megatron/core/upstream.py"
    up.write_text(up.read_text().replace("upstream_10 = 10\n", "upstream_10 = 'ROCM'\n"))
    commit_tag(repo, "core_v0.13.0", "0.13")
    git(repo, "tag", "core_r0.13.0")
    write(repo, "megatron/core/package_info.py", version_file(14))
    (repo / "megatron/legacy/gone.py").unlink()
    commit_tag(repo, "core_v0.14.0", "0.14")
    write(repo, "megatron/core/package_info.py", version_file(15))
    commit_tag(repo, None, "0.15 on main")
    return repo, series


def test_default_selection_is_releases_from_0_12_plus_main(upstream):
    repo, _ = upstream
    names = {r.name for r in select_refs(repo, None)}
    assert names == {"core_v0.12.0", "core_v0.13.0", "core_v0.14.0", "main"}
    kinds = {n: r.kind for n, r in list_refs(repo).items()}
    assert kinds["main"] == "branch" and kinds["core_r0.13.0"] == "tag"


def test_tag_patterns_match_tags_branches_and_commits(upstream):
    repo, _ = upstream
    assert [r.name for r in select_refs(repo, ["core_v0.1[23]*"])] == [
        "core_v0.12.0",
        "core_v0.13.0",
    ]
    assert [r.name for r in select_refs(repo, ["ma*"])] == ["main"]
    sha = git(repo, "rev-parse", "core_v0.11.0").strip()
    assert select_refs(repo, [sha])[0].kind == "commit"
    with pytest.raises(UsageError, match="matches no tag or branch"):
        select_refs(repo, ["core_v9*"])


def test_labels_first_break_and_droppable(upstream):
    repo, series_dir = upstream
    specs = select_refs(repo, None)
    m = build_matrix(repo, list(reversed(specs)), load_series(series_dir), source="t")
    assert [r.name for r in m.rows] == ["core_v0.12.0", "core_v0.13.0", "core_v0.14.0", "main"]
    grid = {r.name: {p.patch_id: status_of(p) for p in r.report.patches} for r in m.rows}
    assert set(grid["core_v0.12.0"].values()) == {"clean"}
    assert grid["core_v0.13.0"] == {
        "p-drift": "offset",
        "p-conflict": "conflict",
        "p-gone": "clean",
        "p-upstream": "already-applied",
    }
    assert grid["core_v0.14.0"]["p-gone"] == "file-gone"
    assert m.first_break("p-conflict") == "core_v0.13.0"
    assert m.first_break("p-gone") == "core_v0.14.0"
    assert m.first_break("p-drift") is None and m.first_break("p-upstream") is None
    assert m.droppable("p-upstream") == ["core_v0.13.0", "core_v0.14.0", "main"]
    assert m.droppable("p-drift") == []
    assert not m.ok and [r.name for r in m.broken_rows] == ["core_v0.13.0", "core_v0.14.0", "main"]
    s = m.summary()
    assert "4 refs x 4 patches: 1 apply, 3 break" in s
    assert "first breaks: p-conflict@core_v0.13.0, p-gone@core_v0.14.0" in s
    assert "droppable: p-upstream (from core_v0.13.0)" in s


def test_new_breaks_compares_with_previous_json(upstream):
    repo, series_dir = upstream
    series = load_series(series_dir)
    old = build_matrix(repo, select_refs(repo, ["core_v0.1[23]*"]), series, source="t")
    new = build_matrix(repo, select_refs(repo, None), series, source="t")
    old_d, new_d = json.loads(json.dumps(old.to_dict())), json.loads(json.dumps(new.to_dict()))
    assert new_breaks(new_d, old_d) == [
        ("core_v0.14.0", "p-conflict"),
        ("core_v0.14.0", "p-gone"),
        ("main", "p-conflict"),
        ("main", "p-gone"),
    ]
    assert new_breaks(new_d, new_d) == []
    assert ("core_v0.13.0", "p-conflict") in new_breaks(new_d, None)


def test_command_exit_codes_and_outputs(upstream, tmp_path, capsys):
    repo, series_dir = upstream
    common = dict(source=str(repo), series_dir=str(series_dir), version_override=None)
    assert (
        matrix_cmd(tag_patterns=["core_v0.12.0"], formats=["md"], out=None, scan=False, **common)
        == 0
    )
    assert "all refs apply" in capsys.readouterr().out
    out = tmp_path / "reports"
    assert (
        matrix_cmd(
            tag_patterns=None,
            formats=["md", "html", "json", "junit"],
            out=str(out),
            scan=True,
            **common,
        )
        == 1
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "matrix.html",
        "matrix.json",
        "matrix.junit.xml",
        "matrix.md",
    ]
    single = tmp_path / "one.json"
    assert (
        matrix_cmd(tag_patterns=["main"], formats=["json"], out=str(single), scan=False, **common)
        == 1
    )
    assert json.loads(single.read_text())["refs"][0]["ref"] == "main"


def test_cli_usage_and_source_errors(upstream, tmp_path, capsys):
    repo, series_dir = upstream
    args = ["matrix", "--series", str(series_dir), "--no-scan"]
    assert main([*args, "--source", str(repo), "--tags", "nope*"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'nope*' matches no tag or branch" in err
    assert main([*args, "--source", str(tmp_path / "missing")]) == 3
    assert main([*args, "--source", str(repo), "--format", "md", "--format", "json"]) == 2


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts/validate_upstream_tags.py"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_ci_script_fails_only_on_new_breaks(upstream, tmp_path):
    repo, series_dir = upstream
    base = [str(repo), "--no-fetch", "--series", str(series_dir), "--no-scan"]
    first = run_script(*base, "--out", str(tmp_path / "r1"), "--tags", "core_v0.12.0")
    assert first.returncode == 0, first.stdout + first.stderr
    second = run_script(
        *base, "--out", str(tmp_path / "r2"), "--previous", str(tmp_path / "r1/matrix.json")
    )
    assert second.returncode == 1
    assert "NEW BREAK: p-conflict @ core_v0.13.0" in second.stdout
    third = run_script(
        *base, "--out", str(tmp_path / "r3"), "--previous", str(tmp_path / "r2/matrix.json")
    )
    assert third.returncode == 0, third.stdout
    assert "known breaks remain" in third.stdout
    for name in ("matrix.md", "matrix.html", "matrix.json", "matrix.junit.xml"):
        assert (tmp_path / "r3" / name).is_file()


def test_ci_script_clones_and_fetches_a_url(upstream, tmp_path):
    repo, series_dir = upstream
    url = f"file://{repo}"
    mirror = tmp_path / "cache/mlm.git"
    args = [
        url,
        "--mirror-dir",
        str(mirror),
        "--series",
        str(series_dir),
        "--no-scan",
        "--tags",
        "core_v0.12.0",
        "--out",
        str(tmp_path / "r"),
    ]
    first = run_script(*args)
    assert first.returncode == 0, first.stdout + first.stderr
    assert (mirror / "HEAD").is_file()
    git(repo, "tag", "core_v0.12.9", "core_v0.12.0")  # a tag that appears after run 1
    second = run_script(*args[:-4], "--tags", "core_v0.12.9", "--out", str(tmp_path / "r2"))
    assert second.returncode == 0, second.stdout + second.stderr
    assert "fetching" in second.stdout


def test_version_override_keeps_tree_order_and_reports_group_failures(upstream):
    repo, series_dir = upstream
    series = load_series(series_dir)
    specs = list(reversed(select_refs(repo, None)))
    m = build_matrix(repo, specs, series, source="t", version_override="0.12.0", scan=False)
    assert [r.name for r in m.rows][-1] == "main"
    assert {r.report.version for r in m.rows} == {"0.12.0"}
    md = render(build_matrix(repo, specs, series, source="t"), "md")
    assert "### p-conflict (v0.12.diff): conflict at core_v0.13.0, core_v0.14.0, main" in md
    assert md.count("### p-conflict") == 1


def test_rows_are_in_version_order_with_pre_releases_before_their_release(upstream):
    """``core_v0.13.0rc1`` is older than ``core_v0.13.0``: surface diffs and first breaks
    follow this order (rc tags used to sort after their release)."""
    repo, series_dir = upstream
    for tag, base in (("core_v0.13.0rc1", "core_v0.12.0"), ("core_v0.14.0rc0", "core_v0.13.0")):
        git(repo, "tag", tag, base)
    specs = select_refs(repo, ["core_v0.1[234]*", "main"])
    m = build_matrix(repo, specs, load_series(series_dir), source="t")
    names = [r.name for r in m.rows]
    assert names == [
        "core_v0.12.0",
        "core_v0.13.0rc1",
        "core_v0.13.0",
        "core_v0.14.0rc0",
        "core_v0.14.0",
        "main",
    ]
    assert [s.previous for s in m.surface.refs][2] == "core_v0.13.0rc1"


@pytest.mark.parametrize(
    ("name", "version"),
    [("core_v0.14.0rc7", "0.14.0rc7"), ("core_v0.14.0", "0.14.0"), ("core_r0.13.0", "0.13.0")],
)
def test_name_version(name, version):
    from packaging.version import Version

    from megatron_rocm.patchtool.matrix import name_version

    assert name_version(name) == Version(version)
    assert name_version("main") is None and name_version("core_vX") is None
