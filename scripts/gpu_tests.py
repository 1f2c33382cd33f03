"""Every GPU test of the repository on this machine, in parallel pytest processes, with a
verdict that cannot pass on nothing.

    python -m scripts.gpu_tests --out DIR [--procs N] [--timeout S] [--json] [PATH ...]

The tests of ``tests/runtime`` marked ``gpu`` or ``triton`` (``--marker``) are collected once,
their files shared out over ``--procs`` processes by test count, and the processes run side by
side: Triton's compiles keep a CPU core each busy while the GPU waits, so three processes on
one GPU take about half the time of one. Every process sees every GPU (the tests that need two
GPUs still find them), its GPU list rotated so that each process's default GPU is a different
one where there are several. Each test's result is on disk as it ends
(``scripts/upstream_tests/plugin/mrocm_ut_progress.py``), so a process killed at
``--timeout`` still reports what it finished and names the test it was in. ``DIR`` holds each
process's log and progress file and ``summary.json`` (counts, problems, each process's end).

Exit: 0 every collected test has a result, none failed, and a test marked ``gpu`` passed;
1 a test failed or errored, a process was killed at ``--timeout`` or crashed, a test has no
result, or collection or counting the GPUs failed; 2 bad usage (a path, ``--out``,
``--marker``); 3 nothing ran: no GPU visible, no test collected, or no test marked ``gpu``
passed (all skipped);
130 interrupted by SIGINT, SIGTERM or SIGHUP (every pytest process is stopped first).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from scripts.upstream_tests.results import Result, read_rank_log

DEFAULT_PATHS = ("tests/runtime",)
DEFAULT_MARKER = "gpu or triton"
PLUGIN_DIR = Path(__file__).resolve().parent / "upstream_tests" / "plugin"
EXIT_PROBLEM, EXIT_USAGE, EXIT_NOTHING_RAN, EXIT_INTERRUPTED = 1, 2, 3, 130
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
COLLECT_TIMEOUT = 600.0  # seconds: an import that hangs on a GPU must not stall the run


class Usage(Exception):
    """Bad input: one line, exit 2."""


@dataclass
class Process:
    """One pytest process: its files, the GPU list it saw, and how it ended."""

    index: int
    files: list[str]
    devices: str  # its GPU list: the visible one, rotated
    returncode: int | None = None
    timed_out: bool = False
    seconds: float = 0.0
    running: str | None = None  # the test it was in when it ended without finishing


def share_out(sizes: dict[str, int], procs: int) -> list[list[str]]:
    """Files to at most ``procs`` groups, largest first onto the group with fewest tests, so
    the groups' test counts differ by at most one file's."""
    groups: list[list[str]] = [[] for _ in range(min(procs, len(sizes)))]
    load = [0] * len(groups)
    for f in sorted(sizes, key=lambda f: (-sizes[f], f)):
        i = load.index(min(load))
        groups[i].append(f)
        load[i] += sizes[f]
    return groups


def rotated(devices: list[str], index: int) -> str:
    """``devices`` starting at entry ``index`` (mod its length): the process's default GPU
    differs from its neighbour's, and it still sees every GPU."""
    k = index % len(devices)
    return ",".join(devices[k:] + devices[:k])


def visible_devices() -> tuple[str, list[str]]:
    """(the variable to rotate, its entries). A list the environment already gives is kept:
    HIP_VISIBLE_DEVICES first (ROCm's torch and HIP prefer it; its entries count within
    ROCR_VISIBLE_DEVICES's), then CUDA_VISIBLE_DEVICES. Else torch counts the GPUs, in a
    child so this process stays free of torch and of a GPU context; a count that fails is
    ``RuntimeError`` (a broken torch is no "nothing ran")."""
    for var in ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        given = os.environ.get(var)
        if given is not None:
            return var, [d.strip() for d in given.split(",") if d.strip()]
    var = "HIP_VISIBLE_DEVICES" if "ROCR_VISIBLE_DEVICES" in os.environ else "CUDA_VISIBLE_DEVICES"
    count = "import torch; print(torch.cuda.device_count())"
    try:
        done = subprocess.run([sys.executable, "-c", count], capture_output=True, text=True,
                              timeout=COLLECT_TIMEOUT)  # fmt: skip
        n = int(done.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"counting the GPUs took over {COLLECT_TIMEOUT:.0f} s") from None
    except (ValueError, IndexError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"torch could not count the GPUs: {tail}") from None
    return var, [str(i) for i in range(n)]


def _pytest_args(marker: str) -> list[str]:
    return ["-p", "no:cacheprovider", "-m", marker]


