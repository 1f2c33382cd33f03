"""Signals around a transaction, and the named step boundaries fault injection hooks into.

Why: before a transaction's commit point, SIGINT, SIGTERM and SIGHUP must unwind it (every
``finally`` restores what it touched); after the commit point they must not stop it half
way. ``Guard`` raises ``Interrupted`` in the first phase and only records the signal in the
second (and while cleaning up); the caller reports it once the work is complete.

``step(name)`` marks a boundary. With ``MEGATRON_ROCM_FAULT=<step>:<action>`` set (tests
only), reaching that step sends the action to this process: ``SIGINT``, ``SIGTERM``,
``SIGHUP``, ``SIGKILL``, ``sleep=<seconds>`` (hold a race window open), or ``pause`` (create
``$MEGATRON_ROCM_FAULT_READY``, then wait up to 60 s for a signal from outside). Unset, a
step costs one dictionary lookup.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

from megatron_rocm.errors import Interrupted

FAULT_ENV = "MEGATRON_ROCM_FAULT"
READY_ENV = "MEGATRON_ROCM_FAULT_READY"  # with pause: a file created once the step is reached
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_active: Guard | None = None


@contextlib.contextmanager
def handling(
    signals: Iterable[int],
    handler: Callable[[int, FrameType | None], Any],
    replaces: Callable[[Any], bool] = lambda _current: True,
) -> Iterator[None]:
    """``handler`` for each of ``signals`` whose current handler ``replaces`` accepts, and the
    previous ones back afterwards. Main thread only, as ``signal.signal`` demands; elsewhere
    nothing is installed."""
    saved: dict[int, Any] = {}
    try:
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                if replaces(signal.getsignal(sig)):
                    saved[sig] = signal.signal(sig, handler)
        yield
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)


class Guard:
    """Install handlers for ``SIGNALS`` for the duration of a ``with`` block."""

    def __init__(self) -> None:
        self.pending: int | None = None  # first signal received while deferring
        self._defer = 0
        self._committed = False
        self._handlers = contextlib.ExitStack()

    def _handler(self, signum: int, _frame: FrameType | None) -> None:
        if self._defer or self._committed:
            if self.pending is None:
                self.pending = signum
            return
        raise Interrupted(signum, "interrupted; nothing was changed")

    def __enter__(self) -> Guard:
        global _active
        self._handlers.enter_context(handling(SIGNALS, self._handler))
        _active = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        self._handlers.close()
        _active = None

    @contextlib.contextmanager
    def deferred(self, message: str = "interrupted; nothing was changed") -> Iterator[None]:
        """Record signals instead of raising (cleanup, atomic writes); raise afterwards if one
        came and the commit point was not passed, unless an exception is already unwinding."""
        self._defer += 1
        ok = False
        try:
            yield
            ok = True
        finally:
            self._defer -= 1
        if ok and not self._defer and not self._committed and self.pending is not None:
            raise Interrupted(self.pending, message)

    def commit(self) -> None:
        """The commit point: from here on the transaction finishes whatever arrives."""
        self._committed = True

    @property
    def committed(self) -> bool:
        return self._committed


def step(name: str) -> None:
    """A transaction step boundary (see the module docstring)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    at, _, action = spec.partition(":")
    if at != name:
        return
    if action.startswith("sleep="):  # widen a race window (concurrency tests)
        time.sleep(float(action.removeprefix("sleep=")))
        return
    if action == "pause":
        ready = os.environ.get(READY_ENV)
        if ready:
            with open(ready, "w") as f:
                f.write(name)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (_active and _active.pending):
            time.sleep(0.02)
        return
    os.kill(os.getpid(), getattr(signal, action))
