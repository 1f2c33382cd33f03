"""Every GPU test of the repository on this machine, in parallel pytest processes, with a
verdict that cannot pass on nothing.

    python -m scripts.gpu_tests --out DIR [--procs N] [--timeout S] [--json] [PATH ...]

The tests of ``tests/runtime`` marked ``gpu`` or ``triton`` (``--marker``) are collected once,
their files shared out over ``--procs`` processes by test count, and the processes run side by
side: Triton's compiles keep a CPU core each busy while the GPU waits, so three processes on
one GPU take about half the time of one. Every process sees every GPU (the tests that need two
GPUs still find them), its GPU list rotated so that each process's default GPU is a
different one where there are several. Each process writes JUnit XML and a log into ``DIR``;
``DIR/summary.json`` holds the counts, the failures and each process's end.

Exit: 0 every collected test finished and none failed, at least one passed; 1 a test failed
or errored, or a process ended before its tests did (killed at ``--timeout``, crashed), or
collection failed; 2 bad usage; 3 nothing ran: no test collected, or every one skipped (no GPU
visible, say).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from scripts.upstream_tests.results import Result, read_junit

DEFAULT_PATHS = ("tests/runtime",)
DEFAULT_MARKER = "gpu or triton"
EXIT_PROBLEM, EXIT_USAGE, EXIT_NOTHING_RAN = 1, 2, 3


@dataclass
class Process:
    """One pytest process: its files, the GPU list it saw, and how it ended."""

    index: int
    files: list[str]
    devices: str | None  # CUDA_VISIBLE_DEVICES given to it; None: the environment's own
    returncode: int | None = None
    timed_out: bool = False
    seconds: float = 0.0


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
    """``devices`` starting at entry ``index`` (mod its length), as CUDA_VISIBLE_DEVICES: the
    process's default GPU differs from its neighbour's, and it still sees every GPU."""
    k = index % len(devices)
    return ",".join(devices[k:] + devices[:k])


def visible_devices() -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES's entries where set (HIP honours
    it too), else one entry per device torch counts."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d for d in given.split(",") if d.strip()]
    try:
        import torch
    except ImportError:
        return []
    return [str(i) for i in range(torch.cuda.device_count())]


def _pytest(marker: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", marker]


# Collection in a child (test modules import torch; this process stays light) that reports
# pytest's rootdir with the node ids: ids are rootdir-relative, the runs take absolute paths.
_COLLECT = """
import json, sys, pytest
class Report:
    found = None
    def pytest_collection_finish(self, session):
        self.found = {"root": str(session.config.rootpath), "ids": [i.nodeid for i in session.items]}
