"""Weight initialisation under Megatron's CUDA RNG tracker, the way TE does it.

Megatron's TE wrappers give TE ``get_rng_state_tracker=get_cuda_rng_tracker`` only once the
tracker is seeded (``model_parallel_cuda_manual_seed``); before that, TE initialises its weights
with torch's default generator. Megatron's local linears, which the native TE classes are, always
initialise under ``get_cuda_rng_tracker().fork()``, and an unseeded tracker raises ``cuda rng
state model-parallel-rng is not added``. Code that builds TE modules without seeding the tracker
(upstream's MIMO tests build their projector so) works with TE and must work here too.
Training seeds the tracker first, so there nothing changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def _tracker() -> Any:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def _seeded(tracker: Any) -> bool:
    is_initialized = getattr(tracker, "is_initialized", None)
    return is_initialized is None or bool(is_initialized())  # unknown trackers: leave alone


def tracker_fork(name: str | None = None) -> contextlib.AbstractContextManager:
    """The tracker fork TE initialises under (``name``: the expert tracker for experts), or
    nothing when the tracker is not seeded."""
    tracker = _tracker()
    if not _seeded(tracker):
        return contextlib.nullcontext()
    return tracker.fork(name) if name else tracker.fork()


def _no_fork(*_: Any, **__: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


@contextlib.contextmanager
def te_style_init() -> Iterator[None]:
    """While a local linear builds its weights: an unseeded tracker's ``fork`` does nothing, so
    they come from the default generator, as with TE. A seeded tracker is left as it is."""
    tracker = _tracker()
    if _seeded(tracker):
        yield
        return
    missing = object()
    shadowed = vars(tracker).get("fork", missing)
    tracker.fork = _no_fork  # an instance attribute shadows the method until we leave
    try:
        yield
    finally:
        if shadowed is missing:
            del tracker.fork
        else:
            tracker.fork = shadowed
