"""TE's ``Fp8Padding`` / ``Fp8Unpadding`` without TransformerEngine: MoE token segments
aligned for the FP8 experts.

Upstream's ``TEGroupedMLP`` pads each local expert's rows to a multiple of 16 before its FP8
grouped GEMMs (``Fp8Padding``) and drops the padding after them (``Fp8Unpadding``), unless the
router already padded the routing map (``--moe-router-padding-for-quantization``). Both come
from ``megatron.core.extensions.transformer_engine``, where the ``te-spec-backend`` patch binds
these. The padded rows are zeros; both directions are plain differentiable torch ops.
"""

from __future__ import annotations

import torch

from megatron_rocm.runtime.kernels.launch import cdiv

FP8_ALIGN = 16  # torch._scaled_mm's (and TE's per-tensor recipes') multiple


class _Alignment(torch.nn.Module):
    """TE's constructor for both: ``num_gemms`` segments, aligned to ``align_size`` rows (16
    by default, TE's for per-tensor FP8)."""

    def __init__(self, num_gemms: int, align_size: int | None = None) -> None:
        super().__init__()
        self.num_gemms = num_gemms
        self.align_size = align_size or FP8_ALIGN

    def _splits(self, m_splits: list[int]) -> tuple[list[int], list[int]]:
        """``(splits, padded)``: the segments' rows as given, and aligned."""
        splits = [int(m) for m in m_splits]
        if len(splits) != self.num_gemms:
            raise ValueError(
                f"{type(self).__name__}: {len(splits)} splits for {self.num_gemms} experts"
            )
        align = self.align_size
        return splits, [cdiv(m, align) * align for m in splits]


class Fp8Padding(_Alignment):
    """``(padded, padded_m_splits)``: each segment of ``m_splits`` rows followed by zero rows
    up to a multiple of ``align_size``."""

    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> tuple[torch.Tensor, list[int]]:
        splits, padded = self._splits(m_splits)
        if padded == splits:
            return inp, splits
        parts = []
        for segment, rows, target in zip(inp.split(splits), splits, padded):
            parts.append(segment)
            if target > rows:
                parts.append(segment.new_zeros(target - rows, *segment.shape[1:]))
        return torch.cat(parts), padded


class Fp8Unpadding(_Alignment):
    """The rows ``Fp8Padding`` added removed again: ``m_splits`` are the unpadded counts."""

    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        splits, padded = self._splits(m_splits)
        if padded == splits:
            return inp
        segments = inp.split(padded)
        return torch.cat([segment[:rows] for segment, rows in zip(segments, splits)])
