"""Every verb through ``main()``: argparse -> dispatch -> the verb's typed function.

Two layers: the argument mapping (each option reaches its keyword, nothing dropped), with the
verb function replaced by a recorder; and a real run of each patch-tool verb on the toy
upstream, checking its exit code and output through ``main()`` alone.
"""

from __future__ import annotations

import json

import pytest
from toyrepo import apply_argv, run

from megatron_rocm.main import build_parser, main

# verb argv -> (module, function, the keywords it must receive)
CASES = {
    "apply": (
        [
            "apply",
            "--source",
            "S",
            "--ref",
            "R",
            "--dest",
            "D",
            "--branch",
            "B",
            "--3way",
            "--series",
            "P",
            "--megatron-version",
            "0.14.0",
            "--json",
        ],
        "apply",
        "apply",
        dict(
            source="S",
            ref="R",
            dest="D",
            branch="B",
            three_way=True,
            series_dir="P",
            version_override="0.14.0",
            as_json=True,
        ),
    ),
    "check": (
        ["check", "--source", "S", "--ref", "A", "B", "--series", "P", "--json"],
        "check",
        "check",
        dict(source="S", refs=["A", "B"], series_dir="P", version_override=None, as_json=True),
    ),
    "export": (
        ["export", "--repo", "F", "--new-variant", "--megatron-version", "0.15.0"],
        "export",
        "export",
        dict(
            repo_dir="F",
            new_variant=True,
            series_dir=None,
            version_override="0.15.0",
            as_json=False,
        ),
    ),
    "list": (["list", "--json"], "list_series", "list_series", dict(series_dir=None, as_json=True)),
    "matrix": (
        [
            "matrix",
            "--tags",
            "core_v0.1*",
            "--format",
            "md",
            "--format",
            "json",
            "--out",
            "O",
            "--no-scan",
            "--refs",
            "pull-request/*",
            "feature",
            "--refs-file",
            "W",
        ],
        "matrix",
        "matrix",
        dict(
            source=None,
            tag_patterns=["core_v0.1*"],
            watch=["pull-request/*", "feature"],
            watch_file="W",
            formats=["md", "json"],
            out="O",
            scan=False,
            series_dir=None,
            version_override=None,
        ),
    ),
    "install": (
        ["install", "T", "--no-editable", "--dry-run", "--json"],
        "install",
        "install",
        dict(tree_dir="T", editable=False, dry_run=True, as_json=True),
    ),
    "smoke": (
        ["smoke", "T", "--json", "J", "--junit", "U", "--only", "kernels", "--steps", "8"]
        + ["--full", "--report", "R"],
        "smoke",
        "smoke",
        dict(
            tree_dir="T",
            json_file="J",
            junit_file="U",
            only=["kernels"],
            steps=8,
            full=True,
            report_dir="R",
        ),
    ),
    "doctor": (["doctor", "--json"], "doctor", "doctor", dict(as_json=True)),
}


def test_cases_cover_every_verb():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(CASES) == sorted(sub.choices)


@pytest.mark.parametrize("verb", sorted(CASES))
def test_main_dispatches_every_option_to_its_keyword(verb, monkeypatch):
    argv, module, func, expected = CASES[verb]
    seen = {}

    def recorder(**kwargs):
        seen.update(kwargs)
        return 7  # an exit code no verb uses: proves main returns the verb's own

    monkeypatch.setattr(f"megatron_rocm.commands.{module}.{func}", recorder)
    assert main(argv) == 7
    assert seen == expected


def test_real_run_of_each_patch_tool_verb(toy, capsys):
    root, upstream, series = toy
    fork = root / "fork"
    assert main(apply_argv(upstream, series, fork) + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["branch"] == "rocm/core_v0.2.0"

    argv = ["check", "--source", str(upstream), "--series", str(series), "--ref"]
    assert main([*argv, "core_v0.2.0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert main([*argv, "core_v0.3.0"]) == 1  # a conflict: patches do not apply
    assert "0/1 refs apply" in capsys.readouterr().out

    assert main(["export", "--repo", str(fork), "--series", str(series), "--json"]) == 0
    actions = {p["action"] for p in json.loads(capsys.readouterr().out)["patches"]}
    assert actions == {"unchanged"}

    assert main(["list", "--series", str(series), "--json"]) == 0
    assert [p["id"] for p in json.loads(capsys.readouterr().out)["patches"]] == [
        "p-softmax",
        "p-norm",
    ]

    out = root / "m.json"
    mx = ["matrix", "--source", str(upstream), "--series", str(series), "--no-scan"]
    assert main([*mx, "--tags", "core_v0.[12].0", "--format", "json", "--out", str(out)]) == 0
    assert [r["ref"] for r in json.loads(out.read_text())["refs"]] == ["core_v0.1.0", "core_v0.2.0"]
    assert main([*mx, "--tags", "core_v0.4.0"]) == 1  # file-gone breaks the matrix
    assert run("status", "--porcelain", cwd=fork) == ""
