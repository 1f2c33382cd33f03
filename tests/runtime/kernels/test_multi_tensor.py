"""amp_C drop-ins: l2norm and scale over tensor lists, overflow flag on device, no host sync."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from megatron_rocm.runtime.kernels.multi_tensor import (  # noqa: E402
    l2norm_reference,
    multi_tensor_applier,
    multi_tensor_l2norm,
    multi_tensor_scale,
    multi_tensor_scale_tensor,
)


def _tensors(dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)):  # noqa: ANN202
    torch.manual_seed(0)
    shapes = [(7,), (3, 5), (1,), (0,), (33, 2)]
    return [torch.randn(shape).to(dtypes[i % len(dtypes)]) for i, shape in enumerate(shapes)]


def _flag() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int)


@contextlib.contextmanager
def _no_host_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Reading a tensor back to Python (item/bool/float/tolist) raises inside the block."""

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("host sync")

    with monkeypatch.context() as patch:
        for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
            patch.setattr(torch.Tensor, name, refuse)
        yield


@pytest.mark.parametrize("per_tensor", [False, True])
def test_l2norm_parity(per_tensor: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = _tensors()
    flag = _flag()
    with _no_host_sync(monkeypatch):
        total, per = multi_tensor_applier(multi_tensor_l2norm, flag, [tensors], per_tensor)
    assert total.dtype == torch.float32 and total.shape == (1,)
    torch.testing.assert_close(total.double(), l2norm_reference(tensors), rtol=1e-6, atol=0)
    assert per.dtype == torch.float32
    if per_tensor:
        expected = torch.cat([l2norm_reference([t]) for t in tensors])
        torch.testing.assert_close(per.double(), expected, rtol=1e-6, atol=0)
    else:
        assert per.numel() == 0
    assert flag.item() == 0


def test_l2norm_of_bf16_is_not_rounded_to_bf16() -> None:
    """amp_C accumulates and returns fp32; a bf16 norm would be off by ~0.4%."""
    x = torch.full((1000,), 1.001, dtype=torch.bfloat16)
    total, _ = multi_tensor_l2norm(2048, _flag(), [[x]], False)
    torch.testing.assert_close(total.double(), l2norm_reference([x]), rtol=1e-6, atol=0)


def test_l2norm_empty_list() -> None:
    total, per = multi_tensor_l2norm(2048, _flag(), [[]], True)
    assert total.tolist() == [0.0] and per.numel() == 0


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_l2norm_flags_nonfinite(bad: float) -> None:
    tensors = _tensors()
    tensors[1][0, 0] = bad
    flag = _flag()
    total, _ = multi_tensor_l2norm(2048, flag, [tensors], False)
    assert not torch.isfinite(total).all() and flag.item() == 1


@pytest.mark.parametrize("scale", [0.5, 1.0])
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scale_into_other_dtype(
    scale: float, dst_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _tensors((torch.float32,))
    dst = [torch.empty_like(t, dtype=dst_dtype) for t in src]
    flag = _flag()
    with _no_host_sync(monkeypatch):
        multi_tensor_applier(multi_tensor_scale, flag, [src, dst], scale)
    for s, d in zip(src, dst):
        assert d.dtype == dst_dtype
        torch.testing.assert_close(d, (s * scale).to(dst_dtype), atol=0, rtol=0)
    assert flag.item() == 0


def test_scale_in_place_like_clip_grads() -> None:
    grads = _tensors((torch.float32,))
    expected = [g * 0.25 for g in grads]
    multi_tensor_scale(2048, _flag(), [grads, grads], 0.25)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, atol=0, rtol=0)


@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
def test_scale_in_place_is_one_pass_with_the_check(
    bad: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In place (clip_grads) the check rides on the scaling pass: no separate max-abs norm,
    no host sync, the same numbers as a plain multiply, and the flag set by a bad input."""
    grads = _tensors((torch.float32, torch.float16))
    if bad is not None:
        grads[4][3, 1] = bad
    expected = [g * 0.25 for g in grads]
    flag = _flag()
    norms = []
    original = torch._foreach_norm
    monkeypatch.setattr(
        torch, "_foreach_norm", lambda *a, **k: norms.append(1) or original(*a, **k)
    )
    with _no_host_sync(monkeypatch):
        multi_tensor_scale(2048, flag, [grads, grads], 0.25)
    assert norms == []
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, atol=0, rtol=0, equal_nan=True)
    assert flag.item() == (0 if bad is None else 1)


def test_scale_in_place_bf16_takes_the_two_pass_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's GPU kernel of the one-pass op has no bf16: bf16 lists are checked, then scaled."""
    grads = _tensors((torch.float32, torch.bfloat16))
    grads[1][0, 0] = float("nan")
    expected = [g * 0.5 for g in grads]

    def unavailable_for_bf16(*_args: object) -> None:
        raise AssertionError("the one-pass op was called with a bf16 list")

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", unavailable_for_bf16)
    flag = _flag()
    multi_tensor_scale(2048, flag, [grads, grads], 0.5)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, atol=0, rtol=0, equal_nan=True)
    assert flag.item() == 1


def test_scale_in_place_without_torchs_checked_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch without ``_amp_foreach_non_finite_check_and_unscale_``: the two-pass path."""
    monkeypatch.delattr(torch, "_amp_foreach_non_finite_check_and_unscale_")
    grads = _tensors((torch.float32,))
    grads[1][0, 0] = float("inf")
    expected = [g * 0.5 for g in grads]
    flag = _flag()
    multi_tensor_scale(2048, flag, [grads, grads], 0.5)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    assert flag.item() == 1


def test_scale_tensor_coefficient(monkeypatch: pytest.MonkeyPatch) -> None:
    grads = _tensors((torch.float32, torch.bfloat16))
    expected = [(g.float() * 0.3).to(g.dtype) for g in grads]
    coeff = torch.tensor([0.3])
    with _no_host_sync(monkeypatch):
        multi_tensor_scale_tensor(2048, _flag(), [grads, grads], coeff)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_scale_flags_nonfinite_input_and_still_writes(bad: float) -> None:
    src = _tensors((torch.float32,))
    src[2][0] = bad
    dst = [torch.zeros_like(t) for t in src]
    flag = _flag()
    multi_tensor_scale(2048, flag, [src, dst], 2.0)
    assert flag.item() == 1
    torch.testing.assert_close(dst[0], src[0] * 2.0)


def test_flag_is_sticky() -> None:
    flag = torch.ones(1, dtype=torch.int)
    src = _tensors((torch.float32,))
    multi_tensor_scale(2048, flag, [src, [t.clone() for t in src]], 1.0)
    assert flag.item() == 1


def test_applier_passes_apex_chunk_size() -> None:
    seen = []
    multi_tensor_applier(
        lambda chunk, flag, lists, *args: seen.append((chunk, args)), None, [[]], 7
    )
    assert seen == [(2048 * 32, (7,))]
    assert multi_tensor_applier.available


@pytest.mark.gpu
def test_gpu_parity(cuda_device: torch.device) -> None:
    tensors = [t.to(cuda_device) for t in _tensors()]
    flag = torch.zeros(1, dtype=torch.int, device=cuda_device)
    total, _ = multi_tensor_l2norm(2048, flag, [tensors], False)
    torch.testing.assert_close(
        total.cpu().double(), l2norm_reference(tensors).cpu(), rtol=1e-5, atol=0
    )
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in tensors]
    multi_tensor_scale(2048, flag, [tensors, dst], 1.0)
    assert flag.item() == 0


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtypes", [(torch.float32,), (torch.float32, torch.float16), (torch.float32, torch.bfloat16)]
)
def test_gpu_in_place_scale_matches_a_multiply(
    cuda_device: torch.device, dtypes: tuple[torch.dtype, ...]
) -> None:
    grads = [t.to(cuda_device) for t in _tensors(dtypes)]
    expected = [g * 0.3 for g in grads]
    flag = torch.zeros(1, dtype=torch.int, device=cuda_device)
    multi_tensor_scale(2048, flag, [grads, grads], 0.3)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    assert flag.item() == 0
    grads[0][1] = float("nan")
    multi_tensor_scale(2048, flag, [grads, grads], 1.0)
    assert flag.item() == 1
