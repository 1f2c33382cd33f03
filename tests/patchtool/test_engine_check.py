"""check: every hunk label on a synthetic upstream, JSON output, exit codes."""

from __future__ import annotations

import json

import pytest

from megatron_rocm.main import main


def _labels(capsys, upstream, series, ref):
    code = main(
        ["check", "--source", str(upstream), "--series", str(series), "--ref", ref, "--json"]
    )
    data = json.loads(capsys.readouterr().out)
    (rep,) = data["refs"]
    return code, {p["patch_id"]: p["label"] for p in rep["patches"]}, rep


@pytest.mark.parametrize(
    ("ref", "softmax", "norm", "code"),
    [
        ("core_v0.1.0", "clean", "clean", 0),
        ("core_v0.2.0", "offset", "offset", 0),
        ("core_v0.3.0", "conflict", "fuzz", 1),
        ("core_v0.4.0", "offset", "file-gone", 1),
        ("core_v0.5.0", "already-applied", "offset", 0),
        ("core_v0.6.0", "offset", "needs-3-way", 1),
    ],
)
def test_check_labels_every_case(toy, capsys, ref, softmax, norm, code):
    _, upstream, series = toy
    got_code, labels, _ = _labels(capsys, upstream, series, ref)
    assert labels == {"p-softmax": softmax, "p-norm": norm}
    assert got_code == code


def test_check_reports_the_lines_that_no_longer_match(toy, capsys):
    _, upstream, series = toy
    _, _, rep = _labels(capsys, upstream, series, "core_v0.3.0")
    hunk = rep["patches"][0]["hunks"][0]
    assert hunk["path"] == "megatron/core/fusions/softmax.py"
    assert "softmax_19 = 'changed'" in hunk["detail"]


def test_prerelease_tree_version_uses_release_range(toy, capsys):
    _, upstream, series = toy
    _, _, rep = _labels(capsys, upstream, series, "core_v0.6.0")
    assert rep["version"] == "0.6.0rc0"
    assert rep["patches"][0]["variant"] == "v0.1.diff"


def test_check_several_refs_human_output(toy, capsys):
    _, upstream, series = toy
    code = main(
        [
            "check",
            "--source",
            str(upstream),
            "--series",
            str(series),
            "--ref",
            "core_v0.1.0",
            "core_v0.2.0",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "2/2 refs apply" in out and "offset" in out


def test_version_override_without_variant_fails(toy, capsys):
    _, upstream, series = toy
    code = main(
        [
            "check",
            "--source",
            str(upstream),
            "--series",
            str(series),
            "--ref",
            "core_v0.1.0",
            "--megatron-version",
            "0.0.1",
        ]
    )
    assert code == 1
    assert "no variant of p-softmax covers version 0.0.1" in capsys.readouterr().out


def test_default_ref_is_newest_release_tag(toy, capsys):
    _, upstream, series = toy
    main(["check", "--source", str(upstream), "--series", str(series), "--json"])
    assert json.loads(capsys.readouterr().out)["refs"][0]["ref"] == "core_v0.6.0"
