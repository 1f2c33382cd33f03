"""pytest plugin that scripts/upstream_unit_tests.py loads (``-p mrocm_ut_progress``) into runs
of upstream Megatron-LM's own unit tests, and scripts/gpu_tests.py into runs of ours.

Why: pytest writes its JUnit XML only when the session ends, so a rank that crashes (NCCL
abort, segfault) or a test killed for hanging would lose every result of that process. This
plugin appends one JSON line per event to ``$MROCM_UT_PROGRESS.rank<RANK>.jsonl`` as it
happens, so the driver knows which tests finished, which one was running when the process
died, and can start a new process for the rest.

What it does NOT do: it never skips, xfails, edits or re-judges a test. Its only influence on
which tests run is *deselection*, the same thing ``--deselect`` does: node ids listed in
``$MROCM_UT_DESELECT`` (tests already recorded by an earlier process) and, where
``$MROCM_UT_EXCLUDE`` holds a regular expression, tests whose node id matches it (FP8/FP4
tests, which the selection leaves out by definition). Each deselection is recorded with its
reason. It also keeps each rank's JUnit file apart (``--junitxml`` is one path for all ranks
under torchrun): rank 0 keeps the path, rank N writes ``<path>.rankN``.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import pytest

_RANK = int(os.environ.get("RANK", "0"))
_MAX_MSG = 400


class _Log:
    """Line-buffered JSON-lines writer: each event is on disk before the next test starts."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives for the session

    def write(self, event: str, **fields: Any) -> None:
        self._f.write(json.dumps({"ev": event, "t": round(time.time(), 3), **fields}) + "\n")


_log: _Log | None = None
_reports: dict[str, dict[str, Any]] = {}
_recorded_deselect: set[str] = set()


def one_line(text: str) -> str:
    """The first non-empty line of an error text, shortened: the exception's summary."""
    for line in str(text).splitlines():
        line = line.strip()
        if line:
            return line[:_MAX_MSG]
    return ""


def _error_line(longreprtext: str) -> str:
    """A collection error's useful line: pytest's last ``E   `` line (the exception)."""
    lines = [ln[1:].strip() for ln in longreprtext.splitlines() if ln.startswith("E ")]
    return (lines[-1] if lines else one_line(longreprtext))[:_MAX_MSG]


def _message(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # skip: (path, line, "Skipped: reason")
        return one_line(str(longrepr[2]).removeprefix("Skipped: "))
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return one_line(crash.message)
    return _error_line(str(longrepr)) if longrepr else ""


def verdict(reports: dict[str, pytest.TestReport]) -> tuple[str, str]:
    """(outcome, message) of one test from its setup/call/teardown reports, as JUnit judges:
    a failed setup or teardown is an error, a failed call a failure, xfail counts as skipped."""
    setup, call, teardown = (reports.get(w) for w in ("setup", "call", "teardown"))
    outcome, msg = "passed", ""
    if setup is not None and setup.failed:
        outcome, msg = "error", _message(setup)
    elif setup is not None and setup.skipped:
        outcome, msg = "skipped", _message(setup)
    elif call is not None:
        if call.failed:
            outcome, msg = "failed", _message(call)
        elif call.skipped:
            outcome, msg = "skipped", _message(call)
        if hasattr(call, "wasxfail"):
            msg = f"xfail: {call.wasxfail}".strip() if call.skipped else msg
    if teardown is not None and teardown.failed and outcome in ("passed", "skipped"):
        outcome, msg = "error", _message(teardown)
    return outcome, msg


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    global _log
    xmlpath = getattr(config.option, "xmlpath", None)
    if xmlpath and _RANK != 0:
        config.option.xmlpath = f"{xmlpath}.rank{_RANK}"
    base = os.environ.get("MROCM_UT_PROGRESS")
    if base:
        _log = _Log(f"{base}.rank{_RANK}.jsonl")
        _log.write("begin", rank=_RANK, pid=os.getpid())


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if _log is not None and report.failed:
        _log.write("collect_error", id=report.nodeid, msg=_error_line(report.longreprtext))


def _deselect(config: pytest.Config, items: list[pytest.Item], drop: set[str], why: str) -> list:
    kept = [it for it in items if it.nodeid not in drop]
    gone = [it for it in items if it.nodeid in drop]
    if gone:
        if _log is not None and why != "recorded":
            _log.write("deselected", why=why, ids=[it.nodeid for it in gone])
        _recorded_deselect.update(it.nodeid for it in gone)
        config.hook.pytest_deselected(items=gone)
    return kept


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    exclude = os.environ.get("MROCM_UT_EXCLUDE")
    if exclude:
        pattern = re.compile(exclude, re.IGNORECASE)
        drop = {it.nodeid for it in items if pattern.search(it.nodeid)}
        items[:] = _deselect(config, items, drop, "excluded")
    listing = os.environ.get("MROCM_UT_DESELECT")
    if listing and os.path.isfile(listing):
        with open(listing, encoding="utf-8") as f:
            done = {line.rstrip("\n") for line in f if line.strip()}
        items[:] = _deselect(config, items, done, "recorded")


def pytest_deselected(items: list[pytest.Item]) -> None:
    """Deselections by others (upstream CI's ``-m`` marker filter, ``-k``)."""
    ids = [it.nodeid for it in items if it.nodeid not in _recorded_deselect]
    if _log is not None and ids:
        _log.write("deselected", why="filter", ids=ids)


def pytest_collection_finish(session: pytest.Session) -> None:
    if _log is not None:
        _log.write("collected", ids=[it.nodeid for it in session.items])


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    _reports[nodeid] = {}
    if _log is not None:
        _log.write("start", id=nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _reports.setdefault(report.nodeid, {})[report.when] = report


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    reports = _reports.pop(nodeid, {})
    if _log is not None:
        outcome, msg = verdict(reports)
        dur = sum(getattr(r, "duration", 0.0) for r in reports.values())
        _log.write("result", id=nodeid, outcome=outcome, msg=msg, dur=round(dur, 3))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Log the end, then let a rank whose tests merely failed exit 0: torchrun stops every
    other rank as soon as one exits non-zero, so a rank that finished first with a failure
    would cut off a slower rank's last tests, verdicts and all (the driver reads every
    verdict from these logs, not from exit codes). A crash, an interrupt or a usage error
    keeps its code."""
    if _log is not None:
        _log.write("end", exit=int(exitstatus))
        if exitstatus == pytest.ExitCode.TESTS_FAILED:
            session.exitstatus = pytest.ExitCode.OK
