"""Triton kernel for rotary position embedding: one read of ``t``, one write, CUDA and ROCm.

Imported lazily by :mod:`megatron_rocm.runtime.kernels.rope`, so the package imports without
Triton. One kernel does forward and backward (``INVERSE``: the gradient is the inverse
rotation, ``R(-theta)``), sbhd and thd (``HAS_POS``: per-token positions into the angle table),
halves and interleaved pairs.

``t`` is seen as ``[R1, R2, H, D]`` (sbhd: ``[s, b, h, d]``; thd: ``[tokens, 1, h, d]``) with any
strides on the first three dims and the head dim contiguous. The angles are a table
``[F0, 1|R2, rot]`` indexed by ``(i, j)`` (sbhd) or by ``(pos[i], 0)`` (thd). The output is a new
contiguous ``[R1, R2, H, D]``.

A program owns one angle row: it computes ``cos``/``sin`` of its ``rot`` angles (fp32,
libdevice/ocml, so not the approximate hardware sine; once for both halves when they share
their angles, as Megatron's tables do) and rotates every head of every batch entry that shares
them, ``BLOCK_Q`` heads at a time. That amortises the trigonometry over ``H`` heads (times
``b`` when the batch shares the angles). Each thread evaluates it for the channels it holds,
so programs are narrow (one warp for d=128): more threads would repeat it more often.

Rounding is Megatron's unfused path, op by op: ``cos``/``sin`` are rounded to ``freqs``' dtype
and then to ``t``'s dtype, each product is rounded to ``t``'s dtype, then the sum; FMA
contraction is off, so fp32 inputs match torch's separate multiply and add as well.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice  # dispatches to CUDA's libdevice or ROCm's ocml

from megatron_rocm.runtime.kernels import aot
from megatron_rocm.runtime.kernels.launch import cdiv, interpreting, is_hip, sm_count

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch heuristics (a small table, no autotuning); scripts/bench/rope.py compares a few.

    Few warps per program on purpose: every thread computes ``cos``/``sin`` of the channels it
    owns, so more threads sharing one angle row means more repeated trigonometry.
    """

    tile: int = 2048  # elements of t (heads x padded head dim) per step of a program
    elems_per_thread: int = 64  # per step; sets num_warps (1 on NVIDIA and AMD for d=128)
    max_warps: int = 8
    programs_per_sm: int = 16  # fewer programs than this: split the batch over programs


_tuning = Tuning()


def get_tuning() -> Tuning:
    return _tuning


def set_tuning(tuning: Tuning) -> None:
    global _tuning
    _tuning = tuning


@triton.jit
def _cos_sin(f, F_DT: tl.constexpr, T_DT: tl.constexpr, PRECISE: tl.constexpr):
    """``cos``/``sin`` in fp32, rounded as ``torch.cos(freqs).to(t.dtype)`` rounds them."""
    f = f.to(tl.float32)
    if PRECISE:
        c = libdevice.cos(f)
        s = libdevice.sin(f)
    else:  # the interpreter (numpy) has no libdevice
        c = tl.cos(f)
        s = tl.sin(f)
    c = c.to(F_DT).to(T_DT).to(tl.float32)
    s = s.to(F_DT).to(T_DT).to(tl.float32)
    return c, s


@triton.jit
def _rnd(x, T_DT: tl.constexpr):
    """Round an fp32 value to t's dtype and back: one torch op's rounding."""
    return x.to(T_DT).to(tl.float32)


