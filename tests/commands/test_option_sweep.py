"""Option-like and metacharacter values through every verb and every value-taking option.

Each value is passed as ``--option=VALUE`` (so it reaches our code, not argparse's option
parser) to a fresh and to an existing destination. Whatever the value, the result is the
documented exit code with one line on stderr, the canary file that a shell or an injected git
option would create never appears, an existing fork is unchanged, and nothing is created
except, where the value is a legal file name, exactly that literal name.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from toyrepo import make_series, make_upstream, run, seal, snapshot

from megatron_rocm.main import main

pytestmark = pytest.mark.full

CANARY = "INJECTED"


def hostile(canary: Path) -> list[str]:
    return [
        f"--upload-pack=touch {canary};",
        f"--output={canary}",
        "-D",
        f"$(touch {canary})",
        f"`touch {canary}`",
        f";touch {canary}",
        f"|touch {canary}",
        "name with space",
        "line\nbreak",
        "@{-1}",
        "..",
        "HEAD~1",
        "a..b",
        f"ext::sh -c touch% {canary}",
        "x.lock",
        "",
    ]


VALUE_COUNT = len(hostile(Path("c")))


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One toy upstream, series and fork template for the whole sweep (hundreds of cases)."""
    root = tmp_path_factory.mktemp("sweep")
    with pytest.MonkeyPatch.context() as mp:
        seal(mp, root / "home")
        upstream = make_upstream(root)
        series = make_series(root, upstream)
        template = root / "fork-template"
        run("clone", "-q", str(upstream), str(template), cwd=root)
    return upstream, series, template


@pytest.fixture
def scene(shared, tmp_path, monkeypatch):
    """A work folder (the cwd) holding an existing fork; returns (cwd, upstream, series, fork)."""
    upstream, series, template = shared
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    fork = cwd / "fork"
    shutil.copytree(template, fork, symlinks=True)
    monkeypatch.chdir(cwd)
    return cwd, upstream, series, fork


def _listing(cwd: Path) -> set[str]:
    return {p.name for p in cwd.iterdir()}


# (verb argv with {v} for the value, exit codes allowed, the value may name a created path)
def cases(upstream: Path, series: Path, fork: Path, fresh: Path) -> list[tuple]:
    src, ser = f"--source={upstream}", f"--series={series}"
    return [
        (["apply", src, ser, "--ref={v}", f"--dest={fresh}"], {2}, False),
        (["apply", src, ser, "--ref={v}", f"--dest={fork}"], {2}, False),
        (["apply", src, ser, "--ref=core_v0.2.0", "--branch={v}", f"--dest={fresh}"], {2}, False),
        (["apply", src, ser, "--ref=core_v0.2.0", "--branch={v}", f"--dest={fork}"], {2}, False),
        (["apply", "--source={v}", ser, "--ref=core_v0.2.0", f"--dest={fresh}"], {2, 3}, False),
        (["apply", "--source={v}", ser, "--ref=core_v0.2.0", f"--dest={fork}"], {2, 3}, False),
        (["apply", src, ser, "--ref=core_v0.2.0", "--dest={v}"], {0, 2}, True),
        (["apply", src, "--series={v}", "--ref=core_v0.2.0", f"--dest={fork}"], {2}, False),
        (["apply", src, ser, "--megatron-version={v}", f"--dest={fork}"], {2}, False),
        (["check", src, ser, "--ref={v}"], {2}, False),
        (["check", "--source={v}", ser, "--ref=core_v0.2.0"], {2, 3}, False),
        (["export", "--repo={v}", ser], {2}, False),
        (["list", "--series={v}"], {2}, False),
        (["matrix", src, ser, "--no-scan", "--tags={v}"], {2}, False),
        (["matrix", src, ser, "--no-scan", "--tags=core_v0.2.0", "--out={v}"], {0, 2}, True),
        (["install", "--dry-run", "{v}"], {2}, False),
        (["smoke", "{v}", "--only", "imports"], {2}, False),
        (["smoke", "nowhere", "--only", "imports", "--json={v}"], {2}, False),
    ]


CASE_COUNT = 18


@pytest.mark.parametrize("case", range(CASE_COUNT))
@pytest.mark.parametrize("index", range(VALUE_COUNT))
def test_hostile_value(scene, capsys, case, index):
    cwd, upstream, series, fork = scene
    canary = cwd / CANARY
    value = hostile(canary)[index]
    template, allowed, may_create = cases(upstream, series, fork, cwd / "fresh")[case]
    argv = [a.replace("{v}", value) for a in template]
    before_fork, before_cwd = snapshot(fork), _listing(cwd)
    code = main(argv)
    err = capsys.readouterr().err
    assert code in allowed, (argv, err)
    assert not canary.exists() and not (fork / CANARY).exists()
    assert snapshot(fork) == before_fork
    if code != 0:
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    created = _listing(cwd) - before_cwd
    if code == 0 and may_create:
        literal = value.split("/")[0] or "Megatron-LM"  # a value with '/' is a nested path
        assert created <= {literal, "Megatron-LM"}, created  # the literal name, nothing else
        for name in created:
            target = cwd / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
    else:
        assert created == set(), created


def test_case_table_is_complete(scene):
    cwd, upstream, series, fork = scene
    table = cases(upstream, series, fork, cwd / "fresh")
    assert len(table) == CASE_COUNT
    verbs = {argv[0] for argv, _, _ in table}
    assert verbs == {"apply", "check", "export", "list", "matrix", "install", "smoke"}  # doctor
    # takes no values


@pytest.mark.parametrize("verb", ["apply", "check"])
def test_option_values_after_the_flag_are_argparse_errors(verb, capsys):
    """``--ref -D`` (value as a separate word that looks like an option): one line, exit 2."""
    assert main([verb, "--ref", "-D"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "expected" in err