# Collection in a child (test modules import torch; this process stays light) that reports
# pytest's rootdir, the node ids, and which of them carry the ``gpu`` marker.
_COLLECT = """
import json, sys, pytest
class Report:
    found = None
    def pytest_collection_finish(self, session):
        items = session.items
        self.found = {"root": str(session.config.rootpath), "ids": [i.nodeid for i in items],
                      "gpu": [i.nodeid for i in items if i.get_closest_marker("gpu")]}
report = Report()
code = pytest.main(sys.argv[1:], plugins=[report])
print("\\n" + json.dumps(report.found))
sys.exit(code)
"""


@dataclass
class Collected:
    root: Path
    ids: list[str]
    gpu_ids: set[str]


def collect(paths: list[str], marker: str) -> Collected:
    """The selection, or ``Usage`` (pytest's usage error: a bad ``-m``) / ``RuntimeError``."""
    args = [sys.executable, "-c", _COLLECT, *_pytest_args(marker), "--collect-only", "-q"]
    try:
        done = subprocess.run([*args, *paths], capture_output=True, text=True,
                              timeout=COLLECT_TIMEOUT)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"collection did not finish in {COLLECT_TIMEOUT:.0f} s") from None
    tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-2:])
    if done.returncode == 4:  # pytest's usage error
        raise Usage(f"pytest refused the selection: {tail}")
    last = (done.stdout.strip().splitlines() or ["null"])[-1]
    found = json.loads(last) if last.startswith("{") else None
    if done.returncode not in (0, 5) or found is None:  # 5: nothing collected
        raise RuntimeError(f"collection failed: {tail}")
    return Collected(Path(found["root"]), found["ids"], set(found["gpu"]))


def _stop(popen: subprocess.Popen) -> None:
    """Kill a process's whole group (its pytest and whatever the tests started)."""
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _interrupted(signum: int, frame: object) -> None:
    """SIGTERM and SIGHUP end the run as Ctrl-C does: through ``run_all``'s cleanup."""
    raise KeyboardInterrupt


def run_all(groups: list[list[str]], devices: tuple[str, list[str]], marker: str, root: Path,
            out: Path, timeout: float) -> list[Process]:  # fmt: skip
    """Start every group's pytest at once, each in a process group of its own; kill a group
    at ``timeout``, once its pytest has ended (what its tests left running), and every group
    if this process is interrupted (``STOP_SIGNALS``, through ``_interrupted``)."""
    var, ids = devices
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGIN_DIR), env.get("PYTHONPATH")) if p)
    env.pop("RANK", None)  # the progress plugin names its file after RANK: rank0 here
    args = [sys.executable, "-m", "pytest", *_pytest_args(marker), "-p", "mrocm_ut_progress",
            f"--rootdir={root}", "-q", "-rfE"]  # fmt: skip
    procs: list[Process] = []
    running: dict[int, tuple[subprocess.Popen, float]] = {}
    try:
        for i, files in enumerate(groups):
            p = Process(i, files, rotated(ids, i))
            child = {**env, var: p.devices, "MROCM_UT_PROGRESS": str(out / f"progress-{i}")}
            with open(out / f"log-{i}.txt", "w") as log:
                popen = subprocess.Popen([*args, *files], stdout=log, stderr=subprocess.STDOUT,
                                         env=child, start_new_session=True)  # fmt: skip
            procs.append(p)
            running[i] = (popen, time.monotonic())
        while running:
            time.sleep(0.2)
            for i, (popen, started) in list(running.items()):
                alive = popen.poll() is None
                if alive and time.monotonic() - started <= timeout:
                    continue
                p = procs[i]
                p.timed_out = alive
                _stop(popen)
                p.returncode, p.seconds = popen.wait(), round(time.monotonic() - started, 1)
                del running[i]
                end = "killed at the time limit" if p.timed_out else f"exit {p.returncode}"
                print(f"process {i} ({len(p.files)} files): {end} after {p.seconds:.0f} s",
                      flush=True)  # fmt: skip
    finally:
        handlers = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}  # no half-done kill
        for popen, _ in running.values():
            _stop(popen)
        for s, handler in handlers.items():
            signal.signal(s, handler)
    return procs


def results_of(out: Path, procs: list[Process]) -> tuple[dict[str, Result], list[str]]:
    """Every test's result from the processes' progress files, and their collection errors;
    each process's unfinished test goes into its ``running``."""
    results: dict[str, Result] = {}
    broken: list[str] = []
    for p in procs:
        log = read_rank_log(out / f"progress-{p.index}.rank0.jsonl")
        results.update(log.results)
        broken += [f"{f}: {m}" for f, m in log.collect_errors.items()]
        p.running = log.running
    return results, broken


