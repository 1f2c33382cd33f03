"""Reference math for the kernel parity checks, written from Megatron's definitions in fp32.

Deliberately independent of ``megatron_rocm.runtime.kernels.*_reference``: comparing a kernel with its
own fallback would prove nothing when both share a bug.
"""

from __future__ import annotations

import torch
from torch import Tensor

MASK_FILL = -10000.0  # what Apex's masked softmax writes into masked positions


def causal_softmax(x: Tensor, scale: float) -> Tensor:
    sq, sk = x.shape[-2:]
    future = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1)
    return torch.softmax((x.float() * scale).masked_fill(future, float("-inf")), dim=-1)


def masked_softmax(x: Tensor, mask: Tensor, scale: float) -> Tensor:
    return torch.softmax((x.float() * scale).masked_fill(mask, MASK_FILL), dim=-1)


def plain_softmax(x: Tensor, scale: float) -> Tensor:
    return torch.softmax(x.float() * scale, dim=-1)


def layer_norm(x: Tensor, w: Tensor, b: Tensor, eps: float, zero_centered: bool) -> Tensor:
    x = x.float()
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    gamma = w.float() + 1 if zero_centered else w.float()
    return (x - mu) * torch.rsqrt(var + eps) * gamma + b.float()


def rms_norm(x: Tensor, w: Tensor, eps: float, zero_centered: bool) -> Tensor:
    x = x.float()
    gamma = w.float() + 1 if zero_centered else w.float()
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * gamma


def swiglu(y: Tensor) -> Tensor:
    y1, y2 = torch.chunk(y.float(), 2, dim=-1)
    return torch.nn.functional.silu(y1) * y2


def _rotate_half(x: Tensor, interleaved: bool) -> Tensor:
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rope(t: Tensor, freqs: Tensor, interleaved: bool = False) -> Tensor:
    """t [s, b, h, d], freqs [s, 1, 1, rot]: rotate the first ``rot`` channels, pass the rest."""
    rot = freqs.shape[-1]
    x, rest = t[..., :rot].float(), t[..., rot:].float()
    x = x * freqs.cos() + _rotate_half(x, interleaved) * freqs.sin()
    return torch.cat((x, rest), dim=-1)


def rope_thd(t: Tensor, cu_seqlens: Tensor, freqs: Tensor, interleaved: bool = False) -> Tensor:
    """t [total, h, d] packed sequences; each restarts at position 0."""
    out = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        seq = t[start:end].unsqueeze(1)  # [s, 1, h, d]
        out.append(rope(seq, freqs[: end - start], interleaved).squeeze(1))
    return torch.cat(out)


def adam_steps(
    p: Tensor,
    grads: list[Tensor],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
) -> Tensor:
    """Apex FusedAdam semantics with bias correction: AdamW (decoupled) or Adam + L2."""
    p = p.detach().double().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    b1, b2 = betas
    for step, g in enumerate(grads, 1):
        g = g.double()
        if adam_w_mode:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mhat = m / (1 - b1**step)
        vhat = v / (1 - b2**step)
        p = p - lr * mhat / (vhat.sqrt() + eps)
    return p.float()


def attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Tensor | None, scale: float | None
) -> Tensor:
    """Megatron layout: q [sq, b, np, hn], k/v [sk, b, ng, hn] -> [sq, b, np*hn]."""
    sq, b, heads, hn = q.shape
    groups = k.shape[2]
    k = k.float().repeat_interleave(heads // groups, dim=2)
    v = v.float().repeat_interleave(heads // groups, dim=2)
    scale = hn**-0.5 if scale is None else scale
    scores = torch.einsum("qbnh,kbnh->bnqk", q.float(), k) * scale
    if causal:
        sk = k.shape[0]
        scores = scores.masked_fill(
            torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1), float("-inf")
        )
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bnqk,kbnh->qbnh", probs, v).reshape(sq, b, heads * hn)


def fp8_scale(amax: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """Per-tensor FP8 scaling (margin 0): torch's ``fp8_max / amax`` in fp32 on ``amax``'s
    device (a number over a tensor: the reciprocal, then a product; TE divides once, which
    can differ in the last bit), at most fp32's largest value; 1 where the amax is zero or
    not finite (TE's rule)."""
    amax = amax.detach().float()
    usable = (amax > 0) & torch.isfinite(amax)
    scale = torch.where(usable, torch.finfo(fp8_dtype).max / amax, torch.ones_like(amax))
    return scale.clamp(max=torch.finfo(torch.float32).max)


def fp8_cast(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """``x * scale`` in fp32, saturated to the format's range, cast by torch on ``x``'s device."""
    fp8_max = torch.finfo(fp8_dtype).max
    scaled = x.detach().float() * scale
    return scaled.clamp(-fp8_max, fp8_max).to(fp8_dtype)


def fp8_quantize(x: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per-tensor FP8 by ``x``'s own amax (current scaling): ``(x_fp8, scale)``."""
    scale = fp8_scale(x.detach().float().abs().amax(), fp8_dtype)
    return fp8_cast(x, scale, fp8_dtype), scale
