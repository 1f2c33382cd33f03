"""Plugin of the interpreter's child pytest (``-p triton_child_report``): writes each test's
outcome to ``$TRITON_CHILD_REPORT`` as JSON, so the parent reports every child test as its own
(``triton_interpreter.outcome_from_child``) instead of one line per file."""

from __future__ import annotations

import json
import os

import pytest

_results: dict[str, dict[str, str]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    seen = _results.setdefault(report.nodeid, {"outcome": "passed", "detail": ""})
    if seen["outcome"] == "failed":
        return  # the first failure is the one to show
    if report.failed:
        seen.update(outcome="failed", detail=f"{report.when}: {report.longreprtext}")
    elif report.skipped and hasattr(report, "wasxfail"):
        seen.update(outcome="xfailed", detail=report.wasxfail)
    elif report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        seen.update(outcome="skipped", detail=reason.removeprefix("Skipped: "))
    elif report.when == "call" and hasattr(report, "wasxfail"):
        seen.update(outcome="failed", detail=f"passed but marked xfail: {report.wasxfail}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("TRITON_CHILD_REPORT")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_results, f)
