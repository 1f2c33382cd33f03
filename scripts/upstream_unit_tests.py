#!/usr/bin/env python3
"""Upstream Megatron-LM's own unit tests on a patched and an unpatched tree, per file.

    upstream_unit_tests.py run --tree unpatched=U --tree patched=P --out DIR
        [--suite NAME ... | --paths P ...] [--nproc 2] [--jobs 4] [--timeout 180]
        [--budget 540] [--resume]
    upstream_unit_tests.py run ... --collect-only       (list the selection; no GPU needed)
    upstream_unit_tests.py compare DIR/unpatched/results.json DIR/patched/results.json [--md F]
    upstream_unit_tests.py summarize --junit X.xml [...] --nproc N --out DIR   (hand-made runs)

``run`` does what upstream's CI does for a bucket, ``torchrun --nproc-per-node N -m pytest
<paths>`` inside each tree, with upstream's own conftest, pytest configuration and marker
filter (``not experimental and not flaky and not flaky_in_dev``). Each tree gets
``DIR/<name>/results.json`` (per-file passed/failed/error/skipped counts, every test's outcome,
each failure's one-line cause) and ``summary.md``; ``compare`` makes the before/after table.

The selection (issue 10): the files under ``tests/unit_tests/{transformer,tensor_parallel,
fusions}`` (the default suite, ``core``; ``--suite dist_checkpointing``, ``--suite models``
or ``--suite all`` select upstream's bigger folders, ``--paths`` any files), less FP8/FP4 tests (node id matches ``--exclude``), less
tests that need more GPUs than ``--nproc``. The last is known only by running: such a test
fails in ``initialize_model_parallel`` ("world_size (2) is not divisible by 4") or skips
saying how many ranks it wants; it is reported as ``needs_gpus``, outside the pass rate.

It never skips, xfails or edits an upstream test, and changes no upstream file. It only
chooses which tests run: the files (``--paths``), and by deselection (recorded, counted) the
FP8 pattern, upstream CI's marker filter and, after a crash or with ``--resume``, the tests
already recorded. Outside the trees it may create ``/opt/data/README.megatron-rocm`` when
``/opt/data`` is absent or empty (``--no-test-data-stub`` turns this off): upstream's conftest
(0.16+) otherwise tries to download its test data there, with no network and no timeout; no
selected test reads it.

Hangs and crashes: pytest-timeout (thread method) where installed, else pytest's
faulthandler dump, plus a watchdog that kills a silent process group after timeout + 60 s.
A dead process group loses nothing recorded (mrocm_ut_progress logs each result as it
happens); the test it died in is an ``error`` saying why, and the rest run in a new process.

Exit codes: 0 every selected test ran (whatever its outcome) · 1 budget ran out first (run
again with ``--resume``) · 2 usage · 3 environment (no torch, too few GPUs, not a tree).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from upstream_tests.launch import Settings  # noqa: E402
from upstream_tests.report import compare, compare_markdown, run_document, run_markdown  # noqa: E402
from upstream_tests.results import Result, classify, read_junit  # noqa: E402
from upstream_tests.runner import Tree, collect_only, probe, run_all, stub_test_data, tree_meta  # noqa: E402

# Named selections of upstream's tests/unit_tests folders. The default stays "core": the
# checkpointing and model folders hold more tests than the core set (see docs/upstream-tests.md)
# and would not fit the default budget beside it.
SUITES = {
    "core": [
        "tests/unit_tests/transformer",
        "tests/unit_tests/tensor_parallel",
        "tests/unit_tests/fusions",
    ],
    "dist_checkpointing": ["tests/unit_tests/dist_checkpointing"],
    "models": ["tests/unit_tests/models"],
}
SUITES["all"] = [p for name in ("core", "dist_checkpointing", "models") for p in SUITES[name]]
DEFAULT_SUITE = "core"
DEFAULT_PATHS = SUITES[DEFAULT_SUITE]
UPSTREAM_CI_MARKERS = "not experimental and not flaky and not flaky_in_dev"
FP8 = r"fp8|fp4|float8"


class Usage(Exception):
    """Bad input: one line, exit 2."""


class Environment(Exception):
    """The machine or the tree cannot do this: one line, exit 3."""


def _tree(spec: str, out: Path) -> Tree:
    name, sep, path = spec.partition("=")
    if not sep:
        name, path = Path(spec).name, spec
    if not name or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise Usage(f"--tree {spec!r}: NAME must be letters, digits, '.', '-' or '_' (NAME=PATH)")
    root = Path(path).resolve()
    if not (root / "tests" / "unit_tests" / "conftest.py").is_file():
        raise Environment(
            f"{root} has no tests/unit_tests/conftest.py: give a Megatron-LM git tree "
            "(a megatron-core sdist ships no tests)"
        )
    return Tree(name, root, out / name)


def _resume(tree: Tree) -> None:
    prev = tree.out / "results.json"
    if not prev.is_file():
        return
    doc = json.loads(prev.read_text(encoding="utf-8"))
    if doc.get("tree") != tree.meta.get("tree"):
        raise Usage(
            f"{prev} holds results of another tree ({doc.get('describe')}, files "
            f"{doc.get('tree')}): use another --out"
        )
    for nodeid, res in doc["tests"].items():
        if res["outcome"] != "not_run":
            tree.results[nodeid] = Result(
                res["outcome"], res.get("message", ""), res.get("duration", 0.0)
            )


def selection(suites: list[str] | None, paths: list[str] | None) -> list[str]:
    """The test paths of a run: ``--paths`` as given, else the suites' folders in order
    (each once), else the default suite."""
    if paths is not None:
        if suites:
            raise Usage("give --suite or --paths, not both")
        return paths
    chosen: list[str] = []
    for name in suites or [DEFAULT_SUITE]:
        chosen += [p for p in SUITES[name] if p not in chosen]
    return chosen


def _check_paths(trees: list[Tree], paths: list[str]) -> None:
    for t in trees:
        missing = [p for p in paths if not (t.path / p.split("::")[0]).exists()]
        if missing:
            raise Usage(f"{t.name} ({t.path}) has no {', '.join(missing)}")


def cmd_run(a: argparse.Namespace) -> int:
    t0 = time.monotonic()
    say = _sayer(t0)
    out = Path(a.out).resolve()
    suites = None if a.paths is not None else (a.suite or [DEFAULT_SUITE])
    a.paths = selection(a.suite, a.paths)
    trees = [_tree(spec, out) for spec in a.tree]
    if len({t.name for t in trees}) != len(trees):
        raise Usage("two --tree entries have the same NAME")
    _check_paths(trees, a.paths)
    try:
        info = probe(a.python) if not a.collect_only else {}
    except RuntimeError as e:
        raise Environment(str(e)) from e
    if not a.collect_only and info["gpus"] < a.nproc and not a.allow_cpu:
        raise Environment(
            f"--nproc {a.nproc} needs {a.nproc} GPUs; this machine has {info['gpus']}"
        )
    has_timeout = (
        subprocess.run([a.python, "-c", "import pytest_timeout"], capture_output=True).returncode
        == 0
    )
    if not has_timeout:
        say("pytest-timeout not installed: hangs are caught by the watchdog only")
    s = Settings(
        python=a.python, nproc=a.nproc, timeout=a.timeout, deadline=t0 + a.budget, repo=HERE.parent,
        plugin_dir=HERE / "upstream_tests" / "plugin", markexpr=a.markexpr or None, exclude=a.exclude or None,
        has_timeout_plugin=has_timeout, pytest_extra=a.pytest_arg, grace=a.watchdog_grace,
    )  # fmt: skip
    settings = {
        "suites": suites,
        "paths": a.paths,
        "markexpr": a.markexpr,
        "exclude": a.exclude,
        "timeout": a.timeout,
    }
    for t in trees:
        t.meta = {
            "name": t.name,
            "path": str(t.path),
            **tree_meta(t.path),
            "nproc": a.nproc,
            **info,
            **settings,
        }
        if a.resume:
            _resume(t)
    if a.collect_only:
        collect_only(trees, a.paths, s, say)
        return 0
    if not a.no_test_data_stub:
        stub_test_data(trees, say)
    docs = run_all(trees, a.paths, s, a.jobs, a.chunk_tests, say)
    for d in docs:
        say(f"{d['name']}: {d['totals']} -> {out / d['name']}/results.json, summary.md")
    return 0 if all(d["complete"] for d in docs) else 1


def cmd_compare(a: argparse.Namespace) -> int:
    docs = []
    for p in (a.before, a.after):
        try:
            docs.append(json.loads(Path(p).read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError) as e:
            raise Usage(f"cannot read {p}: {e}") from e
        if "tests" not in docs[-1]:
            raise Usage(f"{p} is not a results.json of upstream_unit_tests.py")
    cmp = compare(*docs)
    text = compare_markdown(cmp, docs[1].get("nproc"))
    if a.json:
        Path(a.json).write_text(json.dumps(cmp, indent=1), encoding="utf-8")
    if a.md:
        Path(a.md).write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


def cmd_summarize(a: argparse.Namespace) -> int:
    results, errors = {}, {}
    for p in a.junit:
        try:
            r, e = read_junit(Path(p))
        except (OSError, ET.ParseError) as exc:
            raise Usage(f"cannot read JUnit XML {p}: {exc}") from exc
        results.update(r)
        errors.update(e)
    results = {k: classify(v, a.nproc) for k, v in results.items()}
    doc = run_document({"name": a.name, "nproc": a.nproc, "complete": True}, results, errors, {})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    (out / "summary.md").write_text(run_markdown(doc), encoding="utf-8")
    print(f"{a.name}: {doc['totals']} -> {out}/results.json, summary.md")
    return 0


def _sayer(t0: float):
    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.0f}s] {msg}", flush=True)

    return say


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        raise Usage(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="upstream_unit_tests.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    r = sub.add_parser("run", help="run the selection on one or more trees")
    r.add_argument(
        "--tree",
        action="append",
        required=True,
        metavar="NAME=PATH",
        help="a Megatron-LM tree (repeat)",
    )
    r.add_argument("--out", required=True, help="results folder (one sub-folder per tree)")
    r.add_argument(
        "--suite",
        action="append",
        choices=sorted(SUITES),
        help=f"named folders of tests/unit_tests (repeat; default {DEFAULT_SUITE!r}: "
        + ", ".join(p.rsplit("/", 1)[-1] for p in SUITES[DEFAULT_SUITE])
        + ")",
    )
    r.add_argument("--paths", nargs="+", help="test files/folders, relative to the tree")
    r.add_argument(
        "--nproc", type=_positive(int), default=2, help="ranks (GPUs) per test process (2)"
    )
    r.add_argument("--jobs", type=_positive(int), default=1, help="test processes at once (1)")
    r.add_argument(
        "--timeout", type=_positive(float), default=180.0, help="seconds one test may take (180)"
    )
    r.add_argument(
        "--budget",
        type=_positive(float),
        default=540.0,
        help="wall-clock seconds for the whole run (540)",
    )
    r.add_argument(
        "--chunk-tests", type=_positive(int), default=150, help="tests per pytest process (150)"
    )
    r.add_argument(
        "--markexpr", default=UPSTREAM_CI_MARKERS, help=f"pytest -m ({UPSTREAM_CI_MARKERS!r})"
    )
    r.add_argument(
        "--exclude",
        default=FP8,
        help=f"deselect node ids matching this regex ({FP8!r}; '' for none)",
    )
    r.add_argument("--python", default=sys.executable, help="interpreter with torch and pytest")
    r.add_argument(
        "--pytest-arg", action="append", default=[], help="extra pytest argument (repeat)"
    )
    r.add_argument(
        "--resume", action="store_true", help="keep the results already in --out, run the rest"
    )
    r.add_argument(
        "--collect-only", action="store_true", help="only list the selection (selection.md)"
    )
    r.add_argument("--no-test-data-stub", action="store_true", help="leave /opt/data alone")
    r.add_argument(
        "--allow-cpu", action="store_true", help=argparse.SUPPRESS
    )  # the CPU tests' toy suites
    r.add_argument("--watchdog-grace", type=_positive(float), default=60.0, help=argparse.SUPPRESS)
    c = sub.add_parser("compare", help="before/after table of two results.json")
    c.add_argument("before")
    c.add_argument("after")
    c.add_argument("--md", help="write the markdown here too")
    c.add_argument("--json", help="write the comparison as JSON")
    m = sub.add_parser(
        "summarize", help="results.json/summary.md from JUnit XML of a hand-made run"
    )
    m.add_argument("--junit", nargs="+", required=True)
    m.add_argument("--nproc", type=_positive(int), required=True, help="ranks the run had")
    m.add_argument("--name", default="junit")
    m.add_argument("--out", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        a = parser().parse_args(argv)
        return {"run": cmd_run, "compare": cmd_compare, "summarize": cmd_summarize}[a.cmd](a)
    except Usage as e:
        print(f"upstream_unit_tests.py: {e}", file=sys.stderr)
        return 2
    except (Environment, RuntimeError) as e:
        print(f"upstream_unit_tests.py: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
