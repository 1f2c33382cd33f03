"""Quantizing row segments each by its own amax (``kernels.fp8_segments``): the MoE experts'
tokens and weights.

The oracle is eager torch's quantize of each segment alone (``fp8.quantize(triton=False)``,
itself held to torch's own cast and scale by ``test_fp8_cast_transpose.py``): the segments'
bytes, their transposed blocks (zeros past each segment's rows) and their inverse scales, bit
for bit. The ``triton`` cases run the two kernels (on a GPU, or under the interpreter in a
child pytest on a CPU box: ``test_triton_interpreter_runs.py``); the others run torch's path.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import TRITON_DEVICE, quick_few, triton_test

from megatron_rocm.runtime.kernels import fp8, fp8_segments
from megatron_rocm.runtime.kernels.fp8_segments import Segments, quantize_segments

TRITON_SKIPS_ALLOWED = False  # under the interpreter every Triton case runs

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
DEVICE = TRITON_DEVICE or "cpu"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8)


def _check_against_each_segment_alone(
    got: fp8_segments.QuantizedSegments, x: torch.Tensor, dtype: torch.dtype, margin: int
) -> int:
    """Every segment of ``got`` against eager quantize of that segment; returns how many
    non-empty segments were compared."""
    segs, compared = got.segs, 0
    cols = x.shape[1]
    for s, count in enumerate(segs.counts):
        start = segs.starts[s]
        if count == 0:  # eager quantize's inverse for nothing to scale
            assert got.inv(s).item() == 1.0
            assert got.transposed is None or not _bytes(got.t(s)).any()
            continue
        want, want_inv = fp8.quantize(x[start : start + count], dtype, margin, triton=False)
        assert torch.equal(_bytes(got.data[start : start + count]), want.view(torch.uint8)), s
        assert torch.equal(got.inv(s).cpu(), want_inv), s
        if got.transposed is not None:
            block = got.t(s)
            assert block.shape == (cols, segs.buckets[s]) and block.is_contiguous()
            assert torch.equal(_bytes(block[:, :count]), want.t().view(torch.uint8)), s
            assert not _bytes(block[:, count:]).any(), s
        assert got.inv(s).data_ptr() % 16 == 0  # cuBLASLt's scale pointer alignment
        compared += 1
    return compared


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records each launch pair that returned (its segment count): a case that ran torch's
    path, or fell back to it after the launch raised, cannot pass."""
    from megatron_rocm.runtime.kernels import fp8_segments_triton

    calls: list[int] = []
    real = fp8_segments_triton.quantize_segments

    def spy(x, table, segments, *args):  # noqa: ANN001, ANN202
        real(x, table, segments, *args)
        calls.append(segments)

    monkeypatch.setattr(fp8_segments_triton, "quantize_segments", spy)
    return calls


def test_the_layout_of_segments_and_buckets() -> None:
    segs = Segments((5, 0, 130, 128), 128)
    assert segs.starts == (0, 5, 5, 135, 263)
    assert segs.buckets == (128, 0, 256, 128)
    assert segs.t_starts == (0, 128, 128, 384, 512)
    assert segs.rows == 263 and segs.padded_rows == 391
    assert segs.nonempty() == [0, 2, 3]
    assert segs.tiles(64) == ((0, 2, 3, 7), 9)  # the empty segment still gets one tile
    with pytest.raises(ValueError, match="segments"):
        Segments((), 16)
    with pytest.raises(ValueError, match="segments"):
        Segments((3, -1), 16)


def test_the_scale_stride_is_the_kernels() -> None:
    from megatron_rocm.runtime.kernels import fp8_segments_triton

    assert fp8_segments.SCALE_STRIDE == fp8_segments_triton.SCALE_STRIDE
    assert fp8_segments.SCALE_STRIDE * 4 % 16 == 0


def test_a_wrong_row_count_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\(10, 16\) for 12 rows"):
        quantize_segments(torch.zeros(10, 16), Segments((4, 8), 16), torch.float8_e4m3fn)


@pytest.mark.parametrize("transpose", [True, False])
def test_torch_path_is_each_segment_alone(transpose: bool) -> None:
    torch.manual_seed(0)
    segs = Segments((7, 0, 33, 16), 16)
    x = torch.randn(segs.rows, 48).bfloat16()
    got = fp8_segments._quantize_segments_torch(x, segs, torch.float8_e4m3fn, 1, transpose)
    assert _check_against_each_segment_alone(got, x, torch.float8_e4m3fn, 1) == 3


# segments: empty ones first, between and last; one longer than a tile; one of a single row
CASES = [
    ((3, 0, 70, 1), 48, 16),
    ((0, 130, 5), 200, 128),  # 200 columns: a partial second tile on every tile width
    ((64, 64, 64), 80, 64),
    ((0, 0), 32, 16),  # nothing at all to cast
]


