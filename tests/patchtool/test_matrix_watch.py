"""The matrix watches dev and open pull requests, speaks check's words, computes droppable,
and refuses a name that is both a tag and a branch (check, apply and matrix alike)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_matrix import git, upstream, version_file, write  # noqa: F401 - the fixture
from toyrepo import apply_argv

from megatron_rocm.main import main
from megatron_rocm.patchtool.matrix import build_matrix, new_breaks, select_refs
from megatron_rocm.patchtool.series import load_series


def _branch_with_version(repo: Path, name: str, minor: int, conflict: bool = False) -> str:
    """A branch off core_v0.12.0 reporting 0.<minor>.0; with ``conflict``, p-conflict's line
    changed there. Returns its commit."""
    git(repo, "checkout", "-q", "-b", name, "core_v0.12.0")
    write(repo, "megatron/core/package_info.py", version_file(minor))
    if conflict:
        p = repo / "megatron/core/conflict.py"
        p.write_text(p.read_text().replace("conflict_10 = 10\n", "conflict_10 = 'pr'\n"))
    git(repo, "commit", "-q", "-am", name)
    commit = git(repo, "rev-parse", "HEAD").strip()
    git(repo, "checkout", "-q", "main")
    return commit


@pytest.fixture
def watched(upstream):  # noqa: F811 - pytest's fixture by name
    repo, series = upstream
    _branch_with_version(repo, "dev", 14)
    _branch_with_version(repo, "pull-request/7", 14, conflict=True)
    _branch_with_version(repo, "feature", 14)
    return repo, series


def test_default_set_has_dev_and_open_pull_requests(watched):
    repo, _ = watched
    specs = {r.name: r.watched for r in select_refs(repo, None)}
    assert specs == {
        "core_v0.12.0": False,
        "core_v0.13.0": False,
        "core_v0.14.0": False,
        "main": False,
        "dev": False,
        "pull-request/7": True,
    }


def test_refs_replace_the_watch_list(watched, tmp_path):
    repo, _ = watched
    names = {r.name for r in select_refs(repo, None, ["feature"])}
    assert "feature" in names and "pull-request/7" not in names
    assert "pull-request/*" not in {r.name for r in select_refs(repo, None, [])}
    assert "dev" in {r.name for r in select_refs(repo, None, [])}
    listing = tmp_path / "watch-refs"
    listing.write_text("# comment\nfeature  # trailing\n\n")
    code = main(
        [
            "matrix",
            "--source",
            str(repo),
            "--series",
            str(watched[1]),
            "--no-scan",
            "--format",
            "json",
            "--refs-file",
            str(listing),
            "--out",
            str(tmp_path / "m.json"),
        ]
    )
    rows = {r["ref"]: r["watched"] for r in json.loads((tmp_path / "m.json").read_text())["refs"]}
    assert rows.get("feature") is True and "pull-request/7" not in rows
    assert code == 1  # core_v0.13/0.14 break in this toy upstream, as before


def test_a_watched_break_is_reported_but_never_gates(watched, tmp_path):
    repo, series = watched
    specs = [s for s in select_refs(repo, None) if s.name in ("pull-request/7", "dev")]
    m = build_matrix(repo, specs, load_series(series), source=str(repo), scan=False)
    assert [r.name for r in m.watched_trouble] == ["pull-request/7"]
    assert m.broken_rows == [] and m.ok
    assert "1 watched fail (pull-request/7)" in m.summary()
    data = m.to_dict()
    assert new_breaks(data, None) == []  # the CI job's gate ignores it
    assert {r["ref"]: r["watched"] for r in data["refs"]}["pull-request/7"] is True
    scanned = build_matrix(repo, specs, load_series(series), source=str(repo), scan=True)
    assert [r.ref for r in scanned.surface.refs] == ["dev"]  # a PR is not upstream yet


def _check_json(capsys, repo: Path, series: Path, *args: str) -> dict:
    main(["check", "--source", str(repo), "--series", str(series), "--json", *args])
    return json.loads(capsys.readouterr().out)


def test_check_and_matrix_say_no_variant_alike(upstream, capsys):  # noqa: F811
    repo, series = upstream
    data = _check_json(capsys, repo, series, "--ref", "core_v0.11.0")
    assert {p["status"] for p in data["refs"][0]["patches"]} == {"no-variant"}
    main(["check", "--source", str(repo), "--series", str(series), "--ref", "core_v0.11.0"])
    cells = [ln.split()[:2] for ln in capsys.readouterr().out.splitlines() if ln.startswith("  ")]
    assert cells and all(word == "no-variant" for _, word in cells)
    m = build_matrix(
        repo, select_refs(repo, ["core_v0.11.0"]), load_series(series), source="x", scan=False
    )
    assert {p["status"] for p in m.to_dict()["refs"][0]["patches"]} == {"no-variant"}


def _merged_from_0_13(series: Path) -> None:
    """p-conflict: upstream merged it in 0.13 (the toy upstream changed that line there)."""
    toml = series / "p-conflict" / "patch.toml"
    toml.write_text(
        'id = "p-conflict"\nreason = "test p-conflict"\nupstream = "merged (0.13)"\n\n'
        '[[variant]]\ndiff = "v0.12.diff"\nsince = "0.12.0"\nuntil = "0.13.0"\n\n'
        '[[variant]]\nsince = "0.13.0"\nskip = true\n'
    )


def test_a_merged_patch_reads_merged_and_is_droppable(upstream, capsys):  # noqa: F811
    repo, series = upstream
    _merged_from_0_13(series)
    data = _check_json(capsys, repo, series, "--ref", "core_v0.13.0")
    cell = next(p for p in data["refs"][0]["patches"] if p["patch_id"] == "p-conflict")
    assert cell["status"] == "merged"
    m = build_matrix(
        repo,
        select_refs(repo, ["core_v0.12.0", "core_v0.13.0", "core_v0.14.0"]),
        load_series(series),
        source="x",
        scan=False,
    )
    patches = {p["id"]: p for p in m.to_dict()["patches"]}
    assert patches["p-conflict"]["droppable_at"] == ["core_v0.13.0", "core_v0.14.0"]
    assert patches["p-upstream"]["droppable_at"] == ["core_v0.13.0", "core_v0.14.0"]
    assert "p-conflict (from core_v0.13.0)" in m.summary()


@pytest.fixture
def clash(upstream):  # noqa: F811
    """``core_r0.13.0`` is a tag (at core_v0.13.0) and a branch on another commit."""
    repo, series = upstream
    _branch_with_version(repo, "core_r0.13.0", 16)
    return repo, series


def test_check_refuses_a_tag_that_is_also_a_branch(clash, capsys):
    repo, series = clash
    code = main(["check", "--source", str(repo), "--series", str(series), "--ref", "core_r0.13.0"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1
    assert "refs/tags/core_r0.13.0" in err and "refs/heads/core_r0.13.0" in err
    assert "tags/core_r0.13.0 or --ref heads/core_r0.13.0" in err
    for pick, version in (("tags/core_r0.13.0", "0.13.0"), ("heads/core_r0.13.0", "0.16.0")):
        data = _check_json(capsys, repo, series, "--ref", pick)
        assert data["refs"][0]["version"] == version


def test_apply_refuses_it_before_cloning(clash, tmp_path, capsys):
    repo, series = clash
    dest = tmp_path / "fork"
    code = main(apply_argv(repo, series, dest, ref="core_r0.13.0"))
    captured = capsys.readouterr()
    assert code == 2
    assert "refs/tags/core_r0.13.0" in captured.err and "refs/heads/core_r0.13.0" in captured.err
    assert "cloning" not in captured.out and not dest.exists()
    assert main(apply_argv(repo, series, dest, ref="heads/core_r0.13.0")) == 0
    assert (dest / "megatron/core/package_info.py").read_text() == version_file(16)


def test_matrix_refuses_it_and_lists_both_for_a_glob(clash, capsys):
    repo, series = clash
    with pytest.raises(Exception) as e:
        select_refs(repo, ["core_r0.13.0"])
    assert "refs/tags/core_r0.13.0" in str(e.value) and "refs/heads/core_r0.13.0" in str(e.value)
    assert main(["matrix", "--source", str(repo), "--series", str(series), "--tags",
                 "core_r0.13.0", "--no-scan"]) == 2  # fmt: skip
    assert "ambiguous" in capsys.readouterr().err
    names = {r.name for r in select_refs(repo, ["core_r*"])}
    assert names == {"tags/core_r0.13.0", "heads/core_r0.13.0"}
