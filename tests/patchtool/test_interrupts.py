"""Signals around a transaction: unwind before the commit point, record after it."""

from __future__ import annotations

import os
import signal

import pytest

from megatron_rocm.errors import Interrupted
from megatron_rocm.patchtool import interrupts


def test_signal_before_commit_raises_with_its_code():
    with pytest.raises(Interrupted) as e, interrupts.Guard():
        os.kill(os.getpid(), signal.SIGTERM)
    assert e.value.code == 143 and "nothing was changed" in e.value.message


def test_deferred_block_finishes_then_raises():
    done = []
    with pytest.raises(Interrupted) as e, interrupts.Guard() as guard, guard.deferred():
        os.kill(os.getpid(), signal.SIGINT)
        done.append("cleanup ran to the end")
    assert done and e.value.code == 130


def test_after_commit_signals_are_only_recorded():
    with interrupts.Guard() as guard:
        guard.commit()
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
    assert guard.pending == signal.SIGINT  # the first one is reported


def test_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with interrupts.Guard():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before


def test_step_does_nothing_unless_named(monkeypatch):
    monkeypatch.setenv(interrupts.FAULT_ENV, "other:SIGKILL")
    interrupts.step("planned")  # not this step: we are still alive
    monkeypatch.setenv(interrupts.FAULT_ENV, "planned:SIGINT")
    with pytest.raises(Interrupted), interrupts.Guard():
        interrupts.step("planned")
