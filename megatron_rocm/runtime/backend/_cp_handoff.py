"""Ulysses' first backward exchange, started from inside the output projection's backward.

The a2a attention's backward opens with an exchange: the gradient of its output goes to the
ranks that own its heads. Autograd hands that gradient over only when the output projection's
backward returns, after both of its GEMMs: the input gradient the exchange needs, and the
weight gradient nothing here needs. So the exchange ran with no compute beside it, a quarter
of the 12-13 ms of exposed copies per iteration on Llama-2-70B's heads at 16k on two GPUs
(docs/results.md, seventeenth session). Queued beside the weight-gradient GEMM from a side
stream *after* that GEMM, the packing and the barrier waited for the GEMM's persistent blocks
to retire, and nothing overlapped (the same session, reverted).

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
same path and the exchanges stay paired. ``MEGATRON_ROCM_CP_A2A_HANDOFF=0`` turns handoffs off.

Measured on ``70b-slice`` CP=2 at 16k, 2 x H100 (docs/results.md, nineteenth session): 0.8% off
each iteration through the process group (NCCL; RCCL's path on ROCm), 0.1% on copy engines,
whose pulls were mostly short already.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

Tensor = torch.Tensor

HANDOFF_ENV = "MEGATRON_ROCM_CP_A2A_HANDOFF"


def handoffs_enabled() -> bool:
    """Whether ``MEGATRON_ROCM_CP_A2A_HANDOFF`` lets the projection start the exchange (``1``,
    the default) or not (``0``); anything else is an error."""
    text = os.environ.get(HANDOFF_ENV, "").strip() or "1"
    if text not in ("0", "1"):
        raise ValueError(f"{HANDOFF_ENV}={text!r} is not 0 or 1")
    return text == "1"


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
    calls it, then ``post``; the attention's backward calls ``take``.
    """

    def __init__(self, begin: Callable[[Tensor], Exchange]) -> None:
        self._begin = begin
        self._output: weakref.ref | None = None
        self._version = -1
        self._started: tuple[Tensor, int, Exchange] | None = None

    def offered_for(self, x: Tensor) -> bool:
        """Whether ``x`` is the offered output (or a view of it alike), untouched since."""
        output = self._output() if self._output is not None else None
        return output is not None and same_view(x, output) and x._version == self._version

    def begin(self, grad: Tensor) -> None:
        """Pack ``grad`` (the gradient of the output) for the exchange and queue its barrier."""
        self._started = (grad, grad._version, self._begin(grad))

    def post(self) -> None:
        """Queue the started exchange's transfers (after the caller's own GEMM)."""
        if self._started is not None:
            self._started[2].post()

    def take(self, grad: Tensor) -> Any | None:
        """The started exchange's result if it carries ``grad``, else None (after settling a
        started one, so the caller can exchange ``grad`` itself)."""
        started, self._started = self._started, None
        if started is None:
            return None
        sent, version, exchange = started
        if same_view(grad, sent) and grad._version == version:
            return exchange.result()
        exchange.settle()
        return None


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
