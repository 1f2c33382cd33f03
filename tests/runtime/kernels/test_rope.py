"""RoPE drop-ins vs the Megatron-style reference (forward, backward, partial, interleaved, thd).

The torch-path tests always run. ``triton`` tests run the Triton kernel through the public
functions: on a GPU natively, on CPU-only machines under ``TRITON_INTERPRET=1`` with tiny
shapes (a child pytest runs them; each reports its outcome here). ``gpu`` tests run at the
0.85B Llama's sizes.

Closeness is measured against the rounding the math allows, per element:
``|ours - ref| <= k * eps(dtype) * (|a| + |b|)`` for the rotated pair ``(a, b)`` the element
belongs to, and exactly equal on pass-through channels. Both paths round like Megatron's
unfused code, so ``k = 2`` covers a last-bit difference of ``cos``/``sin``; Triton's interpreter
truncates fp32 -> bf16 instead of rounding to nearest, hence ``k = 4`` for bf16 there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import math
from collections.abc import Callable, Iterator

import pytest

torch = pytest.importorskip("torch")

from triton_interpreter import INTERPRETER, TRITON_DEVICE, quick_few, triton_test  # noqa: E402

from megatron_rocm.runtime.kernels import launch as _runtime  # noqa: E402
from megatron_rocm.runtime.kernels.rope import (  # noqa: E402
    fused_apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb_thd,
    rope_reference,
    rope_thd_reference,
)

TRITON_SKIPS_ALLOWED = False  # under the interpreter every Triton case runs

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# -- inputs and closeness ----------------------------------------------------------------------


def _freqs(positions: int, rot_dim: int, batch: int = 1) -> torch.Tensor:
    """Megatron's angle table ``pos * theta^(-2i/rot)`` duplicated to ``rot_dim``, fp32."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    table = torch.cat((angles, angles), dim=-1)
    return table[:, None, None, :].expand(positions, batch, 1, rot_dim).contiguous()


def _random_freqs(positions: int, rot_dim: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    """A distinct angle per channel (Megatron's halves share one), so a kernel that takes the
    partner's or the neighbour's angle cannot pass; up to ~50 rad, as positions reach."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand((positions, batch, 1, rot_dim), generator=g) * 50.0


def _pair_magnitude(x: torch.Tensor, rot_dim: int, interleaved: bool) -> torch.Tensor:
    """``|a| + |b|`` of the rotated pair of each channel; 0 on pass-through channels."""
    head = x[..., :rot_dim].double().abs()
    if interleaved:
        partner = head.unflatten(-1, (rot_dim // 2, 2)).flip(-1).flatten(-2)
    else:
        partner = head.roll(rot_dim // 2, dims=-1)
    rest = torch.zeros_like(x[..., rot_dim:], dtype=torch.float64)
    return torch.cat((head + partner, rest), dim=-1)


def _k(dtype: torch.dtype, on_triton: bool) -> float:
    return 4.0 if (on_triton and INTERPRETER and dtype == torch.bfloat16) else 2.0


def _assert_rope_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    inputs: torch.Tensor,
    rot_dim: int,
    interleaved: bool,
    k: float,
) -> None:
    """``|actual - expected| <= k * eps * (|a| + |b|)`` per element (see the module docstring)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    info = torch.finfo(actual.dtype)
    bound = k * info.eps * _pair_magnitude(inputs.cpu(), rot_dim, interleaved) + info.tiny
    err = (actual.cpu().double() - expected.cpu().double()).abs()
    bad = err > bound
    if bad.any():
        idx = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} elements off, first at {idx}: "
            f"{actual.cpu()[idx].item()} vs {expected.cpu()[idx].item()} (bound {bound[idx]:.3g})"
        )


_last_path = ""


