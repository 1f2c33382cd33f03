"""Delayed scaling's amax all-reduces, batched: one collective for many histories.

Each delayed quantize records its tensor's amax, and every rank of upstream's amax reduction
group must fold the group's largest one into its history before that history's next quantize.
One all-reduce a quantize costs a collective per linear input and output gradient, hundreds a
micro-batch, each a point where the ranks wait for each other; TE instead reduces a whole
``fp8_autocast`` region's amaxes in one buffer. Here the running amaxes of a group's histories
live side by side in a few fp32 buffers (a history's ``current`` is a 0-d view of one slot).
Inside a :class:`Scope` (``backend.fp8.forward_region``: a forward region, or the backward of
one) a quantize only marks its buffer unreduced, and the scope's end runs one all-reduce (max)
per unreduced buffer (:meth:`AmaxReduction.flush`); a history whose amax is still unreduced
when it advances again flushes first. A max over ranks is idempotent, so reducing a buffer's
settled slots again changes nothing: the scales are bitwise those of reducing after every
quantize, and a checkpoint taken between steps holds the group's amaxes.

Every rank of a group takes the same quantizes in the same order, so the flushes fall at the
same places on each, their collectives pair up, and each history holds the same slot on every
rank (a max pairs slots by position): the first flush checks that every rank has handed out as
many slots, and raises where they differ. Outside a scope, and while a CUDA graph is being
captured (a replay runs no Python to flush), a quantize reduces at once.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

SLOTS = 1024  # amaxes a buffer holds: a few KiB, one all-reduce


@dataclass(eq=False)
class AmaxReduction:
    """One amax reduction group's running amaxes on this rank's device, and which of their
    buffers hold amaxes the group has not reduced yet."""

    group: Any
    buffers: list[torch.Tensor] = field(default_factory=list)
    used: int = SLOTS  # slots handed out from the last buffer
    unreduced: set[int] = field(default_factory=set)  # buffer indices
    flushes: int = 0  # flushes run so far: an amax deferred before the last one is reduced
    layout_checked: bool = False  # the first flush compared the slot counts of the ranks

    def slot(self, device: torch.device) -> tuple[torch.Tensor, int]:
        """A fresh zero amax slot on ``device`` (a 0-d view) and its buffer's index."""
        if self.used == SLOTS:
            self.buffers.append(torch.zeros(SLOTS, dtype=torch.float32, device=device))
            self.used = 0
        buffer = self.buffers[-1]
        if buffer.device != torch.device(device):
            raise ValueError(f"amax reduction: histories on {buffer.device} and {device}")
        self.used += 1
        return buffer[self.used - 1], len(self.buffers) - 1

    def defer(self, index: int) -> int:
        """Buffer ``index`` holds an amax the group has not reduced; returns the flush count
        that amax waits past (:meth:`settled`)."""
        self.unreduced.add(index)
        return self.flushes

    def settled(self, deferred_at: int) -> bool:
        """Whether an amax deferred at ``deferred_at`` (:meth:`defer`; -1: never) is reduced."""
        return deferred_at < self.flushes

    def flush(self) -> None:
        """All-reduce (max) every buffer holding unreduced amaxes, in buffer order (the same
        on every rank of the group)."""
        if not self.unreduced:
            return
        if not self.layout_checked:
            self._check_layout()
        for index in sorted(self.unreduced):
            torch.distributed.all_reduce(
                self.buffers[index], op=torch.distributed.ReduceOp.MAX, group=self.group
            )
        self.unreduced.clear()
        self.flushes += 1

    def _check_layout(self) -> None:
        """Every rank of the group has handed out as many slots (one all-reduce of the count
        and its negation): else the max would pair one history's amax with another's."""
        slots = len(self.buffers) * SLOTS - (SLOTS - self.used)
        counts = torch.tensor([slots, -slots], dtype=torch.float64, device=self.buffers[0].device)
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX, group=self.group)
        most, fewest = int(counts[0]), -int(counts[1])
        if most != fewest:
            raise RuntimeError(
                f"FP8 delayed scaling: the ranks of an amax reduction group hold {fewest} to "
                f"{most} amax histories; every rank must quantize the same tensors in the same order"
            )
        self.layout_checked = True


# id(group) -> its reduction, alive while a history holds it (which keeps the group, and so
# its id, alive too)
_reductions: weakref.WeakValueDictionary[int, AmaxReduction] = weakref.WeakValueDictionary()


def reduction_for(group: Any) -> AmaxReduction:
    """The process's one :class:`AmaxReduction` for ``group`` (a history keeps it alive)."""
    reduction = _reductions.get(id(group))
    if reduction is None:
        reduction = AmaxReduction(group)
        _reductions[id(group)] = reduction
    return reduction


@dataclass(eq=False)
class Scope:
    """The reductions that deferred amaxes while this scope was active, flushed together at
    its end, in the order they first deferred (the same on every rank)."""

    reductions: dict[int, AmaxReduction] = field(default_factory=dict)

    def add(self, reduction: AmaxReduction) -> None:
        self.reductions.setdefault(id(reduction), reduction)

    def flush(self) -> None:
        for reduction in self.reductions.values():
            reduction.flush()
        self.reductions.clear()


class _ActiveScopes(threading.local):
    """Each thread's scopes, the innermost last (autograd runs backwards on its own thread)."""

    def __init__(self) -> None:
        self.stack: list[Scope | None] = []


_active = _ActiveScopes()


@contextlib.contextmanager
def active(scope: Scope | None) -> Iterator[None]:
    """Quantizes inside defer their amaxes' reduction to ``scope`` (None: reduce at once)."""
    _active.stack.append(scope)
    try:
        yield
    finally:
        _active.stack.pop()


def current_scope() -> Scope | None:
    """The scope a quantize now defers to, or None."""
    return _active.stack[-1] if _active.stack else None
