"""FP8 quantization of a tensor's row segments, each segment by its own amax (current scaling).

The FP8 MoE experts (``backend.fp8_experts``) hold every local expert's tokens in one tensor,
one expert's rows after another, and quantize each expert's rows by their own scale (and each
expert's weight by its own). On a GPU all segments quantize in two launches
(``fp8_segments_triton``); elsewhere, with ``MEGATRON_ROCM_KERNELS=reference:fp8`` or once
the kernels failed (logged once), each segment goes through eager ``fp8.quantize``. Both give
the bytes and scales of ``fp8.quantize`` on each segment alone.

The layout serves ``torch._scaled_mm`` without copies:

* ``data`` [rows + multiple, cols]: the segments' rows where they were. A GEMM over one
  segment takes its rows rounded up to ``multiple`` (``Segments.buckets``: the shapes repeat
  from step to step, and cuBLASLt plans a new shape on the host), reading the next segment's
  first rows, or past the end; those rows of its output are the next segment's GEMM's to
  overwrite, or past the output's end (``fp8_experts``).
* ``transposed``: each segment's ``[cols, bucket]`` transpose in a contiguous block of its own,
  zeros past the segment's rows (the weight gradient's operands, summed over the bucket).
* ``inverse`` [segments, SCALE_STRIDE]: each segment's inverse scale in its first column.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from megatron_rocm.runtime.kernels import fp8
from megatron_rocm.runtime.kernels.launch import cdiv

SCALE_STRIDE = 4  # as fp8_segments_triton.SCALE_STRIDE (a test holds them equal)


@dataclass(frozen=True)
class Segments:
    """Row segments of a 2-D tensor: ``counts`` rows each, one after another, each GEMM over a
    segment on its rows rounded up to ``multiple`` (its bucket)."""

    counts: tuple[int, ...]
    multiple: int

    def __post_init__(self) -> None:
        if not self.counts or min(self.counts) < 0 or self.multiple < 1:
            raise ValueError(f"segments: counts {self.counts}, multiple {self.multiple}")

    @functools.cached_property
    def starts(self) -> tuple[int, ...]:
        """Each segment's first row, then the total."""
        return tuple(itertools.accumulate(self.counts, initial=0))

    @functools.cached_property
    def buckets(self) -> tuple[int, ...]:
        return tuple(cdiv(count, self.multiple) * self.multiple for count in self.counts)

    @functools.cached_property
    def t_starts(self) -> tuple[int, ...]:
        """Where each segment's transposed block starts, in units of ``cols`` elements, then the
        total."""
        return tuple(itertools.accumulate(self.buckets, initial=0))

    @property
    def rows(self) -> int:
        return self.starts[-1]

    @property
    def padded_rows(self) -> int:
        """Rows of ``data`` (and of a GEMM output written bucket by bucket): room for the last
        segment's bucket."""
        return self.rows + self.multiple

    def nonempty(self) -> list[int]:
        return [s for s, count in enumerate(self.counts) if count]

    def tiles(self, block_rows: int) -> tuple[tuple[int, ...], int]:
        """Each segment's first row tile and the total: at least one tile a segment (an empty
        one's writes its inverse scale)."""
        firsts, total = [], 0
        for bucket in self.buckets:
            firsts.append(total)
            total += max(1, cdiv(bucket, block_rows))
        return tuple(firsts), total


