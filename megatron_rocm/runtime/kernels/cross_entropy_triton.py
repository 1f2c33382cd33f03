"""Triton kernels of the vocab-parallel cross entropy: one read of the logits forward, one read
and one write backward, CUDA and ROCm.

Imported lazily by :mod:`megatron_rocm.runtime.kernels.cross_entropy`, so the package imports
without Triton. A program owns one row (one token) of the ``[tokens, vocab_shard]`` logits and
walks the vocabulary in ``BLOCK`` columns:

* ``_row_stats``: the row's max and ``sum(exp(x - max))`` (online, in fp32) and the target's
  logit when the target falls in this shard;
* ``_row_grad``: ``grad_out * (softmax - onehot)`` from the logits, the row's max and log-sum,
  written in the logits' dtype.

Upstream keeps an fp32 copy of the logits and its softmax (two more ``tokens x vocab`` fp32
tensors) for the backward; here only the logits (already in memory) and one fp32 per row are
kept.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from megatron_rocm.runtime.kernels import aot

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _block(columns: int) -> int:
    return min(8192, triton.next_power_of_2(columns))


@triton.jit
def _row_stats(
    logits,
    target,
    row_max,
    row_sumexp,
    target_logit,
    stride,
    columns,
    vocab_start,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, columns, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < columns, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, x)
        # lanes still at -inf (only masked columns so far) add nothing and must not make NaN
        scale = tl.where(new_m == float("-inf"), 0.0, tl.exp(m - new_m))
        s = s * scale + tl.where(cols < columns, tl.exp(x - new_m), 0.0)
        m = new_m
    mx = tl.max(m, axis=0)
    total = tl.sum(s * tl.where(m == float("-inf"), 0.0, tl.exp(m - mx)), axis=0)
    tl.store(row_max + row, mx)
    tl.store(row_sumexp + row, total)
    t = tl.load(target + row) - vocab_start
    inside = (t >= 0) & (t < columns)
    picked = tl.load(base + tl.where(inside, t, 0)).to(tl.float32)
    tl.store(target_logit + row, tl.where(inside, picked, 0.0))


@triton.jit
def _row_grad(
    logits,
    target,
    row_max,
    row_logsum,
    grad_out,
    grad_in,
    stride,
    grad_stride,
    columns,
    vocab_start,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    out = grad_in + row * grad_stride
    offs = tl.arange(0, BLOCK)
    mx = tl.load(row_max + row)
    logsum = tl.load(row_logsum + row)
    g = tl.load(grad_out + row).to(tl.float32)
    t = tl.load(target + row) - vocab_start
    for start in range(0, columns, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < columns, other=0.0).to(tl.float32)
        p = tl.exp((x - mx) - logsum)  # max first: exact for huge logits, as upstream
        d = g * (p - tl.where(cols == t, 1.0, 0.0))
        tl.store(out + cols, d.to(grad_in.dtype.element_ty), mask=cols < columns)


def row_stats(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``logits[rows, columns]``: max, ``sum(exp(x - max))``, target logit (fp32)."""
    rows, columns = logits.shape
    stats = torch.empty(3, rows, dtype=torch.float32, device=logits.device)
    if rows:
        _row_stats[(rows,)](
            logits,
            target,
            stats[0],
            stats[1],
            stats[2],
            logits.stride(0),
            columns,
            vocab_start,
            BLOCK=_block(columns),
            num_warps=8,
        )
    return stats[0], stats[1], stats[2]


def row_grad(
    logits: torch.Tensor,
    target: torch.Tensor,
    row_max: torch.Tensor,
    row_logsum: torch.Tensor,
    grad_out: torch.Tensor,
    vocab_start: int,
) -> torch.Tensor:
    """``grad_out[:, None] * (softmax(logits) - onehot(target))`` in the logits' dtype."""
    rows, columns = logits.shape
    grad = torch.empty_like(logits)
    if rows:
        _row_grad[(rows,)](
            logits,
            target,
            row_max,
            row_logsum,
            grad_out,
            grad,
            logits.stride(0),
            grad.stride(0),
            columns,
            vocab_start,
            BLOCK=_block(columns),
            num_warps=8,
        )
    return grad


def aot_configs(shapes: aot.Shapes) -> list[aot.Launch]:
    """Both launches for every vocabulary shard (``vocab / tp`` columns) and dtype."""
    out = []
    rows = max(shapes.seq_lens) * max(shapes.batch)
    f32 = torch.float32
    for vocab, tp, dt in itertools.product(shapes.vocabs, shapes.tp_sizes, shapes.dtypes):
        consts = dict(BLOCK=_block(vocab // tp))
        stats = dict(row_max=f32, row_sumexp=f32, target_logit=f32)
        out.append(
            aot.launch(
                _row_stats,
                consts,
                ptrs=dict(logits=dt, target="i64", **stats),
                num_warps=8,
                grid=(rows,),
            )
        )
        grads = dict(row_max=f32, row_logsum=f32, grad_out=f32, grad_in=dt)
        out.append(
            aot.launch(
                _row_grad,
                consts,
                ptrs=dict(logits=dt, target="i64", **grads),
                num_warps=8,
                grid=(rows,),
            )
        )
    return out
