"""Delayed scaling's amax histories in checkpoints: the native FP8 linears' ``_extra_state``.

TE keeps a module's FP8 scaling state (scales, amax histories) in ``_extra_state``, which
upstream checkpoints as an object replicated over tensor- and data-parallel ranks (rank 0 of
each writes it; every rank loads it). The native linears do the same under
``--fp8-recipe delayed``, so a resumed run scales its next quantizes as the uninterrupted run
would. Current scaling has no state to keep.

The value is a uint8 tensor: a pickled ``None``, then this module's payload. TE reads
``_extra_state`` with ``pickle.loads``, which ignores bytes after the object, so TE loads
such a checkpoint as one without FP8 state and starts its histories. TE's own payload holds
pickled TE objects; it is not read here, and the histories start again, as TE starts them
from a checkpoint taken without FP8.

Every rank that holds a whole weight has the same weight history, and a weight split over TP
ranks reduces its amax over upstream's amax reduction group; the input and gradient histories
are the same on every rank of that group (their amaxes are all-reduced before a history
advances and at the ends of the forward and backward regions, ``kernels.fp8_amax_reduction``).
Rank 0's are then every rank's, except under ``--tp-only-amax-red`` with more than
one data-parallel rank, where each rank keeps its own and a resume gives every rank rank 0's
(as with TE, which saves its state the same way).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from megatron_rocm.runtime.kernels.fp8 import AmaxHistory

_NOTHING_FOR_TE = pickle.dumps(None, protocol=2)
# upstream's --ckpt-drop-redundant-extra-state keeps an ``_extra_state`` whose bytes name
# ``amax_history_fwd`` (TE's delayed-scaling key) and drops the others unsaved
_MAGIC = b"megatron-rocm fp8 delayed scaling (amax_history_fwd) v1\n"
_PREFIX = _NOTHING_FOR_TE + _MAGIC
_TENSORS = ("input", "weight", "grad_output")


def extra_state(linear: Any, no_fp8: Any) -> Any:
    """``linear``'s ``_extra_state``: under delayed scaling its histories (those started;
    none before the first quantize), else ``no_fp8`` (what the module saves without FP8
    state). A fresh model's value has the payload too: upstream's
    ``--ckpt-drop-redundant-extra-state`` decides from the loading model's values which
    entries to read from a checkpoint."""
    recipe = getattr(linear, "fp8_recipe", None)
    if recipe is None or recipe.delayed is None:
        return no_fp8
    histories = {}
    for name in _TENSORS:
        history = recipe.history(name)
        if history.started:
            histories[name] = _snapshot(history)
    buffer = io.BytesIO()
    torch.save({"histories": histories}, buffer)
    return torch.frombuffer(bytearray(_PREFIX + buffer.getvalue()), dtype=torch.uint8)


def load_extra_state(linear: Any, state: Any) -> None:
    """Restore the histories a checkpoint's ``_extra_state`` holds into ``linear``'s delayed
    recipe. Anything else (no FP8 state, TE's, a run that now trains without delayed
    scaling) leaves the linear's histories as they are (a fresh model's start at its first
    quantize)."""
    payload = _payload(state)
    recipe = getattr(linear, "fp8_recipe", None)
    if payload is None or recipe is None or recipe.delayed is None:
        return
    device = linear.weight.device
    for name, saved in payload["histories"].items():
        _restore(recipe.history(name), saved, device)


def recast_loaded_weight(linear: Any, state_dict: dict, prefix: str) -> None:
    """After a load whose ``_extra_state`` gave an FP8 weight (``--fp8-param-gather``) its
    history back: the weight's bytes cast again from the loaded weight with the history's
    scale. The checkpoint holds the weight dequantized; loading it quantized it by its own
    amax before the history arrived, where the saved bytes were cast with the history's
    scale. FP8 -> bf16 -> FP8 at one scale gives the same bytes back."""
    state = getattr(linear.weight, "_fp8", None)
    source = state_dict.get(prefix + "weight")
    if state is None or state.history is None or not isinstance(source, torch.Tensor):
        return
    if tuple(source.shape) != tuple(linear.weight.shape):
        return  # torch reports the size mismatch
    payload = _payload(state_dict.get(prefix + "_extra_state"))
    if payload is not None and "weight" in payload["histories"]:
        state.cast_with_history(source)


def _snapshot(history: AmaxHistory) -> dict[str, torch.Tensor]:
    """The history's tensors on the CPU (a checkpoint is written from the host)."""
    return {
        "history": history.history.detach().cpu(),
        "current": history.current.detach().cpu().clone(),  # a slot's own bytes, not its buffer
        "pos": history.pos.detach().cpu(),
        "scale": history.scale.detach().cpu(),
    }


def _restore(history: AmaxHistory, saved: dict[str, torch.Tensor], device: torch.device) -> None:
    """``saved`` into ``history``, into its tensors where it has them. A history of another
    length (``--fp8-amax-history-len`` changed) keeps the newest amaxes that fit."""
    entries, pos = _fit(saved["history"].float(), int(saved["pos"]), history.length)
    if history.history is None:
        history.allocate(device)
    with torch.no_grad():
        history.history.copy_(entries)
        history.current.copy_(saved["current"])
        history.pos.fill_(pos)
        history.scale.copy_(saved["scale"])
    history.started = True


def _fit(ring: torch.Tensor, pos: int, length: int) -> tuple[torch.Tensor, int]:
    """A ring of amaxes (``pos``: the next slot, so the oldest entry) as a ring of
    ``length``: unchanged at the same length, else its newest ``min`` entries, oldest first,
    from slot 0 (zeros, the empty entries, behind them)."""
    if ring.numel() == length:
        return ring, pos
    newest_last = torch.roll(ring, -pos)
    kept = min(length, ring.numel())
    fitted = torch.zeros(length, dtype=ring.dtype)
    fitted[:kept] = newest_last[ring.numel() - kept :]
    return fitted, kept % length


def _payload(state: Any) -> dict | None:
    """This module's payload in ``state``, or None where ``state`` is not one."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
        return None
    raw = state.detach().cpu().numpy().tobytes()
    if not raw.startswith(_PREFIX):
        return None
    try:
        return torch.load(io.BytesIO(raw[len(_PREFIX) :]), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a damaged checkpoint, named
        raise ValueError(f"FP8 amax histories in the checkpoint are unreadable: {exc}") from exc


class DelayedScalingCheckpoint:
    """A native linear's ``_extra_state`` under delayed scaling (placed before the module's
    base class, whose ``get_extra_state`` gives the value without FP8 state)."""

    def get_extra_state(self) -> Any:
        """The histories (:func:`extra_state`), or the base class's value."""
        return extra_state(self, super().get_extra_state())  # type: ignore[misc]

    def set_extra_state(self, state: Any) -> None:
        """The histories back from a checkpoint (:func:`load_extra_state`)."""
        load_extra_state(self, state)

    def _load_from_state_dict(
        self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        """torch's load (parameters, then ``set_extra_state``), then the FP8 weight's bytes
        at its restored scale (:func:`recast_loaded_weight`)."""
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)  # type: ignore[misc]
        recast_loaded_weight(self, state_dict, prefix)
