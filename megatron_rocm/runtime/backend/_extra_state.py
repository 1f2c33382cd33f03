"""The ``_extra_state`` value of the native TE modules: what TE stores when there is no FP8.

TE's modules keep FP8 scaling metadata in ``get_extra_state``; without FP8 they return an
empty uint8 tensor and skip an empty tensor on load. The native modules keep the key (so
checkpoints carry the same entries as TE's) and that same value: a tensor, never None, so
code that ``detach()``es every state-dict value works here as with TE.
"""

from __future__ import annotations

import torch


def no_fp8_extra_state() -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)
