"""Variants selected by content (``when``): a branch whose version says one release and whose
code is another (upstream's ``dev``) gets its own diff; every other tree keeps the plain one."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from toyrepo import SOFTMAX, apply_argv, commit_all, run, softmax_patched, write

from megatron_rocm.main import main
from megatron_rocm.patchtool.gitcmd import DIFF_ARGS
from megatron_rocm.patchtool.series import load_series, parse_version

PROBE = "softmax_19 = 'changed'"  # what core_v0.3.0 changed next to p-softmax's line


def _probed_variant(root: Path, upstream: Path, series: Path, extra: str = "") -> None:
    """p-softmax gets a diff made on core_v0.3.0's softmax.py, taken where the probe holds."""
    work = root / "probe-work"
    run("clone", "-q", str(upstream), str(work), cwd=root)
    run("checkout", "-q", "-b", "probe", "core_v0.3.0", cwd=work)
    before = (work / SOFTMAX).read_text().splitlines(keepends=True)
    write(work, SOFTMAX, softmax_patched(before))
    commit_all(work, "softmax on v0.3")
    diff = subprocess.run(
        ["git", *DIFF_ARGS, "HEAD^", "HEAD"], cwd=work, check=True, capture_output=True
    ).stdout
    (series / "p-softmax" / "probed.diff").write_bytes(diff)
    with (series / "p-softmax" / "patch.toml").open("a") as f:
        f.write(
            '\n[[variant]]\ndiff = "probed.diff"\nsince = "0.1.0"\n'
            f'when = {{ path = "{SOFTMAX}", contains = "{PROBE}" }}\n{extra}'
        )


def _check(capsys, upstream: Path, series: Path, *refs: str) -> tuple[int, dict]:
    code = main(
        ["check", "--source", str(upstream), "--series", str(series), "--ref", *refs, "--json"]
    )
    return code, json.loads(capsys.readouterr().out)


def test_a_probed_variant_applies_where_its_text_is_and_nowhere_else(toy, capsys):
    root, upstream, series = toy
    _probed_variant(root, upstream, series)
    code, data = _check(capsys, upstream, series, "core_v0.2.0", "core_v0.3.0")
    cells = {r["ref"]: r["patches"][0] for r in data["refs"]}
    # core_v0.3.0 conflicts with the plain diff; its probed one applies cleanly
    assert (cells["core_v0.3.0"]["variant"], cells["core_v0.3.0"]["label"]) == (
        "probed.diff",
        "clean",
    )
    # the same version range, but without the probe's text: the plain variant, as before
    assert (cells["core_v0.2.0"]["variant"], cells["core_v0.2.0"]["label"]) == (
        "v0.1.diff",
        "offset",
    )
    assert data["refs"][1]["patches"][1]["label"] == "fuzz"  # p-norm still drifts there
    assert code == 0  # without the probed variant core_v0.3.0 conflicts (exit 1)


def test_without_a_reader_the_plain_variant_is_taken(toy):
    root, upstream, series = toy
    _probed_variant(root, upstream, series)
    patch = load_series(series).get("p-softmax")
    v = parse_version("0.3.0")
    assert patch.variant_for(v).diff == "v0.1.diff"
    assert patch.variant_for(v, lambda path: PROBE.encode()).diff == "probed.diff"
    assert patch.variant_for(v, lambda path: None).diff == "v0.1.diff"


@pytest.mark.parametrize(
    "when",
    [
        'when = "softmax.py"',
        'when = { path = "x.py" }',
        'when = { path = "x.py", contains = "" }',
        'when = { path = "x.py", contains = "a", lacks = "b" }',
        "when = []",
    ],
)
def test_a_malformed_probe_is_a_usage_error(toy, capsys, when):
    _, upstream, series = toy
    toml = series / "p-norm" / "patch.toml"
    toml.write_text(toml.read_text() + f"{when}\n")
    code = main(["check", "--source", str(upstream), "--series", str(series)])
    err = capsys.readouterr().err
    assert code == 2
    assert "'when'" in err and str(toml) in err


def test_export_of_a_fork_built_from_a_probed_variant_changes_nothing(toy, capsys):
    """export takes the variant apply took: without the probe it would read the fork's
    commit as an edit of the plain diff and overwrite it with the probed one's content."""
    root, upstream, series = toy
    _probed_variant(root, upstream, series)
    # p-norm is fuzz on core_v0.3.0: leave it out so the fork is the probed patch alone
    (series / "series").write_text("p-softmax\n")
    before = {p: p.read_bytes() for p in sorted(series.rglob("*")) if p.is_file()}
    dest = root / "fork"
    assert main(apply_argv(upstream, series, dest, ref="core_v0.3.0")) == 0
    capsys.readouterr()
    assert main(["export", "--repo", str(dest), "--series", str(series), "--json"]) == 0
    items = json.loads(capsys.readouterr().out)["patches"]
    assert [(i["patch_id"], i["action"], i["diff"]) for i in items] == [
        ("p-softmax", "unchanged", "probed.diff")
    ]
    assert {p: p.read_bytes() for p in sorted(series.rglob("*")) if p.is_file()} == before