report = Report()
code = pytest.main(sys.argv[1:], plugins=[report])
print("\\n" + json.dumps(report.found))
sys.exit(code)
"""


def collect(paths: list[str], marker: str) -> tuple[Path, list[str], str]:
    """(pytest's rootdir, node ids, "") or (., [], pytest's last lines) where collection failed."""
    args = [sys.executable, "-c", _COLLECT, "-p", "no:cacheprovider", "-m", marker]
    done = subprocess.run([*args, "--collect-only", "-q", *paths], capture_output=True, text=True)
    last = done.stdout.strip().splitlines()[-1:] or ["null"]
    found = json.loads(last[0]) if last[0].startswith(("{", "null")) else None
    if done.returncode not in (0, 5) or found is None:  # 5: nothing collected
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        return Path("."), [], " | ".join(tail)
    return Path(found["root"]), found["ids"], ""


def run_all(groups: list[list[str]], devices: list[str], marker: str, out: Path,
            timeout: float) -> list[Process]:  # fmt: skip
    """Start every group's pytest at once; kill a group's whole process tree at ``timeout``."""
    procs, running = [], []
    for i, files in enumerate(groups):
        p = Process(i, files, rotated(devices, i) if devices else None)
        env = dict(os.environ)
        if p.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = p.devices
        junit = out / f"junit-{i}.xml"
        junit.unlink(missing_ok=True)  # a result left by an earlier run is no result of this one
        args = [*_pytest(marker), "-q", "-rfE", "-o", "junit_family=xunit1", f"--junitxml={junit}"]
        with open(out / f"log-{i}.txt", "w") as log:
            popen = subprocess.Popen([*args, *files], stdout=log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)  # fmt: skip
        procs.append(p)
        running.append((p, popen, time.monotonic()))
    for p, popen, started in running:
        left = max(0.0, timeout - (time.monotonic() - started))
        try:
            p.returncode = popen.wait(timeout=left)
        except subprocess.TimeoutExpired:
            p.timed_out = True
            os.killpg(popen.pid, signal.SIGKILL)
            p.returncode = popen.wait()
        p.seconds = round(time.monotonic() - started, 1)
        end = "killed at the time limit" if p.timed_out else f"exit {p.returncode}"
        print(f"process {p.index} ({len(p.files)} files): {end} after {p.seconds:.0f} s",
              flush=True)  # fmt: skip
    return procs


def results_of(out: Path, procs: list[Process]) -> tuple[dict[str, Result], list[str]]:
    """Every test's result from the processes' JUnit files, and the collection errors."""
    results: dict[str, Result] = {}
    broken: list[str] = []
    for p in procs:
        junit = out / f"junit-{p.index}.xml"
        if junit.is_file():
            found, errors = read_junit(junit)
            results.update(found)
            broken += [f"{f}: {m}" for f, m in errors.items()]
    return results, broken


def verdict(collected: list[str], results: dict[str, Result], procs: list[Process],
            broken: list[str]) -> tuple[int, dict]:  # fmt: skip
    """(exit code, summary) of one run."""
    counts = Counter(r.outcome for r in results.values())
    unfinished = [n for n in collected if n not in results]
    problems = [f"{n}: {r.message}" for n, r in sorted(results.items())
                if r.outcome in ("failed", "error")]  # fmt: skip
    problems += [f"collection: {b}" for b in broken]
    problems += [f"process {p.index} killed at the time limit" for p in procs if p.timed_out]
    problems += [f"process {p.index} exited {p.returncode}" for p in procs
                 if not p.timed_out and p.returncode not in (0, 1)]  # fmt: skip
    if unfinished:
        problems.append(f"{len(unfinished)} collected tests have no result, first {unfinished[0]}")
    summary = {
        "collected": len(collected),
        "counts": {k: counts.get(k, 0) for k in ("passed", "failed", "error", "skipped")},
        "unfinished": len(unfinished),
        "problems": problems,
        "processes": [asdict(p) for p in procs],
    }
    if problems:
        return EXIT_PROBLEM, summary
    return (EXIT_NOTHING_RAN if counts.get("passed", 0) == 0 else 0), summary


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(EXIT_USAGE, f"gpu_tests: {message}\n")


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m scripts.gpu_tests", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", default=list(DEFAULT_PATHS),
                    help="test files or folders (default: tests/runtime)")  # fmt: skip
    ap.add_argument("--out", type=Path, required=True, help="folder for logs, JUnit, summary")
    ap.add_argument("--procs", type=int, default=3, help="pytest processes at once (default 3)")
    ap.add_argument("--timeout", type=float, default=540, help="seconds each process may run")
    ap.add_argument("--marker", default=DEFAULT_MARKER, help=f"-m expression ({DEFAULT_MARKER!r})")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.procs < 1 or a.timeout <= 0:
        parser().error("--procs and --timeout must be positive")
    missing = [p for p in a.paths if not Path(p).exists()]
    if missing:
        parser().error(f"no such test path: {missing[0]}")
    a.out.mkdir(parents=True, exist_ok=True)
    root, collected, why = collect(a.paths, a.marker)
    if why:
        print(f"gpu_tests: collection failed: {why}", file=sys.stderr)
        return EXIT_PROBLEM
    if not collected:
        print(f"gpu_tests: nothing ran: no test under {' '.join(a.paths)} matches -m {a.marker!r}",
              file=sys.stderr)  # fmt: skip
        return EXIT_NOTHING_RAN
    devices = visible_devices()
    sizes = Counter(str(root / n.split("::", 1)[0]) for n in collected)
    groups = share_out(sizes, a.procs)
    print(f"{len(collected)} tests in {len(groups)} processes on {len(devices)} GPUs", flush=True)
    procs = run_all(groups, devices, a.marker, a.out, a.timeout)
    results, broken = results_of(a.out, procs)
    code, summary = verdict(collected, results, procs, broken)
    summary["gpus"] = devices
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    c = summary["counts"]
    print(f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
          f"{c['skipped']} skipped, {summary['unfinished']} without a result")  # fmt: skip
    for line in summary["problems"]:
        print(f"  {line}")
    if code == EXIT_NOTHING_RAN:
        print("gpu_tests: nothing ran: every collected test skipped", file=sys.stderr)
    if a.json:
        print(json.dumps(summary))
    return code


if __name__ == "__main__":
    sys.exit(main())