def _grads(fn, t: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Output and input gradient of ``fn``; remembers which path ran (see :func:`_path_of`)."""
    global _last_path
    leaf = t.detach().clone().requires_grad_()
    out = fn(leaf)
    _last_path = _path_of(out)
    out.backward(grad)
    return out.detach(), leaf.grad


def _path_of(out: torch.Tensor) -> str:
    """Which implementation autograd recorded: ``triton``, ``torch`` or ``autograd``."""
    name = type(out.grad_fn).__name__
    if name.startswith("_TritonRotary"):
        return "triton"
    return "torch" if name.startswith("_RotaryFunction") else "autograd"


def _path(fn: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor) -> str:
    return _path_of(fn(t.detach().clone().requires_grad_()))


# -- the torch path (always runs) --------------------------------------------------------------


def test_quarter_turn_by_hand() -> None:
    """Independent of the reference: angle pi/2 maps (a, b) to (-b, a) in both layouts."""
    t = torch.tensor([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
    freqs = torch.full((1, 1, 1, 4), math.pi / 2)
    halves = fused_apply_rotary_pos_emb(t, freqs)
    pairs = fused_apply_rotary_pos_emb(t, freqs, interleaved=True)
    torch.testing.assert_close(halves.flatten(), torch.tensor([-3.0, -4.0, 1.0, 2.0]))
    torch.testing.assert_close(pairs.flatten(), torch.tensor([-2.0, 1.0, -4.0, 3.0]))


SBHD_CASES = [  # (shape [s, b, h, d], rot_dim, freqs batch)
    ((7, 2, 3, 16), 16, 1),
    ((5, 3, 2, 24), 8, 1),  # partial rotary: 16 channels pass through
    ((9, 2, 1, 10), 6, 2),  # a per-batch angle table; rot/2 = 3 is not a power of two
    ((1, 1, 1, 2), 2, 1),
    ((6, 2, 12, 8), 8, 1),  # GQA-like head counts: 12 query heads ...
    ((6, 2, 4, 8), 4, 1),  # ... and 4 key heads, partial
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("shape", "rot_dim", "freq_batch"), SBHD_CASES[:4])
def test_sbhd_parity(
    dtype: torch.dtype,
    interleaved: bool,
    shape: tuple[int, ...],
    rot_dim: int,
    freq_batch: int,
) -> None:
    torch.manual_seed(0)
    t = torch.randn(shape).to(dtype)
    freqs = _freqs(shape[0], rot_dim, freq_batch)
    grad = torch.randn(shape).to(dtype)
    out, dt = _grads(
        lambda x: fused_apply_rotary_pos_emb(x, freqs, interleaved=interleaved), t, grad
    )
    k = _k(dtype, _last_path == "triton")
    ref, dref = _grads(lambda x: rope_reference(x, freqs, interleaved), t, grad)
    _assert_rope_close(out, ref, t, rot_dim, interleaved, k)
    _assert_rope_close(dt, dref, grad, rot_dim, interleaved, k)
    # Channels past rot_dim pass through untouched, forward and backward.
    torch.testing.assert_close(out[..., rot_dim:], t[..., rot_dim:], atol=0, rtol=0)
    torch.testing.assert_close(dt[..., rot_dim:], grad[..., rot_dim:], atol=0, rtol=0)


def test_longer_freqs_are_cut_and_3d_input() -> None:
    t = torch.randn(4, 2, 8)  # [s, b, d] with freqs [s, 1, 1, d]
    freqs = _freqs(10, 8)
    out = fused_apply_rotary_pos_emb(t, freqs, transpose_output_memory=True)
    torch.testing.assert_close(out, rope_reference(t, freqs[:4]))


def test_learned_angles_get_gradients() -> None:
    t = torch.randn(3, 1, 2, 4)
    freqs = _freqs(3, 4).requires_grad_()
    fused_apply_rotary_pos_emb(t, freqs).sum().backward()
    assert freqs.grad is not None and torch.count_nonzero(freqs.grad) > 0


@pytest.mark.parametrize(
    ("rot_dim", "head_dim"), [(5, 8), (10, 8)], ids=["odd-rotary-dim", "rotary-wider-than-head"]
)
def test_rejects_bad_rotary_dim(rot_dim: int, head_dim: int) -> None:
    with pytest.raises(ValueError, match="rotary dim"):
        fused_apply_rotary_pos_emb(torch.randn(2, 1, 1, head_dim), torch.zeros(2, 1, 1, rot_dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("cp_size", "cp_rank"), [(1, 0), (2, 0), (2, 1), (4, 2)])
def test_thd_parity(dtype: torch.dtype, interleaved: bool, cp_size: int, cp_rank: int) -> None:
    torch.manual_seed(0)
    cu_seqlens = torch.tensor([0, 8, 24, 32, 48], dtype=torch.int32)  # global lengths
    tokens = 48 // cp_size
    t = torch.randn(tokens, 3, 12).to(dtype)
    freqs = _freqs(16, 8)
    grad = torch.randn(tokens, 3, 12).to(dtype)

    def ours(x: torch.Tensor) -> torch.Tensor:
        return fused_apply_rotary_pos_emb_thd(
            x, cu_seqlens, freqs, cp_size=cp_size, cp_rank=cp_rank, interleaved=interleaved
        )

    def reference(x: torch.Tensor) -> torch.Tensor:
        return rope_thd_reference(x, cu_seqlens, freqs, cp_size, cp_rank, interleaved)

    out, dt = _grads(ours, t, grad)
    k = _k(dtype, _last_path == "triton")
    ref, dref = _grads(reference, t, grad)
    _assert_rope_close(out, ref, t, 8, interleaved, k)
    _assert_rope_close(dt, dref, grad, 8, interleaved, k)


def test_thd_restarts_positions_per_sequence() -> None:
    """Every packed sequence starts at angle 0: its first token is unchanged."""
    cu_seqlens = torch.tensor([0, 3, 7, 8], dtype=torch.int32)
    t = torch.randn(8, 2, 4)
    out = fused_apply_rotary_pos_emb_thd(t, cu_seqlens, _freqs(8, 4))
    for start in (0, 3, 7):
        torch.testing.assert_close(out[start], t[start])
    assert not torch.allclose(out[1], t[1])


def test_thd_padding_tokens_past_cu_seqlens() -> None:
    cu_seqlens = torch.tensor([0, 3, 5], dtype=torch.int32)
    t = torch.randn(7, 1, 4)  # two padding tokens at the end
    out = fused_apply_rotary_pos_emb_thd(t, cu_seqlens, _freqs(4, 4))
    torch.testing.assert_close(out[:5], rope_thd_reference(t[:5], cu_seqlens, _freqs(4, 4)))
    assert torch.isfinite(out).all()


def test_thd_rejects_bad_cp_rank() -> None:
    with pytest.raises(ValueError, match="context parallel"):
        fused_apply_rotary_pos_emb_thd(
            torch.randn(4, 1, 4), torch.tensor([0, 4]), _freqs(4, 4), cp_size=2, cp_rank=2
        )


# -- the Triton kernel (GPU, or TRITON_INTERPRET=1 on CPU) ---------------------------------------


@contextlib.contextmanager
def _tuning(name: str, shape: tuple[int, ...], rot_dim: int) -> Iterator[None]:
    """Launch heuristics that reach every branch at tiny sizes (the interpreter counts 4 SMs).

    ``default``: one batch entry per program. ``whole``: one program per position takes the
    whole batch. ``split``: the batch is cut into uneven chunks, and 64-element tiles make each
    program loop over several head blocks, the last one partial.
    """
    from megatron_rocm.runtime.kernels import rope_triton as tri

    old = tri.get_tuning()
    changes = {"whole": {"programs_per_sm": 1}, "split": {"tile": 64, "programs_per_sm": 2}}
    tri.set_tuning(dataclasses.replace(old, **changes.get(name, {})))
    s, b, h, d = shape
    p = tri.plan(
        s, b, h, d, rot_dim, shared_angles=True, sms=_runtime.sm_count(torch.device("cpu"))
    )
    if TRITON_DEVICE == "cpu" and name == "whole":
        assert p.rows_per_program == b
    if TRITON_DEVICE == "cpu" and name == "split":
        assert 1 < p.rows_per_program < b and b % p.rows_per_program
        full, last = p.rows_per_program * h, (b % p.rows_per_program) * h  # rows per chunk
        assert p.block_q < full and (full % p.block_q or last % p.block_q)
    try:
        yield
    finally:
        tri.set_tuning(old)


def _on(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [x.to(TRITON_DEVICE) for x in tensors]


TUNED = [  # the other launch heuristics on cases with a batch of 5 (3 + 2 when split)
    pytest.param(*case, inter, torch.bfloat16, name, id=f"{case[0]}-{inter}-{name}")
    for case in (((5, 5, 3, 24), 8, 1), ((6, 5, 12, 8), 8, 1))  # partial rotary; GQA-like
    for inter in (False, True)
    for name in ("whole", "split")
]


@triton_test
@pytest.mark.parametrize(
    ("shape", "rot_dim", "freq_batch", "interleaved", "dtype", "tuning"),
    quick_few(
        [
            pytest.param(*case, inter, dtype, "default", id=f"{case[0]}-{inter}-{dtype}")
            for case in SBHD_CASES
            for inter in (False, True)
            for dtype in DTYPES
        ]
        + TUNED
    ),
)
def test_triton_sbhd(
    shape: tuple[int, ...],
    rot_dim: int,
    freq_batch: int,
    interleaved: bool,
    dtype: torch.dtype,
    tuning: str,
) -> None:
    g = torch.Generator().manual_seed(0)
    t, grad = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    freqs = _random_freqs(shape[0] + 2, rot_dim, freq_batch)  # longer than s: cut
    t_dev, grad_dev, f_dev = _on(t, grad, freqs)

    def ours(x: torch.Tensor) -> torch.Tensor:
        return fused_apply_rotary_pos_emb(x, f_dev, interleaved=interleaved)

    with _tuning(tuning, shape, rot_dim):
        out, dt = _grads(ours, t_dev, grad_dev)
    assert _last_path == "triton"
    ref, dref = _grads(lambda x: rope_reference(x, freqs[: shape[0]], interleaved), t, grad)
    assert out.is_contiguous() and dt.is_contiguous()
    _assert_rope_close(out, ref, t, rot_dim, interleaved, _k(dtype, True))
    _assert_rope_close(dt, dref, grad, rot_dim, interleaved, _k(dtype, True))
    assert torch.equal(out[..., rot_dim:].cpu(), t[..., rot_dim:])
    assert torch.equal(dt[..., rot_dim:].cpu(), grad[..., rot_dim:])


PARTIAL_ROTARY = [  # (head_dim, rot_dim): one step is 128 + 32 or 64 + 64 + ... channels wide
    pytest.param(128, 96, id="d128-r96"),
    pytest.param(128, 32, id="d128-r32"),
    pytest.param(192, 64, id="d192-r64"),
]


@triton_test
@pytest.mark.parametrize(("head_dim", "rot_dim"), PARTIAL_ROTARY)
@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_partial_rotary_of_wide_heads(head_dim: int, rot_dim: int, interleaved: bool):
    """Enough heads that the planner's head block is capped by the tile, whose width is not a
    power of two for these rotary dims: the block must still be one (tl.arange)."""
    shape = (3, 2, 16, head_dim)
    g = torch.Generator().manual_seed(0)
    t, grad = (torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(2))
    freqs = _random_freqs(shape[0], rot_dim)
    t_dev, grad_dev, f_dev = _on(t, grad, freqs)
    out, dt = _grads(
        lambda x: fused_apply_rotary_pos_emb(x, f_dev, interleaved=interleaved), t_dev, grad_dev
    )
    assert _last_path == "triton"
    ref, dref = _grads(lambda x: rope_reference(x, freqs, interleaved), t, grad)
    _assert_rope_close(out, ref, t, rot_dim, interleaved, _k(torch.bfloat16, True))
    _assert_rope_close(dt, dref, grad, rot_dim, interleaved, _k(torch.bfloat16, True))
    assert torch.equal(out[..., rot_dim:].cpu(), t[..., rot_dim:])


@triton_test
@pytest.mark.parametrize(("head_dim", "rot_dim"), PARTIAL_ROTARY)
def test_triton_thd_partial_rotary_of_wide_heads(head_dim: int, rot_dim: int) -> None:
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    t, grad = (torch.randn((5, 16, head_dim), generator=g).to(torch.bfloat16) for _ in range(2))
    freqs = _random_freqs(3, rot_dim)
    t_dev, grad_dev, f_dev, cu_dev = _on(t, grad, freqs, cu)
    out, dt = _grads(lambda x: fused_apply_rotary_pos_emb_thd(x, cu_dev, f_dev), t_dev, grad_dev)
    assert _last_path == "triton"
    ref, dref = _grads(lambda x: rope_thd_reference(x, cu, freqs), t, grad)
    _assert_rope_close(out, ref, t, rot_dim, False, _k(torch.bfloat16, True))
    _assert_rope_close(dt, dref, grad, rot_dim, False, _k(torch.bfloat16, True))


@pytest.mark.full  # the largest views of the file: tens of seconds under the interpreter
@triton_test
@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_strided_views_like_megatron(interleaved: bool) -> None:
    """k split out of a fused qkv projection (strided heads), a ``[b, s]`` transpose, a 3-D
    ``[s, b, d]`` input; the gradient of ``out.sum()`` arrives expanded (all strides 0)."""
    g = torch.Generator().manual_seed(0)
    (qkv, bshd, sbd, freqs) = _on(
        torch.randn((5, 3, 2, 4 * 8), generator=g).to(torch.bfloat16),  # [s, b, groups, ...]
        torch.randn((3, 5, 2, 8), generator=g).to(torch.bfloat16),
        torch.randn((5, 3, 8), generator=g).to(torch.bfloat16),
        _random_freqs(5, 8),
    )
    key = qkv[..., 2 * 8 : 3 * 8]  # [s, b, 2, 8], head stride 32
    for t in (key, bshd.transpose(0, 1), sbd):
        assert not t.is_contiguous() or t.dim() == 3
        leaf = t.detach().requires_grad_()
        out = fused_apply_rotary_pos_emb(leaf, freqs, interleaved=interleaved)
        out.sum().backward()
        assert type(out.grad_fn).__name__.startswith("_TritonRotary") and out.is_contiguous()
        t_cpu = t.detach().cpu().requires_grad_()
        ref = rope_reference(t_cpu, freqs.cpu(), interleaved)
        ref.sum().backward()
        k = _k(torch.bfloat16, True)
        _assert_rope_close(out.detach(), ref.detach(), t_cpu.detach(), 8, interleaved, k)
        ones = torch.ones(t.shape, dtype=t.dtype)
        _assert_rope_close(leaf.grad, t_cpu.grad, ones, 8, interleaved, k)


@triton_test
@pytest.mark.parametrize("dtype", quick_few(DTYPES))
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    ("seqlens", "cp_size", "cp_rank", "pad"),
    [([3, 7, 1, 6], 1, 0, 2), ([8, 16, 12, 4], 2, 0, 0), ([8, 16, 12, 4], 2, 1, 0)],
    ids=["uneven-docs+padding", "cp2-rank0", "cp2-rank1"],
)
def test_triton_thd(
    seqlens: list[int], cp_size: int, cp_rank: int, pad: int, interleaved: bool, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(0)
    cu_seqlens = torch.tensor([0, *seqlens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    tokens = sum(seqlens) // cp_size
    t, grad = (torch.randn((tokens + pad, 3, 12), generator=g).to(dtype) for _ in range(2))
    freqs = _random_freqs(max(seqlens), 8)
    t_dev, grad_dev, f_dev, cu_dev = _on(t, grad, freqs, cu_seqlens)

    def ours(x: torch.Tensor) -> torch.Tensor:
        return fused_apply_rotary_pos_emb_thd(
            x, cu_dev, f_dev, cp_size=cp_size, cp_rank=cp_rank, interleaved=interleaved
        )

    out, dt = _grads(ours, t_dev, grad_dev)
    assert _last_path == "triton"
    ref, dref = _grads(
        lambda x: rope_thd_reference(x, cu_seqlens, freqs, cp_size, cp_rank, interleaved),
        t[:tokens],
        grad[:tokens],
    )
    k = _k(dtype, True)
    _assert_rope_close(out[:tokens], ref, t[:tokens], 8, interleaved, k)
    _assert_rope_close(dt[:tokens], dref, grad[:tokens], 8, interleaved, k)
    assert torch.equal(out[:, :, 8:].cpu(), t[:, :, 8:])  # partial rotary: 4 pass-through
    assert torch.isfinite(out).all() and torch.isfinite(dt).all()  # padding tokens too


@triton_test
@pytest.mark.parametrize("dtype", quick_few(DTYPES))
@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_rounding_vs_exact_and_te(dtype: torch.dtype, interleaved: bool) -> None:
    """The chosen rounding (Megatron's unfused, op by op) against the exact rotation (fp64) and
    against TE's fused semantics (fp32 math, one rounding at the end): both within 2 eps of the
    pair magnitude (4 for bf16 under the interpreter, which truncates)."""
    g = torch.Generator().manual_seed(3)
    t = torch.randn((6, 2, 3, 16), generator=g).to(dtype)
    freqs = _random_freqs(6, 16)
    (t_dev, f_dev) = _on(t, freqs)
    out = fused_apply_rotary_pos_emb(t_dev, f_dev, interleaved=interleaved)

    def rotation(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        if interleaved:
            swapped = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
        else:
            swapped = torch.cat((-x[..., 8:], x[..., :8]), -1)
        return x * torch.cos(f) + swapped * torch.sin(f)

    exact = rotation(t.double(), freqs.double()).to(dtype)  # rounded once, from fp64
    te_like = rotation(t.float(), freqs).to(dtype)  # TE: fp32 cos/sin and math, one rounding
    k = _k(dtype, True) + 0.5  # + the single rounding of the comparand
    _assert_rope_close(out, exact, t, 16, interleaved, k)
    _assert_rope_close(out, te_like, t, 16, interleaved, k)


@triton_test
def test_triton_fallbacks_are_logged_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp64 and per-head angles take the torch path, each reason logged once; learned angles
    keep plain autograd; ``MEGATRON_ROCM_KERNELS=reference`` forces the torch path."""
    monkeypatch.setattr(_runtime, "_logged", set())
    t, freqs = _on(torch.randn(4, 2, 3, 8), _random_freqs(4, 8))
    caplog.set_level(logging.WARNING, logger="megatron_rocm.runtime.kernels")
    for _ in range(2):
        assert _path(lambda x: fused_apply_rotary_pos_emb(x, freqs.double()), t.double()) == (
            "torch"
        )
        per_head = freqs.expand(4, 1, 3, 8)
        out = fused_apply_rotary_pos_emb(t, per_head)
        torch.testing.assert_close(out.cpu(), rope_reference(t.cpu(), per_head.cpu()))
    messages = [r.getMessage() for r in caplog.records]
    assert sum("float64" in m for m in messages) == 1, messages
    assert sum("not [s, 1|b, 1, rot]" in m for m in messages) == 1, messages

    learned = freqs.clone().requires_grad_()
    assert _path(lambda x: fused_apply_rotary_pos_emb(x, learned), t) == "autograd"
    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "reference")
    assert _path(lambda x: fused_apply_rotary_pos_emb(x, freqs), t) == "torch"


@pytest.mark.triton
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_plan_heuristics(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_rocm.runtime.kernels import rope_triton as tri

    t = tri.Tuning(tile=2048, elems_per_thread=64, programs_per_sm=16)
    # Enough positions to fill the GPU: one program owns the whole batch (angles computed once).
    assert tri.plan(8192, 8, 12, 128, 128, True, sms=132, tuning=t).rows_per_program == 8
    # Fewer: the batch is split so the grid still fills it (2048 positions x 2 on 132 SMs).
    assert tri.plan(2048, 8, 12, 128, 128, True, sms=132, tuning=t).rows_per_program == 4
    assert tri.plan(16, 64, 4, 128, 128, True, sms=132, tuning=t).rows_per_program == 1
    # Per-batch angles or thd positions: one batch entry per program.
    assert tri.plan(8192, 8, 12, 128, 128, False, sms=132, tuning=t).rows_per_program == 1
    p = tri.plan(2048, 8, 12, 128, 64, True, sms=132, tuning=t)
    assert p.block_q * (64 + 64) <= t.tile and p.num_warps == 1  # d=128: one warp
    assert tri.plan(4096, 1, 4, 128, 128, False, sms=132, tuning=t).block_q == 4  # = heads
    wide = dataclasses.replace(t, tile=4096, elems_per_thread=16)  # 4096 / (32 * 16) = 8
    assert tri.plan(8192, 8, 32, 128, 128, True, tuning=wide).num_warps == 8
    monkeypatch.setattr(tri, "is_hip", lambda: True)  # 64-wide wavefronts: half the warps
    assert tri.plan(8192, 8, 32, 128, 128, True, tuning=wide).num_warps == 4


@pytest.mark.slow  # not ``triton``: it compiles, so the interpreter's child run skips it
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.skipif(INTERPRETER, reason="TRITON_INTERPRET=1 replaces the compiled kernel")
@pytest.mark.parametrize(
    ("backend", "arch", "vector_load"),
    [("cuda", 90, "ld.global.v4.b32"), ("hip", "gfx942", "global_load_dwordx4")],
    ids=["sm90", "gfx942"],
)
@pytest.mark.parametrize("interleaved", [False, True])
def test_kernel_compiles_for_gpus(backend: str, arch: object, vector_load: str, interleaved: bool):
    """The real compiler (no GPU needed: Triton ships ptxas and the AMD linker) accepts the
    kernel for H100 and MI300, with libdevice/ocml trigonometry and 16-byte bf16 row loads.
    The interpreter cannot show either: it runs the kernel as numpy."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megatron_rocm.runtime.kernels import rope_triton as tri

    if not triton.__version__.startswith(("3.4", "3.5", "3.6")):
        pytest.skip("ASTSource's signature format is only known for Triton 3.4-3.6")
    fn = tri._rope_kernel
    pointers = {"x_ptr": "*bf16", "f_ptr": "*fp32", "pos_ptr": "*i64", "y_ptr": "*bf16"}
    constants = {"HALF": 32, "HALF_P": 32, "PASS": 64, "PASS_P": 64, "BLOCK_Q": 16}
    constants |= {"INTERLEAVED": interleaved, "INVERSE": True, "HAS_POS": interleaved}
    constants["PRECISE"] = True
    signature = {n: pointers.get(n, "constexpr" if n in constants else "i32") for n in fn.arg_names}
    aligned = [*pointers, "sx0", "sx1", "sxh", "sf0"]  # what Triton's launcher finds at runtime
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    target = GPUTarget(backend, arch, 32 if backend == "cuda" else 64)
    kernel = triton.compile(
        ASTSource(fn, signature, constants, attrs),
        target=target,
        options={"num_warps": 1, "enable_fp_fusion": False},
    )
    asm = kernel.asm["ptx" if backend == "cuda" else "amdgcn"]
    assert vector_load in asm
    if backend == "cuda":  # precise cosf/sinf inlined, not the approximate hardware sine
        assert "__nv_cosf" in asm and "__nv_sinf" in asm and "sin.approx" not in asm
    else:
        assert "__ocml_cos_f32" in asm and "__ocml_sin_f32" in asm


# -- full size on a GPU --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [12, 4], ids=["q", "k"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gpu_parity(cuda_device: torch.device, interleaved: bool, heads: int) -> None:
    """The 0.85B Llama's q and k (s 2048, b 8, d 128, bf16): Triton equals the torch reference
    bit for bit on the GPU (same cosf/sinf, same op-by-op rounding) and is a rotation."""
    t = torch.randn(2048, 8, heads, 128, device=cuda_device, dtype=torch.bfloat16)
    freqs = _freqs(4096, 128).to(cuda_device)
    grad = torch.randn_like(t)
    out, dt = _grads(
        lambda x: fused_apply_rotary_pos_emb(x, freqs, interleaved=interleaved), t, grad
    )
    assert _last_path == "triton"
    ref, dref = _grads(lambda x: rope_reference(x, freqs[:2048], interleaved), t, grad)
    assert torch.equal(out, ref) and torch.equal(dt, dref)
    _assert_rope_close(out, ref, t, 128, interleaved, 2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("cp_rank", [0, 1])
def test_gpu_thd_cp2(cuda_device: torch.device, cp_rank: int) -> None:
    seqlens = [1024, 4096, 2052, 1020]  # global lengths, multiples of 2 * cp_size
    cu_seqlens = torch.tensor([0, *seqlens], device=cuda_device).cumsum(0).int()
    tokens = sum(seqlens) // 2
    t = torch.randn(tokens, 4, 128, device=cuda_device, dtype=torch.bfloat16)
    grad = torch.randn_like(t)
    freqs = _freqs(4096, 128).to(cuda_device)
    out, dt = _grads(
        lambda x: fused_apply_rotary_pos_emb_thd(x, cu_seqlens, freqs, 2, cp_rank), t, grad
    )
    assert _last_path == "triton"
    ref, dref = _grads(lambda x: rope_thd_reference(x, cu_seqlens, freqs, 2, cp_rank), t, grad)
    assert torch.equal(out, ref) and torch.equal(dt, dref)
