"""The check registry and the loop that runs checks: pass / fail / skip, each timed.

A check is a function ``(ctx) -> str`` returning a one-line detail on success. It raises
:class:`Skip` when it cannot run here (no GPU, no tree) and anything else to fail; a skip always
carries its reason, so a missing GPU is never reported as a pass.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_rocm.errors import UsageError

PASS, FAIL, SKIP = "pass", "fail", "skip"
FAULT_ENV = "MEGATRON_ROCM_SMOKE_FAULT"  # tests: see its choices in runtime.settings, docs/smoke.md


class Skip(Exception):
    """The check cannot run in this environment; the message says why."""


class CheckFailed(AssertionError):
    """A check ran and the result is wrong; the message says what differs."""


@dataclass
class Context:
    """What every check may look at. ``device`` is 'cuda' (CUDA or ROCm) or 'cpu'."""

    tree: Path | None
    device: str
    gpu_count: int
    steps: int = 30
    fault: str | None = None
    log: Callable[[str], None] = lambda line: print(line, flush=True)
    # Shared by checks that run together: the names selected for this run (a multi-GPU world
    # starts once for all of them), results already computed (a 1-GPU run is the reference of
    # the parallel ones), and a scratch folder removed when the run ends.
    selected: list[str] = field(default_factory=list)
    cache: dict[Any, Any] = field(default_factory=dict)
    _workdir: str | None = None

    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            self._workdir = tempfile.mkdtemp(prefix="megatron-rocm-smoke-")
        return Path(self._workdir)

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    def needs_gpu(self, n: int = 1, what: str = "this check") -> None:
        if self.gpu_count < n:
            have = "no GPU" if self.gpu_count == 0 else f"only {self.gpu_count} GPU"
            have += "s" if self.gpu_count > 1 else ""
            raise Skip(f"{what} needs {n} GPU{'s' if n > 1 else ''}; {have} visible")

    def needs_tree(self) -> Path:
        if self.tree is None:
            raise Skip("no Megatron-LM tree given")
        return self.tree


@dataclass
class Check:
    name: str  # group.item, e.g. kernels.softmax
    func: Callable[[Context], str]
    doc: str = ""

    @property
    def group(self) -> str:
        return self.name.split(".", 1)[0]


@dataclass
class CheckResult:
    name: str
    status: str
    seconds: float
    detail: str = ""


@dataclass
class Report:
    device: str
    torch: str
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status == FAIL]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


REGISTRY: dict[str, Check] = {}


def register(name: str) -> Callable[[Callable[[Context], str]], Callable[[Context], str]]:
    def deco(func: Callable[[Context], str]) -> Callable[[Context], str]:
        REGISTRY[name] = Check(name, func, (func.__doc__ or "").strip().split("\n")[0])
        return func

    return deco


def select(checks: dict[str, Check], only: Sequence[str] | None) -> list[Check]:
    """``--only`` takes check names or prefixes: ``kernels``, ``kernels.softmax``, ``training``."""
    if not only:
        return list(checks.values())
    chosen: list[Check] = []
    for pattern in only:
        hits = [c for n, c in checks.items() if n == pattern or n.startswith(pattern + ".")]
        if not hits and Path(pattern).is_dir():  # `smoke --only kernels TREE`
            raise UsageError(
                f"no smoke check matches {pattern!r}, a folder: --only takes every word after "
                f"it, so give the tree first (megatron-rocm smoke {pattern} --only ...)"
            )
        if not hits:
            raise UsageError(f"no smoke check matches {pattern!r}; checks: {', '.join(checks)}")
        chosen += [c for c in hits if c not in chosen]
    return [c for c in checks.values() if c in chosen]  # keep suite order


def fault() -> str | None:
    return os.environ.get(FAULT_ENV) or None


def _one_line(exc: BaseException) -> str:
    """The error and the innermost frame, enough to locate a failure without a traceback dump."""
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    msg = str(exc).strip().replace("\n", " | ")
    prefix = "" if isinstance(exc, CheckFailed) else f"{type(exc).__name__}: "
    return f"{prefix}{msg}{where}"


def run_checks(ctx: Context, checks: Sequence[Check]) -> list[CheckResult]:
    ctx.selected = [c.name for c in checks]
    try:
        return _run(ctx, checks)
    finally:
        if ctx._workdir is not None:
            shutil.rmtree(ctx._workdir, ignore_errors=True)
            ctx._workdir = None


def _run(ctx: Context, checks: Sequence[Check]) -> list[CheckResult]:
    results = []
    width = max((len(c.name) for c in checks), default=10)
    count = len(str(len(checks)))
    for i, check in enumerate(checks, 1):
        start = time.perf_counter()
        try:
            detail, status = check.func(ctx), PASS
        except Skip as e:
            detail, status = str(e), SKIP
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - any failure of a check is its result
            detail, status = _one_line(e), FAIL
        seconds = round(time.perf_counter() - start, 3)
        results.append(CheckResult(check.name, status, seconds, detail))
        ctx.log(
            f"[{i:>{count}}/{len(checks)}] {check.name:<{width}}  {status.upper():<4}  "
            f"{seconds:7.2f}s  {detail}"
        )
    return results


def make_context(tree: Path | None, steps: int) -> Context:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if tree is not None and str(tree) not in sys.path:
        sys.path.insert(0, str(tree))
    return Context(
        tree=tree, device="cuda" if gpus else "cpu", gpu_count=gpus, steps=steps, fault=fault()
    )