@triton.jit
def _rope_kernel(
    x_ptr,
    f_ptr,
    pos_ptr,
    y_ptr,
    R2,
    H,
    RB,
    sx0,
    sx1,
    sxh,
    sf0,
    sf1,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    PASS: tl.constexpr,
    PASS_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    INVERSE: tl.constexpr,
    HAS_POS: tl.constexpr,
    PRECISE: tl.constexpr,
):
    T_DT: tl.constexpr = y_ptr.dtype.element_ty
    F_DT: tl.constexpr = f_ptr.dtype.element_ty
    D: tl.constexpr = 2 * HALF + PASS
    i = tl.program_id(0).to(tl.int64)
    j0 = tl.program_id(1).to(tl.int64) * RB
    nq = tl.minimum(RB, R2 - j0) * H  # (batch, head) rows of this program, batch-major

    # The pair (first, second) of each rotated channel k: halves (k, k + rot/2) or
    # interleaved neighbours (2k, 2k + 1); each channel has its own angle, as in torch.
    k = tl.arange(0, HALF_P)
    km = k < HALF
    if HAS_POS:
        f_row = tl.load(pos_ptr + i).to(tl.int64) * sf0
    else:
        f_row = i * sf0 + j0 * sf1
    if INTERLEAVED:
        fa = tl.load(f_ptr + f_row + 2 * k, mask=km, other=0.0)
        fb = tl.load(f_ptr + f_row + 2 * k + 1, mask=km, other=0.0)
    else:
        fa = tl.load(f_ptr + f_row + k, mask=km, other=0.0)
        fb = tl.load(f_ptr + f_row + HALF + k, mask=km, other=0.0)
    ca, sa = _cos_sin(fa, F_DT, T_DT, PRECISE)
    if tl.max((fa != fb).to(tl.int32), 0) == 0:  # Megatron's tables: both halves share angles
        cb, sb = ca, sa
    else:
        cb, sb = _cos_sin(fb, F_DT, T_DT, PRECISE)
    if INVERSE:  # R(theta)^T: a' = a*ca + b*sb, b' = b*cb - a*sa
        sa, sb = -sb, -sa
    ca, sa, cb, sb = ca[None, :], sa[None, :], cb[None, :], sb[None, :]

    c = tl.arange(0, 2 * HALF_P)  # interleaved: the rotated channels as one contiguous tile
    cm = c < 2 * HALF
    y_base = (i * R2 + j0) * H * D
    for q0 in range(0, nq, BLOCK_Q):
        q = q0 + tl.arange(0, BLOCK_Q)
        qm = q < nq
        j = j0 + q // H
        x_row = i * sx0 + j * sx1 + (q % H) * sxh
        y_row = y_base + q * D
        if INTERLEAVED:  # load (a0, b0, a1, b1, ...) whole, split the pairs in registers
            m = qm[:, None] & cm[None, :]
            x = tl.load(x_ptr + x_row[:, None] + c[None, :], mask=m, other=0.0)
            a, b = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_Q, HALF_P, 2)))
        else:
            m = qm[:, None] & km[None, :]
            a = tl.load(x_ptr + x_row[:, None] + k[None, :], mask=m, other=0.0).to(tl.float32)
            b = tl.load(x_ptr + x_row[:, None] + HALF + k[None, :], mask=m, other=0.0)
            b = b.to(tl.float32)
        # torch: t*cos + rotate_half(t)*sin, every op rounded to t's dtype
        out_a = _rnd(_rnd(a * ca, T_DT) - _rnd(b * sa, T_DT), T_DT)
        out_b = _rnd(_rnd(b * cb, T_DT) + _rnd(a * sb, T_DT), T_DT)
        if INTERLEAVED:
            out = tl.reshape(tl.join(out_a, out_b), (BLOCK_Q, 2 * HALF_P)).to(T_DT)
            tl.store(y_ptr + y_row[:, None] + c[None, :], out, mask=m)
        else:
            tl.store(y_ptr + y_row[:, None] + k[None, :], out_a.to(T_DT), mask=m)
            tl.store(y_ptr + y_row[:, None] + HALF + k[None, :], out_b.to(T_DT), mask=m)
        if PASS > 0:  # channels past rot_dim are copied unchanged
            p = tl.arange(0, PASS_P)
            pm = qm[:, None] & (p < PASS)[None, :]
            v = tl.load(x_ptr + x_row[:, None] + 2 * HALF + p[None, :], mask=pm)
            tl.store(y_ptr + y_row[:, None] + 2 * HALF + p[None, :], v, mask=pm)


@dataclasses.dataclass(frozen=True)
class Plan:
    rows_per_program: int  # RB: batch entries (of R2) per program
    block_q: int
    num_warps: int


