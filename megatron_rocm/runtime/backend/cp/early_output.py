"""The a2a attention's output, handed on before the peers' heads have landed in it.

Ulysses' forward ends with an exchange: each rank sends the output of its heads for the
peers' tokens, and receives its own tokens' output of the peers' heads. Its consumer, the
output projection, needs those heads only for half of its GEMM: ``y = x W^T`` splits along
the heads into ``x[:, own] W[:, own]^T``, which can run while the peers' heads travel, plus
``x[:, peers] W[:, peers]^T`` after they land. Otherwise the exchange (a quarter of a2a's
copies) and a slower peer's lag at its barrier are time no compute hides: overlapped, 0.35% of
each iteration of Llama-2-70B's heads at 16k on two H100s with copy engines, 0.16% through the
process group (docs/backend.md, the a2a switches).

So the attention returns its output as an ``EarlyOutput`` (a view of it) before the exchange
has finished, with the ``Landing`` that finishes it recorded per CP group:

* the projection (``TERowParallelLinear`` at one TP rank, ``_linear_function``) ``take``\\ s the
  landing when that very view is its input, runs the GEMM over the rank's own heads, then
  lands the rest, then adds the GEMM over the peers' heads;
* anything else that reads the view first through a torch function or method
  (``__torch_function__``: upstream's output gate, offload hooks and THD reshape, a custom
  autograd Function's forward computing on it) lands it before it runs, on the plain output,
  so a reader that is not the projection sees the whole output, only without the overlap;
* before the group's next exchange, a landing nobody took or triggered is finished
  (``land``), so the exchanges stay paired and the buffers are free again.

What a torch function does not see, it cannot guard: memory handed to a kernel as is (a C++
extension called on the view, DLPack, ``as_subclass``). Nothing between upstream's attention
and its projection does that (main, core_v0.12.0 and core_v0.16.0 read). Under
``torch.compile`` the attention finishes the exchange itself.

The landing writes into the output through an alias with a version counter of its own
(``untracked``): the values are those the attention computed, not a change autograd should
see, and the view keeps its plain alias node, through which the gradient reaches the
attention as the very tensor the projection's backward computed (``cp.handoff`` checks).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

Tensor = torch.Tensor


class Landing:
    """The rest of an a2a output's exchange: ``ready`` are the last-dim columns already in
    place (the rank's own heads), ``finish`` waits for the peers' heads and unpacks them, on
    the stream the attention ran on (then the caller's stream waits for it)."""

    def __init__(
        self, output: Tensor, ready: slice, finish: Callable[[], None], link: Hashable
    ) -> None:
        self.output, self.ready, self.link = output, ready, link
        self._finish: Callable[[], None] | None = finish
        self._stream = torch.cuda.current_stream(output.device) if output.is_cuda else None

    def arriving(self) -> list[slice]:
        """The last-dim columns the peers' heads land in (before and after ``ready``)."""
        width = self.output.shape[-1]
        start, stop, _ = self.ready.indices(width)
        return [cols for cols in (slice(0, start), slice(stop, width)) if cols.start < cols.stop]

    def finish(self) -> None:
        """Queue the wait for the peers' heads and their unpacking into the output. Once."""
        finish, self._finish = self._finish, None
        if _landings.get(self.link) is self:
            del _landings[self.link]
        if finish is None:
            return
        with torch.no_grad():
            stream = self._stream
            if stream is None or stream == torch.cuda.current_stream(self.output.device):
                finish()
                return
            with torch.cuda.stream(stream):  # where the attention and its buffers live
                finish()
            torch.cuda.current_stream(self.output.device).wait_stream(stream)


# per CP group: the a2a output whose exchange has not landed yet
_landings: dict[Hashable, Landing] = {}


def untracked(x: Tensor) -> Tensor:
    """``x``'s memory, same layout, seen by a tensor whose writes do not move ``x``'s version
    counter (an output's own exchange filling it in, not a change)."""
    alias = torch.empty(0, dtype=x.dtype, device=x.device)
    return alias.set_(x.untyped_storage(), x.storage_offset(), x.shape, x.stride())


class EarlyOutput(torch.Tensor):
    """A view of an a2a output whose peers' heads may still be on their way: a torch function
    given it lands them first, then runs on the plain output (so other tensor subclasses and
    torch functions in the call behave as usual)."""

    _early_landing: Landing

    @classmethod
    def __torch_function__(  # noqa: ANN206 - torch's protocol
        cls,
        func: Any,
        types: Any,
        args: tuple = (),
        kwargs: dict | None = None,
    ):
        def plain(view: EarlyOutput) -> Tensor:
            landing = view._early_landing
            landing.finish()
            return landing.output

        args, kwargs = tree_map_only(EarlyOutput, plain, (args, kwargs or {}))
        return func(*args, **kwargs)


def hand_on_early(
    output: Tensor, ready: slice, finish: Callable[[], None], link: Hashable
) -> Tensor:
    """``output`` as an ``EarlyOutput`` whose ``ready`` columns are in place and whose others
    ``finish`` queues; recorded for ``link`` (the CP group) until taken or landed."""
    land(link)
    landing = Landing(output, ready, finish, link)
    view = output.as_subclass(EarlyOutput)
    view._early_landing = landing
    _landings[link] = landing
    return view


def take(x: Tensor) -> Landing | None:
    """The landing of ``x`` if ``x`` is an early output not landed yet (its type checked, which
    runs no torch function), for the caller to finish; None otherwise."""
    if type(x) is not EarlyOutput:
        return None
    landing = x._early_landing
    if _landings.get(landing.link) is not landing:
        return None
    del _landings[landing.link]
    return landing


def land(link: Hashable) -> None:
    """Finish ``link``'s early output, if one is still open: before the group's next exchange."""
    landing = _landings.get(link)
    if landing is not None:
        landing.finish()
