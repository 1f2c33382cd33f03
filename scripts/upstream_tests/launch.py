"""Starting one pytest process group of upstream's unit tests and watching it.

Upstream's CI launches its buckets as ``torchrun --nproc-per-node N -m pytest ...`` inside the
tree; so does this, with the tree, this repository (the patched tree imports
``megatron_rocm``) and the progress plugin on ``PYTHONPATH``. The environment adds only what
upstream's CI sets (``NCCL_MAX_NCHANNELS=1``, ``ONE_LOGGER_JOB_CATEGORY=test``) and what the
lent GPU boxes require (NVLink multicast off); upstream's conftest handles its ``NVTE_*``.

A hang is caught twice: pytest-timeout's thread method (where installed) dumps the stacks and
ends the rank at ``timeout``; if no event reaches the progress logs for ``timeout + 60`` s the
whole process group is killed here. Either way the progress logs keep what finished.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

GRACE_S = 60.0
STARTUP_S = 300.0
_PORT_LOCK = threading.Lock()
_PORTS: set[int] = set()


@dataclass
class Settings:
    python: str
    nproc: int
    timeout: float
    deadline: float  # time.monotonic() after which nothing runs
    repo: Path
    plugin_dir: Path
    markexpr: str | None
    exclude: str | None
    has_timeout_plugin: bool
    pytest_extra: list[str] = field(default_factory=list)
    grace: float = GRACE_S  # watchdog: silence allowed beyond ``timeout``


@dataclass
class Ended:
    rc: int | None
    killed: str | None  # "budget" | "hang" | None
    seconds: float


def child_env(tree: Path, s: Settings, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(tree), str(s.plugin_dir), str(s.repo)]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["PYTHONUNBUFFERED"] = "1"
    env["ONE_LOGGER_JOB_CATEGORY"] = "test"
    env.setdefault("NCCL_MAX_NCHANNELS", "1")
    # the lent boxes ask for these (multicast can take the host's GPUs down); harmless elsewhere
    env["NCCL_NVLS_ENABLE"] = "0"
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    if s.exclude:
        env["MROCM_UT_EXCLUDE"] = s.exclude
    env.update(extra)
    return env


def pytest_args(s: Settings, junit: Path | None) -> list[str]:
    """Upstream's own pytest configuration (its addopts stay), plus: keep going after a failure
    or a module that does not import (0.16's addopts has ``-x``), and the per-test timeout."""
    args = ["-p", "mrocm_ut_progress", "-p", "no:cacheprovider"]
    args += ["--continue-on-collection-errors", "--maxfail=0"]
    if s.markexpr:
        args += ["-m", s.markexpr]
    if junit is not None:
        args += [f"--junitxml={junit}", "-o", "junit_family=xunit1"]
    if s.has_timeout_plugin:
        args += [f"--timeout={int(s.timeout)}", "-o", "timeout_method=thread"]
    else:
        args += ["-o", f"faulthandler_timeout={int(s.timeout)}"]
    return args + s.pytest_extra


def free_port() -> int:
    with _PORT_LOCK:
        while True:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            if port not in _PORTS:
                _PORTS.add(port)
                return port


def torchrun(s: Settings) -> list[str]:
    return [
        s.python, "-m", "torch.distributed.run", f"--nproc-per-node={s.nproc}", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "pytest",
    ]  # fmt: skip


def _stop(proc: subprocess.Popen) -> None:
    """End the process group this module started (torchrun and its ranks), TERM then KILL."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_event(progress_base: Path, nproc: int) -> float | None:
    stamps = []
    for r in range(nproc):
        try:
            stamps.append(Path(f"{progress_base}.rank{r}.jsonl").stat().st_mtime)
        except FileNotFoundError:
            pass
    return max(stamps) if stamps else None


def run_watched(
    cmd: list[str], cwd: Path, env: dict[str, str], log: Path, s: Settings, progress_base: Path
) -> Ended:
    """Run ``cmd`` in its own process group, output to ``log``; kill it at the deadline or
    when its progress logs stay silent for longer than a test may take."""
    start, t0 = time.time(), time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        killed = None
        while proc.poll() is None:
            time.sleep(1.0)
            if time.monotonic() > s.deadline:
                killed = "budget"
            else:
                last = _last_event(progress_base, s.nproc)
                # before pytest's first event: interpreter and torch start-up, given STARTUP_S
                silent = time.time() - (last or start)
                if silent > (s.timeout + s.grace if last else max(STARTUP_S, s.timeout)):
                    killed = "hang"
            if killed:
                _stop(proc)
                break
    return Ended(proc.returncode, killed, time.monotonic() - t0)


_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)(?:.*\((SIG\w+)\))?")
_ERROR = re.compile(r"^\s*(?:E\s+)?([\w.]*(?:Error|Exception)\b:?.*|.*\bNCCL (?:error|WARN).*)$")
_TORCHRUN = ("ChildFailedError", "] failed (exitcode:", "torch.distributed.elastic")


def _root_cause(lines: list[str]) -> str:
    """torchrun's "Root Cause (first observed failure)": the exit code or signal of the rank
    that died first (the others are usually its SIGTERM)."""
    for i, line in enumerate(lines):
        if "Root Cause (first observed failure)" in line:
            for follow in lines[i + 1 : i + 10]:
                m = _EXITCODE.search(follow)
                if m:
                    return m.group(2) and f"signal {m.group(2)}" or f"exit {m.group(1)}"
    return ""


def death_note(log: Path, ended: Ended, max_lines: int = 600) -> str:
    """One line on why a process died, from the end of its log: pytest-timeout's banner, else
    the first failed rank's exit code or signal and the last exception line the ranks printed
    before torchrun's own report."""
    if ended.killed == "budget":
        return "not finished: wall-clock budget ran out"
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()[-max_lines:]
    except FileNotFoundError:
        lines = []
    if ended.killed == "hang" or any("+ Timeout +" in ln for ln in lines):
        return "timeout: the test ran longer than the per-test limit; process killed"
    cut = next((i for i, ln in enumerate(lines) if any(m in ln for m in _TORCHRUN)), len(lines))
    err = next((m.group(1).strip() for ln in reversed(lines[:cut]) if (m := _ERROR.match(ln))), "")
    how = _root_cause(lines[cut:]) or f"exit {ended.rc}"
    return f"process died ({how}) during this test" + (f": {err[:300]}" if err else "")


def trim_log(log: Path, keep_head: int = 200_000, keep_tail: int = 800_000) -> None:
    """Keep big logs small enough to bring back: head (collection) and tail (the end)."""
    size = log.stat().st_size if log.is_file() else 0
    if size <= keep_head + keep_tail:
        return
    data = log.read_bytes()
    cut = f"\n[... {size - keep_head - keep_tail} bytes cut by upstream_unit_tests ...]\n".encode()
    log.write_bytes(data[:keep_head] + cut + data[-keep_tail:])