@triton_test  # the quick tier: one layout from bf16 under the interpreter; the full tier all
@pytest.mark.parametrize("source", quick_few([torch.bfloat16, torch.float16, torch.float32]))
@pytest.mark.parametrize(("counts", "cols", "multiple"), quick_few(CASES, unpack=True))
def test_the_kernels_give_each_segments_eager_bytes_and_scale(
    monkeypatch: pytest.MonkeyPatch, source: torch.dtype, counts, cols: int, multiple: int
) -> None:
    calls = _spy(monkeypatch)
    segs = Segments(counts, multiple)
    gen = torch.Generator().manual_seed(sum(counts) + cols)
    x = torch.randn(segs.rows, cols, generator=gen) * 3
    for s, start in enumerate(segs.starts[:-1]):  # each segment on a scale of its own
        x[start : start + counts[s]] *= 2.0 ** (-14 * (s % 2))
    x = x.to(source)
    launched = 0
    for dtype, margin in zip(FORMATS, (0, 1, 0, 2), strict=True):
        for transpose in (True, False):
            got = quantize_segments(x.to(DEVICE), segs, dtype, margin, transpose)
            assert (got.transposed is not None) == transpose
            compared = _check_against_each_segment_alone(got, x, dtype, margin)
            assert compared == sum(1 for c in counts if c)
            launched += 1
    if segs.rows:
        assert calls == [len(counts)] * launched
    assert not fp8.failed_kernels()


@triton_test
def test_nan_inf_and_zero_segments_scale_as_eager_quantize(monkeypatch) -> None:
    """A segment holding NaN or inf falls back to scale 1 (current scaling's rule), an
    all-zero one too; the others keep their own scale."""
    calls = _spy(monkeypatch)
    segs = Segments((16, 16, 16, 16), 16)
    x = torch.randn(segs.rows, 32)
    x[3, 5] = float("nan")
    x[20, 0] = float("inf")
    x[32:48] = 0
    got = quantize_segments(x.to(DEVICE), segs, torch.float8_e4m3fn)
    assert _check_against_each_segment_alone(got, x, torch.float8_e4m3fn, 0) == 4
    assert [got.inv(s).item() for s in range(3)] == [1.0, 1.0, 1.0]
    assert got.inv(3).item() != 1.0
    assert calls == [4]


@triton_test
def test_int64_offsets_give_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' WIDE branch (offsets past int32), forced on a small tensor."""
    from megatron_rocm.runtime.kernels import fp8_segments_triton

    calls = _spy(monkeypatch)
    monkeypatch.setattr(fp8_segments_triton, "needs_int64", lambda *sizes: True)
    segs = Segments((9, 0, 40), 16)
    x = torch.randn(segs.rows, 48) * 4
    got = quantize_segments(x.to(DEVICE), segs, torch.float8_e5m2, 0)
    assert _check_against_each_segment_alone(got, x, torch.float8_e5m2, 0) == 2
    assert calls == [3]


def test_int64_offsets_are_asked_for_where_int32_ends() -> None:
    from megatron_rocm.runtime.kernels import fp8_segments_triton

    assert not fp8_segments_triton.needs_int64(8192, 4096, 8192 * 4096)
    assert fp8_segments_triton.needs_int64(2**31 // 4096, 4096, 0)
    assert fp8_segments_triton.needs_int64(16, 4096, 2**31)


def test_the_reference_path_is_taken_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MEGATRON_ROCM_KERNELS=reference:fp8`` keeps the kernels out (the spy sees nothing)."""
    calls = _spy(monkeypatch)
    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "reference:fp8")
    segs = Segments((4, 12), 16)
    x = torch.randn(segs.rows, 16)
    got = quantize_segments(x.to(DEVICE), segs, torch.float8_e4m3fn)
    assert _check_against_each_segment_alone(got, x, torch.float8_e4m3fn, 0) == 2
    assert calls == []


def test_fp8_mm_into_writes_fp8_mms_result() -> None:
    torch.manual_seed(1)
    a, a_inv = fp8.quantize(torch.randn(32, 48), torch.float8_e4m3fn)
    b, b_inv = fp8.quantize(torch.randn(16, 48), torch.float8_e4m3fn)
    out = torch.full((40, 16), float("nan"), dtype=torch.bfloat16)
    fp8.fp8_mm_into(out[8:], a, a_inv, b.t(), b_inv)
    assert torch.equal(out[8:], fp8.fp8_mm(a, a_inv, b.t(), b_inv, torch.bfloat16))
    assert out[:8].isnan().all()  # nothing outside the rows asked for
