"""Ulysses' first backward exchange, started from inside the output projection's backward.

The a2a attention's backward opens with an exchange: the gradient of its output goes to the
ranks that own its heads. Autograd hands that gradient over only when the output projection's
backward returns, after both of its GEMMs: the input gradient the exchange needs, and the
weight gradient nothing here needs. So the exchange ran with no compute beside it, a quarter
of the 12-13 ms of exposed copies per iteration on Llama-2-70B's heads at 16k on two GPUs
Queued beside the weight-gradient GEMM from a side
stream *after* that GEMM, the packing and the barrier waited for the GEMM's persistent blocks
to retire, and nothing overlapped.

A handoff moves the start to where the input gradient is queued:

1. the attention offers its output (``offer``), once per forward that autograd will go back
   through;
2. the projection claims it (``claim``) when that very tensor is its input, and runs on
   ``_linear_function.LinearFunction`` (``TERowParallelLinear`` without tensor parallelism);
3. its backward queues the input gradient, then ``begin``: the attention's packing and,
   through the process group, the transfers (their kernels queued ahead of the GEMM's), or on
   copy engines the barrier; then the weight-gradient GEMM; then ``post``: the copy engines'
   pulls, which need no SM and run beside the GEMM;
4. the attention's backward ``take``\\ s the exchange if the gradient it receives is that input
   gradient, unchanged; otherwise (something else consumed the output too, or changed it) it
   ``settle``\\ s the started exchange and makes its own.

Every rank of the CP group runs the same modules in the same order, so every rank takes the
same path and the exchanges stay paired. ``MEGATRON_ROCM_CP_A2A_HANDOFF=0`` turns handoffs off
(``backward`` keeps this one only, ``forward`` the forward's, ``cp.early_output``).

Measured on ``70b-slice`` CP=2 at 16k, 2 x H100 (docs/backend.md): 0.8% off each iteration through the process group (NCCL; RCCL's path on ROCm), 0.2%
on copy engines.

A started exchange that no attention takes (its backward left out of the graph autograd runs,
or another exchange of the group comes first, e.g. a forward recomputed in the backward) is
settled before the group's next exchange (``settle_open``): with copy engines, a second scatter
before the gather would pack the outbox while a peer may still pull from it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import torch

from megatron_rocm.runtime import settings
from megatron_rocm.runtime.backend.cp.early_output import land

Tensor = torch.Tensor

HANDOFF_ENV = "MEGATRON_ROCM_CP_A2A_HANDOFF"


def handoff_directions() -> frozenset[str]:
    """Which of the attention's exchanges ``MEGATRON_ROCM_CP_A2A_HANDOFF`` lets the projection
    overlap: ``backward`` (it starts the backward's first exchange, here), ``forward`` (it
    computes over the rank's own heads while the forward's last exchange lands,
    ``cp.early_output``), on both (the default) or off neither; anything else is an error."""
    return settings.get(HANDOFF_ENV)  # type: ignore[return-value]


class Exchange(Protocol):
    """An exchange queued up to its transfers (``_cp_a2a.PreparedScatter``)."""

    def post(self) -> None:
        """Queue the transfers and the rank's own part."""

    def result(self) -> Any:
        """What the attention's backward reads: buffers and what to wait for."""

    def settle(self) -> None:
        """Let the next exchange start safely although nobody reads this one."""


def same_view(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` see the same memory the same way (one tensor, or views of it
    with its shape and strides)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


class Handoff:
    """One a2a attention output and the exchange its backward starts with.

    ``begin`` (given by the attention) prepares that exchange from a gradient; the linear
    calls it, then ``post``; the attention's backward calls ``take``. ``link`` names the CP
    group's exchanges: while one is started and not taken, ``settle_open`` completes it before
    any other exchange of the group starts.
    """

    def __init__(self, begin: Callable[[Tensor], Exchange], link: Hashable) -> None:
        self._begin = begin
        self.link = link
        self._output: weakref.ref | None = None
        self._version = -1
        self._started: tuple[Tensor, int, Exchange] | None = None

    def offered_for(self, x: Tensor) -> bool:
        """Whether ``x`` is the offered output (or a view of it alike, still in the graph: not
        detached), untouched since."""
        output = self._output() if self._output is not None else None
        return (
            output is not None
            and x.requires_grad
            and same_view(x, output)
            and x._version == self._version
        )

    def begin(self, grad: Tensor) -> None:
        """Pack ``grad`` (the gradient of the output) for the exchange and queue its barrier."""
        settle_open(self.link)
        self._started = (grad, grad._version, self._begin(grad))
        _open[self.link] = self

    def post(self) -> None:
        """Queue the started exchange's transfers (after the caller's own GEMM)."""
        if self._started is not None:
            self._started[2].post()

    def take(self, grad: Tensor) -> Any | None:
        """The started exchange's result if it carries ``grad``, else None (after settling a
        started one, so the caller can exchange ``grad`` itself)."""
        started = self._forget()
        if started is None:
            return None
        sent, version, exchange = started
        if same_view(grad, sent) and grad._version == version:
            return exchange.result()
        exchange.settle()
        return None

    def _forget(self) -> tuple[Tensor, int, Exchange] | None:
        started, self._started = self._started, None
        if _open.get(self.link) is self:
            del _open[self.link]
        return started


# per CP group: the handoff whose exchange is started and not taken yet
_open: dict[Hashable, Handoff] = {}


def settle_open(link: Hashable) -> None:
    """Complete the exchange a handoff started on ``link`` that its attention never took (its
    backward was left out of the graph autograd ran, or something exchanges on the group
    first, such as a recomputed forward), so that the next exchange finds the group's
    buffers free; and land the group's early output nobody has read yet
    (``cp.early_output``). Every rank runs the same graph, so every rank settles at the same
    point."""
    land(link)
    handoff = _open.get(link)
    if handoff is not None:
        started = handoff._forget()
        if started is not None:
            started[2].settle()


_offered: Handoff | None = None


def offer(handoff: Handoff, output: Tensor) -> None:
    """Make ``output`` claimable by the next linear that takes it as its input (one at a time:
    a later offer replaces an unclaimed one)."""
    global _offered
    handoff._output = weakref.ref(output)
    handoff._version = output._version
    _offered = handoff


def claim(x: Tensor) -> Handoff | None:
    """The handoff offered for ``x``, which no other linear can claim after this, or None."""
    global _offered
    handoff = _offered
    if handoff is None or not handoff.offered_for(x):
        return None
    _offered = None
    return handoff
