"""Reading upstream unit-test results: the per-rank progress logs that mrocm_ut_progress writes,
and pytest JUnit XML (rank 0) for runs made by hand. Both become one ``{node id: Result}`` map.

A test's outcome is one of ``OUTCOMES``. Two of them are ours, not pytest's:
- ``needs_gpus``: it failed or skipped only because it asks for more ranks than the run had
  (upstream's ``initialize_model_parallel`` raises "world_size (2) is not divisible by 4"; some
  tests skip with "requires world_size=8"). Such tests are outside the selection
  ("needs <= N GPUs"), so they are reported apart, never as failures or passes.
- ``not_run``: collected but never finished: the wall-clock budget ran out first.
A test that was running when its process died is an ``error`` whose message says so.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "skipped", "needs_gpus", "not_run")
_BAD = ("failed", "error")

# Messages that mean "this test wants more ranks than there were", with the rank count asked.
_NEEDS = (
    re.compile(r"world_size \((\d+)\) is not divisible by (?:[\w ]+\()?(\d+)"),
    re.compile(r"requires? (?:a )?world[_ ]size\s*(?:=|==|of|>=)?\s*(\d+)", re.I),
    re.compile(
        r"(?:at least|>=|minimum of)\s*(\d+)\s*(?:gpus|devices|ranks|distributed ranks)", re.I
    ),
    re.compile(r"(?:needs|requires)\s*(\d+)\s*(?:or more\s*)?(?:gpus|devices|ranks)", re.I),
)


@dataclass
class Result:
    outcome: str
    message: str = ""
    duration: float = 0.0

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in ("", 0.0)}


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def gpus_needed(message: str, nproc: int) -> int | None:
    """The rank count a failure/skip message asks for, when it is more than ``nproc``."""
    for pattern in _NEEDS:
        m = pattern.search(message)
        if m:
            asked = int(m.groups()[-1])
            if pattern is _NEEDS[0]:
                asked = max(asked, int(m.group(1)) + 1)
            return asked if asked > nproc else None
    return None


def classify(result: Result, nproc: int) -> Result:
    if result.outcome in ("failed", "error", "skipped") and gpus_needed(result.message, nproc):
        return Result("needs_gpus", result.message, result.duration)
    return result


# --- progress logs (the driver's source) ---------------------------------------------------


@dataclass
class RankLog:
    """What one rank's progress file says about one process."""

    collected: list[str] | None
    results: dict[str, Result]
    running: str | None  # started, never finished: the test the process died in
    running_since: float | None
    collect_errors: dict[str, str]
    deselected: dict[str, str]  # node id -> why
    ended: bool
    last_event: float


def read_rank_log(path: Path) -> RankLog:
    log = RankLog(None, {}, None, None, {}, {}, False, 0.0)
    if not path.is_file():
        return log
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        log.last_event = max(log.last_event, ev.get("t", 0.0))
        kind = ev.get("ev")
        if kind == "collected":
            log.collected = ev["ids"]
        elif kind == "collect_error":
            log.collect_errors[ev["id"]] = ev.get("msg", "")
        elif kind == "deselected":
            log.deselected.update(dict.fromkeys(ev["ids"], ev.get("why", "filter")))
        elif kind == "start":
            log.running, log.running_since = ev["id"], ev.get("t")
        elif kind == "result":
            log.results[ev["id"]] = Result(ev["outcome"], ev.get("msg", ""), ev.get("dur", 0.0))
            if log.running == ev["id"]:
                log.running = None
        elif kind == "end":
            log.ended = True
    return log


def merge_ranks(logs: list[RankLog]) -> dict[str, Result]:
    """Rank 0's verdicts, except that a failure on any other rank fails the test there too
    (torchrun's exit code says the same): a test is only as good as its worst rank."""
    merged = dict(logs[0].results) if logs else {}
    for rank, log in enumerate(logs[1:], start=1):
        for nodeid, res in log.results.items():
            mine = merged.get(nodeid)
            if res.outcome in _BAD and (mine is None or mine.outcome not in _BAD):
                merged[nodeid] = Result(res.outcome, f"[rank {rank}] {res.message}", res.duration)
    return merged


# --- JUnit XML (runs made by hand, or upstream CI's) ------------------------------------------


def _junit_nodeid(case: ET.Element) -> str:
    """pytest's node id from a <testcase>: ``file`` (xunit1) or the dotted classname."""
    classname, name = case.get("classname", ""), case.get("name", "")
    path = case.get("file")
    parts = classname.split(".")
    if path:
        module = path[:-3].replace("/", ".") if path.endswith(".py") else path
        rest = classname[len(module) :].lstrip(".") if classname.startswith(module) else ""
    else:
        # xunit2 has no file: take the longest prefix that names a test module (test_*)
        cut = max((i for i, p in enumerate(parts) if p.startswith("test_")), default=len(parts) - 1)
        path = "/".join(parts[: cut + 1]) + ".py"
        rest = ".".join(parts[cut + 1 :])
    return "::".join(p for p in (path, *rest.split("."), name) if p) if classname else name


def read_junit(path: Path) -> tuple[dict[str, Result], dict[str, str]]:
    """(results, collection errors by file) from one pytest JUnit XML file."""
    results: dict[str, Result] = {}
    collect_errors: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("error", "failure", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = first_line(node.get("message") or node.text or "")
                break
        if not case.get("classname") and outcome == "error":  # a module that did not import
            name = case.get("name", "")
            target = name if name.endswith(".py") else name.replace(".", "/") + ".py"
            collect_errors[target] = message
            continue
        if outcome == "skipped":
            message = message.removeprefix("Skipped: ")
        results[_junit_nodeid(case)] = Result(outcome, message, float(case.get("time", 0) or 0))
    return results, collect_errors


def first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:400]
    return ""
