"""The ``_extra_state`` value of the native TE modules: what TE stores when there is no FP8.

TE's modules keep FP8 scaling metadata in ``get_extra_state``; without FP8 they return an
empty uint8 tensor and skip an empty tensor on load. The native ``TELinear`` and grouped
linears keep the key (so checkpoints carry the same entries as TE's) and that same value: a
tensor, never None, so code that ``detach()``es every state-dict value works here as with
TE. (The column and row linears are upstream's local classes and keep upstream's None.)
"""

from __future__ import annotations

from typing import Any

import torch


def no_fp8_extra_state() -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


class NoFp8ExtraState(torch.nn.Module):
    """A native module whose ``_extra_state`` is TE's value without FP8 state, and which has
    nothing to restore from one (a TE checkpoint's FP8 metadata does not apply here)."""

    def get_extra_state(self) -> torch.Tensor:
        return no_fp8_extra_state()

    def set_extra_state(self, state: Any) -> None:
        """Nothing to restore."""