def verdict(collected: Collected, results: dict[str, Result], procs: list[Process],
            broken: list[str]) -> tuple[int, dict]:  # fmt: skip
    """(exit code, summary) of one run."""
    counts = Counter(r.outcome for r in results.values())
    unfinished = [n for n in collected.ids if n not in results]
    problems = [f"{n}: {r.message}" for n, r in sorted(results.items())
                if r.outcome in ("failed", "error")]  # fmt: skip
    problems += [f"collection: {b}" for b in broken]
    for p in procs:
        inside = f" in {p.running}" if p.running else ""
        if p.timed_out:
            problems.append(f"process {p.index} killed at the time limit{inside}")
        elif p.returncode != 0:  # the plugin turns "tests failed" into 0: this is a crash
            problems.append(f"process {p.index} exited {p.returncode}{inside}")
    if unfinished:
        problems.append(f"{len(unfinished)} collected tests have no result, first {unfinished[0]}")
    gpu_passed = sum(
        1 for n, r in results.items() if n in collected.gpu_ids and r.outcome == "passed"
    )
    summary = {
        "collected": len(collected.ids),
        "counts": {k: counts.get(k, 0) for k in ("passed", "failed", "error", "skipped")},
        "gpu_marked_passed": gpu_passed,
        "unfinished": len(unfinished),
        "problems": problems,
        "processes": [asdict(p) for p in procs],
    }
    if problems:
        return EXIT_PROBLEM, summary
    return (EXIT_NOTHING_RAN if gpu_passed == 0 else 0), summary


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(EXIT_USAGE, f"gpu_tests: {message}\n")


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m scripts.gpu_tests", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", default=list(DEFAULT_PATHS),
                    help="test files or folders (default: tests/runtime)")  # fmt: skip
    ap.add_argument("--out", type=Path, required=True, help="folder for logs, progress, summary")
    ap.add_argument("--procs", type=int, default=3, help="pytest processes at once (default 3)")
    ap.add_argument("--timeout", type=float, default=540, help="seconds each process may run")
    ap.add_argument("--marker", default=DEFAULT_MARKER, help=f"-m expression ({DEFAULT_MARKER!r})")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    return ap


def prepare(out: Path) -> None:
    """``out`` made, and this tool's files of an earlier run in it removed: an old summary or
    progress file is no result of this run."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        for old in (*out.glob("progress-*.jsonl"), *out.glob("log-*.txt"), out / "summary.json"):
            old.unlink(missing_ok=True)
        write_summary(out, {"problems": ["the run did not end"]})  # also proves out writable
    except OSError as e:
        raise Usage(f"--out {out}: {e.strerror or e}") from None


def write_summary(out: Path, summary: dict) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def run(a: argparse.Namespace) -> tuple[int, dict]:
    prepare(a.out)
    try:
        collected = collect(a.paths, a.marker)
        var, devices = visible_devices()
    except RuntimeError as e:
        return EXIT_PROBLEM, {"problems": [str(e)]}
    if not devices:
        return EXIT_NOTHING_RAN, {"problems": [], "nothing_ran": "no GPU visible"}
    if not collected.ids:
        why = f"no test matches -m {a.marker!r}"
        return EXIT_NOTHING_RAN, {"problems": [], "nothing_ran": why}
    sizes = Counter(str(collected.root / n.split("::", 1)[0]) for n in collected.ids)
    groups = share_out(sizes, a.procs)
    print(f"{len(collected.ids)} tests in {len(groups)} processes on {len(devices)} GPUs",
          flush=True)  # fmt: skip
    procs = run_all(groups, (var, devices), a.marker, collected.root, a.out, a.timeout)
    results, broken = results_of(a.out, procs)
    code, summary = verdict(collected, results, procs, broken)
    summary["gpus"] = {var: devices}
    if code == EXIT_NOTHING_RAN:
        summary["nothing_ran"] = "no test marked gpu passed (every one skipped?)"
    return code, summary


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.procs < 1 or not (math.isfinite(a.timeout) and a.timeout > 0):
        parser().error("--procs and --timeout must be positive numbers")
    missing = [p for p in a.paths if not Path(p).exists()]
    if missing:
        parser().error(f"no such test path: {missing[0]}")
    for s in STOP_SIGNALS:  # a stopped run stops its pytest processes too
        signal.signal(s, _interrupted)
    try:
        code, summary = run(a)
    except Usage as e:
        parser().error(str(e))
    except KeyboardInterrupt:
        print("gpu_tests: interrupted; every pytest process was stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    for s in STOP_SIGNALS:  # the run is over: what is left is printing
        signal.signal(s, signal.SIG_DFL)
    write_summary(a.out, summary)
    if "counts" in summary:
        c = summary["counts"]
        print(f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
              f"{c['skipped']} skipped, {summary['unfinished']} without a result")  # fmt: skip
    for line in summary["problems"]:
        print(f"  {line}")
    if code == EXIT_NOTHING_RAN:
        print(f"gpu_tests: nothing ran: {summary['nothing_ran']}", file=sys.stderr)
    if a.json:
        print(json.dumps(summary))
    return code


if __name__ == "__main__":
    sys.exit(main())