@functools.lru_cache(maxsize=64)
def _table(segs: Segments, block_rows: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """The kernels' int32 table [4, segments + 1] on ``device`` (rows: starts, buckets, first
    tiles, transposed starts) and the tile count. Cached: the experts' weights repeat it every
    step, and a copy to the device costs the host more than a lookup."""
    firsts, total = segs.tiles(block_rows)
    rows = [segs.starts, (*segs.buckets, 0), (*firsts, total), segs.t_starts]
    table = torch.tensor(rows, dtype=torch.int32)
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    return table, total


@dataclass(frozen=True)
class QuantizedSegments:
    """A tensor's segments in FP8 (the module docstring's layout); ``data`` None where only
    the transposes are kept (a backward's operands)."""

    segs: Segments
    cols: int
    data: torch.Tensor | None
    transposed: torch.Tensor | None
    inverse: torch.Tensor

    def rows(self, s: int) -> torch.Tensor:
        """Segment ``s``'s rows rounded up to its bucket: [bucket, cols], row-major."""
        assert self.data is not None
        start = self.segs.starts[s]
        return self.data[start : start + self.segs.buckets[s]]

    def t(self, s: int) -> torch.Tensor:
        """Segment ``s``'s transpose: [cols, bucket], row-major, zeros past its rows."""
        first, bucket = self.segs.t_starts[s] * self.cols, self.segs.buckets[s]
        assert self.transposed is not None
        return self.transposed[first : first + self.cols * bucket].view(self.cols, bucket)

    def inv(self, s: int) -> torch.Tensor:
        """Segment ``s``'s inverse scale, a 0-d fp32 tensor 16-byte aligned."""
        return self.inverse[s, 0]


def quantize_segments(
    x: torch.Tensor, segs: Segments, dtype: torch.dtype, margin: int = 0, transpose: bool = True
) -> QuantizedSegments:
    """``x`` [segs.rows, cols] quantized segment by segment (``transpose``: with the
    transposed blocks)."""
    if x.dim() != 2 or x.shape[0] != segs.rows:
        raise ValueError(f"quantize_segments: {tuple(x.shape)} for {segs.rows} rows")
    cols = x.shape[1]
    margin_factor = 2.0**margin
    if fp8._triton_takes(x, dtype):
        from megatron_rocm.runtime.kernels import fp8_segments_triton as kernels
        from megatron_rocm.runtime.kernels import fp8_triton

        if fp8_triton.fits_grid(segs.padded_rows, cols):
            with torch.no_grad(), fp8._on_device(x):
                x = x.detach().contiguous()

                def launch() -> QuantizedSegments:
                    y = torch.empty(segs.padded_rows, cols, dtype=dtype, device=x.device)
                    yt = None
                    if transpose:
                        yt = torch.empty(segs.t_starts[-1] * cols, dtype=dtype, device=x.device)
                    inverse = torch.empty(
                        len(segs.counts), SCALE_STRIDE, dtype=torch.float32, device=x.device
                    )
                    block_rows = fp8_triton.cast_tile(fp8_triton.cast_kind(dtype, x.device)).rows
                    table, tiles = _table(segs, block_rows, x.device)
                    fp8_max = float(torch.finfo(dtype).max)
                    kernels.quantize_segments(
                        x, table, len(segs.counts), tiles, y, yt, inverse, dtype, fp8_max,
                        margin_factor,
                    )  # fmt: skip
                    return QuantizedSegments(segs, cols, y, yt, inverse)

                done = fp8._launch_or_none((dtype, x.dtype), launch)
                if done is not None:
                    return done
    return _quantize_segments_torch(x, segs, dtype, margin, transpose)


def _quantize_segments_torch(
    x: torch.Tensor, segs: Segments, dtype: torch.dtype, margin: int, transpose: bool
) -> QuantizedSegments:
    """Each segment through eager ``fp8.quantize`` (rows outside every segment zero)."""
    cols = x.shape[1]
    with torch.no_grad():
        y = torch.zeros(segs.padded_rows, cols, dtype=dtype, device=x.device)
        yt = None
        if transpose:
            yt = torch.zeros(segs.t_starts[-1] * cols, dtype=dtype, device=x.device)
        inverse = torch.ones(len(segs.counts), SCALE_STRIDE, dtype=torch.float32, device=x.device)
        done = QuantizedSegments(segs, cols, y, yt, inverse)
        for s in segs.nonempty():
            start, count = segs.starts[s], segs.counts[s]
            q, inv = fp8.quantize(x[start : start + count].detach(), dtype, margin, triton=False)
            y[start : start + count] = q
            inverse[s, 0] = inv
            if transpose:
                done.t(s)[:, :count] = q.t()
    return done