def plan(
    r1: int,
    r2: int,
    heads: int,
    head_dim: int,
    rot_dim: int,
    shared_angles: bool,
    sms: int = 132,
    tuning: Tuning | None = None,
) -> Plan:
    """Batch entries per program, heads per step and warps for a ``[r1, r2, heads, head_dim]``."""
    t = tuning or _tuning
    rb = 1
    if shared_angles:  # the batch shares each angle row: split it only to fill the GPU
        splits = min(r2, cdiv(sms * t.programs_per_sm, max(r1, 1)))
        rb = cdiv(r2, splits)
    width = 2 * triton.next_power_of_2(max(rot_dim // 2, 1))
    if head_dim > rot_dim:
        width += triton.next_power_of_2(head_dim - rot_dim)
    # tl.arange needs a power of two: the largest one that keeps a step within the tile (a
    # partial rotary dim makes ``width`` a sum of two powers of two, e.g. 128 + 32)
    fit = max(1, t.tile // width)
    block_q = min(triton.next_power_of_2(rb * heads), 1 << (fit.bit_length() - 1))
    warp_size = 64 if is_hip() else 32
    warps = (block_q * width) // (warp_size * t.elems_per_thread)
    warps = max(1, min(t.max_warps, 1 << max(warps, 1).bit_length() - 1))
    return Plan(rb, block_q, warps)


def rotate(
    x: torch.Tensor,
    angles: torch.Tensor,
    pos: torch.Tensor | None,
    interleaved: bool,
    inverse: bool,
) -> torch.Tensor:
    """Rotate ``x [R1, R2, H, D]`` (``x.stride(-1) == 1``) by ``angles [F0, 1|R2, rot]``.

    Row ``(i, j)`` takes angle row ``(i, j)`` (or ``(i, 0)`` when the table's second dim is 1);
    with ``pos`` (int64 ``[R1]``, already in range, ``R2 == 1``) it takes row ``pos[i]``.
    ``inverse`` applies the transposed rotation (the backward). Returns a contiguous tensor.
    """
    r1, r2, heads, head_dim = x.shape
    rot = angles.shape[-1]
    assert x.stride(-1) == 1 and angles.stride(-1) == 1 and rot % 2 == 0 and 0 < rot <= head_dim
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    sf1 = angles.stride(1) if angles.shape[1] > 1 else 0
    shared = sf1 == 0 and pos is None
    p = plan(r1, r2, heads, head_dim, rot, shared, sm_count(x.device))
    grid = (r1, cdiv(r2, p.rows_per_program))
    _rope_kernel[grid](
        x,
        angles,
        pos if pos is not None else angles,
        y,
        r2,
        heads,
        p.rows_per_program,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        angles.stride(0),
        sf1,
        **dict(
            constexprs(head_dim, rot, p, interleaved, inverse, pos is not None),
            PRECISE=not interpreting(),
        ),
        num_warps=p.num_warps,
        enable_fp_fusion=False,  # torch rounds a*b and then the sum: no FMA contraction
    )
    return y


def constexprs(head_dim: int, rot: int, p: Plan, interleaved: bool, inverse: bool, pos: bool):
    """The kernel's constexprs for a ``rot``-of-``head_dim`` rotation planned as ``p``."""
    half, n_pass = rot // 2, head_dim - rot
    return dict(
        HALF=half,
        HALF_P=triton.next_power_of_2(half),
        PASS=n_pass,
        PASS_P=triton.next_power_of_2(n_pass) if n_pass else 0,
        BLOCK_Q=p.block_q,
        INTERLEAVED=interleaved,
        INVERSE=inverse,
        HAS_POS=pos,
        PRECISE=True,
    )


def aot_configs(shapes: aot.Shapes, sms: int = 304) -> list[aot.Launch]:
    """The launches :func:`rotate` makes for ``shapes`` (sbhd with Megatron's shared angle
    table, and thd with positions; forward and backward, halves and interleaved)."""
    out = []
    for head_dim in shapes.head_dims:
        rots = {max(2, int(head_dim * f) // 2 * 2) for f in shapes.rotary_fractions}
        for rot, heads, seq, b, dt in itertools.product(
            sorted(rots), shapes.heads, shapes.seq_lens, shapes.batch, shapes.dtypes
        ):
            for thd in (False, True):
                r1, r2 = (seq * b, 1) if thd else (seq, b)
                p = plan(r1, r2, heads, head_dim, rot, not thd, sms)
                grid = (r1, cdiv(r2, p.rows_per_program))
                model = seq in shapes.model_seq_lens
                for inter, inv in itertools.product((False, True), (False, True)):
                    out.append(
                        aot.launch(
                            _rope_kernel,
                            constexprs(head_dim, rot, p, inter, inv, thd),
                            ptrs=dict(
                                x_ptr=dt,
                                f_ptr=torch.float32,
                                pos_ptr="i64",
                                y_ptr=dt,
                            ),
                            num_warps=p.num_warps,
                            grid=grid,
                            model_shape=model,
                            neutral=("INVERSE", "HAS_POS"),  # a sign; a scalar load
                            enable_fp_fusion=False,
                        )
                    )
    return out
