"""Kernel parity on this device: every path the patches replace, forward and backward, against
fp32 reference math (``refmath``). Runs on the GPU when there is one, on CPU otherwise (where the
kernels take their torch path, still worth checking: it is what CPU users and CI run).
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import math
import os
from collections.abc import Callable, Iterator
from types import ModuleType

import torch
from torch import Tensor

from megatron_rocm.envtools.smoke import refmath
from megatron_rocm.envtools.smoke.runner import CheckFailed, Context, Skip, register

# Norm-wise tolerance: max|got - ref| <= atol + rtol * max|ref|. Low-precision cases are judged
# against the fp32 reference, so their tolerance is that dtype's rounding, not the kernel's.
TOL = {torch.float32: (1e-5, 2e-5), torch.bfloat16: (1e-2, 1.6e-2), torch.float16: (1e-3, 4e-3)}


def _kernel(name: str) -> ModuleType:
    try:
        return importlib.import_module(f"megatron_rocm.runtime.kernels.{name}")
    except ImportError as e:
        raise CheckFailed(f"megatron_rocm.runtime.kernels.{name} does not import: {e}") from e


def _dtypes(ctx: Context) -> list[torch.dtype]:
    return [torch.float32, torch.bfloat16] if ctx.on_gpu else [torch.float32]


def _path(ctx: Context, t: Tensor, triton_kernel: str | None) -> str:
    """What ran: our Triton kernel ``triton_kernel`` (a name of ``_runtime.KERNELS``, asked
    the same way the kernel asks, so ``MEGATRON_ROCM_KERNELS=reference:<name>`` shows), or
    torch's native ops (fused ones on the GPU)."""
    if triton_kernel is None:
        return f"torch native, {t.device.type}"
    try:
        from megatron_rocm.runtime.kernels.launch import use_triton

        return "triton" if use_triton(t, kernel=triton_kernel) else "torch reference"
    except ImportError:
        return "unknown"


class _Tally:
    """Collects the worst relative error over cases; fails on the first case out of tolerance."""

    def __init__(self) -> None:
        self.cases = 0
        self.worst = 0.0

    def compare(self, label: str, got: Tensor, ref: Tensor, dtype: torch.dtype) -> None:
        if got.shape != ref.shape:
            raise CheckFailed(f"{label}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
        got, ref = got.detach().float(), ref.detach().float()
        if not torch.isfinite(got).all():
            raise CheckFailed(f"{label}: non-finite values in the kernel result")
        atol, rtol = TOL[dtype]
        scale = ref.abs().max().item() if ref.numel() else 0.0
        err = (got - ref).abs().max().item() if ref.numel() else 0.0
        if err > atol + rtol * scale:
            where = tuple(torch.nonzero((got - ref).abs() == err)[0].tolist())
            raise CheckFailed(
                f"{label}: max abs error {err:.3g} at {where} (allowed "
                f"{atol + rtol * scale:.3g}, max |ref| {scale:.3g})"
            )
        self.cases += 1
        self.worst = max(self.worst, err / (scale or 1.0))

    def summary(self, ctx: Context, sample: Tensor, triton_kernel: str | None = None) -> str:
        path = _path(ctx, sample, triton_kernel)
        return f"{self.cases} comparisons, worst rel err {self.worst:.2e} ({path})"


def _leaf(shape: tuple[int, ...], dtype: torch.dtype, ctx: Context, scale: float = 1.0) -> Tensor:
    return (torch.randn(shape, device=ctx.device) * scale).to(dtype).requires_grad_()


def _fwd_bwd(
    tally: _Tally,
    label: str,
    dtype: torch.dtype,
    fn: Callable[..., Tensor],
    ref_fn: Callable[..., Tensor],
    inputs: list[Tensor],
    fault: bool = False,
) -> Tensor:
    """Compare ``fn(*inputs)`` with ``ref_fn`` on fp32 copies, then the input gradients."""
    ref_inputs = [x.detach().float().requires_grad_(x.requires_grad) for x in inputs]
    out = fn(*inputs)
    ref = ref_fn(*ref_inputs)
    shown = out.roll(1, dims=-1) if fault else out  # MEGATRON_ROCM_SMOKE_FAULT: break the result
    tally.compare(f"{label} forward", shown, ref, dtype)
    grad = torch.randn_like(ref)
    out.backward(grad.to(out.dtype))
    ref.backward(grad)
    for i, (x, rx) in enumerate(zip(inputs, ref_inputs)):
        if x.requires_grad:
            tally.compare(f"{label} grad[{i}]", x.grad, rx.grad, dtype)
    return out


def _softmax_lengths(ctx: Context) -> list[int]:
    return [1, 37, 1024, 8192] if ctx.on_gpu else [1, 37, 128]


@register("kernels.softmax.causal")
def softmax_causal(ctx: Context) -> str:
    """ScaledUpperTriangMaskedSoftmax (causal) vs reference, forward and backward."""
    k, tally, fault = _kernel("softmax"), _Tally(), ctx.fault == "softmax"
    for dtype in _dtypes(ctx):
        for s in _softmax_lengths(ctx):
            x = _leaf((2 if s > 4096 else 8, s, s), dtype, ctx, 3.0)
            _fwd_bwd(
                tally,
                f"{dtype} s={s}",
                dtype,
                lambda t: k.ScaledUpperTriangMaskedSoftmax.apply(t, 0.5),
                lambda t: refmath.causal_softmax(t, 0.5),
                [x],
                fault,
            )
    return tally.summary(ctx, torch.empty(0, device=ctx.device), triton_kernel="softmax")


@register("kernels.softmax.masked")
def softmax_masked(ctx: Context) -> str:
    """ScaledMaskedSoftmax (boolean padding mask, True = masked) vs reference."""
    k, tally, fault = _kernel("softmax"), _Tally(), ctx.fault == "softmax"
    for dtype in _dtypes(ctx):
        for sk in _softmax_lengths(ctx):
            sq = 16 if sk > 1024 else max(sk, 1)
            x = _leaf((2, 4, sq, sk), dtype, ctx, 3.0)
            mask = torch.rand(2, 1, sq, sk, device=ctx.device) < 0.3
            mask[..., 0] = False  # no fully masked rows: Apex and torch define those differently
            _fwd_bwd(
                tally,
                f"{dtype} sq={sq} sk={sk}",
                dtype,
                lambda t, m=mask: k.ScaledMaskedSoftmax.apply(t, m, 0.7),
                lambda t, m=mask: refmath.masked_softmax(t, m, 0.7),
                [x],
                fault,
            )
    return tally.summary(ctx, torch.empty(0, device=ctx.device), triton_kernel="softmax")


@register("kernels.softmax.scaled")
def softmax_scaled(ctx: Context) -> str:
    """ScaledSoftmax (no mask) vs reference."""
    k, tally, fault = _kernel("softmax"), _Tally(), ctx.fault == "softmax"
    for dtype in _dtypes(ctx):
        for sk in _softmax_lengths(ctx):
            x = _leaf((2, 4, 16, sk), dtype, ctx, 3.0)
            _fwd_bwd(
                tally,
                f"{dtype} sk={sk}",
                dtype,
                lambda t: k.ScaledSoftmax.apply(t, 1.3),
                lambda t: refmath.plain_softmax(t, 1.3),
                [x],
                fault,
            )
    avail = k.is_kernel_available(torch.bfloat16, 4096, 16384)
    if ctx.on_gpu and not avail:
        raise CheckFailed("is_kernel_available(bf16, 4096, 16384) is False on a GPU")
    return tally.summary(ctx, torch.empty(0, device=ctx.device), triton_kernel="softmax")


@contextlib.contextmanager
def _triton_norms_at_every_size(k: ModuleType) -> Iterator[None]:
    """By default the Triton kernel takes only norm calls of ``TRITON_NORM_MIN_ELEMENTS`` or
    more, far above this check's shapes; name the default norms for the check's duration (as
    an explicit ``MEGATRON_ROCM_TRITON_NORMS`` does for every size), so their kernel is what
    the check compares. A value the user set is kept."""
    before = os.environ.get(k.TRITON_NORMS_ENV)
    if (before or "").strip():
        yield
        return
    os.environ[k.TRITON_NORMS_ENV] = ",".join(k.TRITON_NORMS)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(k.TRITON_NORMS_ENV, None)
        else:
            os.environ[k.TRITON_NORMS_ENV] = before


def _norm_check(ctx: Context, normalization: str) -> str:
    k = _kernel("norm")
    with _triton_norms_at_every_size(k):
        return _norm_cases(ctx, normalization, k)


def _norm_cases(ctx: Context, normalization: str, k: ModuleType) -> str:
    tally = _Tally()
    hiddens, rows = (64, 1000, 4096), (3, 5)
    for dtype in _dtypes(ctx):
        for hidden in hiddens:
            for zc in (False, True):
                mod = k.FusedNorm(
                    hidden,
                    eps=1e-5,
                    normalization=normalization,
                    zero_centered_gamma=zc,
                    params_dtype=dtype,
                    device=ctx.device,
                )
                params = dict(mod.named_parameters())
                with torch.no_grad():
                    for p in params.values():
                        p.copy_(torch.randn_like(p) * 0.1 + (0 if zc else 1))
                x = _leaf((*rows, hidden), dtype, ctx)
                rp = {n: p.detach().float().requires_grad_() for n, p in params.items()}
                if normalization == "LayerNorm":

                    def ref_fn(t: Tensor, rp: dict = rp, zc: bool = zc) -> Tensor:
                        return refmath.layer_norm(t, rp["weight"], rp["bias"], 1e-5, zc)
                else:

                    def ref_fn(t: Tensor, rp: dict = rp, zc: bool = zc) -> Tensor:
                        return refmath.rms_norm(t, rp["weight"], 1e-5, zc)

                label = f"{dtype} h={hidden} zero_centered={zc}"
                _fwd_bwd(tally, label, dtype, mod, ref_fn, [x])
                for n, p in params.items():
                    tally.compare(f"{label} d{n}", p.grad, rp[n].grad, dtype)
    # the routing each call took (LayerNorm stays on torch's unless MEGATRON_ROCM_TRITON_NORMS
    # names it); the label says triton only if every shape went there
    routed = [k.triton_serves(normalization, math.prod(rows) * hidden) for hidden in hiddens]
    served = "norm" if all(routed) else None
    return tally.summary(ctx, torch.empty(0, device=ctx.device), triton_kernel=served)


@register("kernels.norm.layernorm")
def norm_layernorm(ctx: Context) -> str:
    """FusedNorm(LayerNorm), with and without zero-centred gamma: output, dx, dweight, dbias."""
    return _norm_check(ctx, "LayerNorm")


@register("kernels.norm.rmsnorm")
def norm_rmsnorm(ctx: Context) -> str:
    """FusedNorm(RMSNorm), with and without zero-centred gamma: output, dx, dweight."""
    return _norm_check(ctx, "RMSNorm")


@register("kernels.rope")
def rope(ctx: Context) -> str:
    """fused_apply_rotary_pos_emb (sbhd; full, partial and interleaved) and the thd variant."""
    k, tally = _kernel("rope"), _Tally()
    for dtype in _dtypes(ctx):
        for d, rot, inter in ((64, 64, False), (128, 64, False), (64, 64, True)):
            s = 33
            base = torch.rand(s, 1, 1, rot // 2, device=ctx.device) * 6
            freqs = base.repeat_interleave(2, -1) if inter else torch.cat([base, base], -1)
            x = _leaf((s, 2, 4, d), dtype, ctx)
            _fwd_bwd(
                tally,
                f"sbhd {dtype} d={d} rot={rot} interleaved={inter}",
                dtype,
                lambda t, f=freqs, i=inter: k.fused_apply_rotary_pos_emb(t, f, interleaved=i),
                lambda t, f=freqs, i=inter: refmath.rope(t, f, i),
                [x],
            )
        cu = torch.tensor([0, 7, 20, 33], device=ctx.device, dtype=torch.int32)
        base = torch.rand(33, 1, 1, 32, device=ctx.device) * 6
        freqs = torch.cat([base, base], -1)
        x = _leaf((33, 4, 64), dtype, ctx)
        _fwd_bwd(
            tally,
            f"thd {dtype}",
            dtype,
            lambda t, cu=cu, f=freqs: k.fused_apply_rotary_pos_emb_thd(t, cu, f),
            lambda t, cu=cu, f=freqs: refmath.rope_thd(t, cu, f),
            [x],
        )
    return tally.summary(ctx, torch.empty(0, device=ctx.device), triton_kernel="rope")


@register("kernels.swiglu")
def swiglu(ctx: Context) -> str:
    """The swiglu patch's bias-free SwiGLU (``NativeSwiGLU``), fwd + bwd, odd widths."""
    k, tally = _kernel("swiglu"), _Tally()

    def fallback_back(g: Tensor, y: Tensor) -> Tensor:  # off the GPU: autograd of the math
        with torch.enable_grad():
            y32 = y.detach().float().requires_grad_()
            (dy,) = torch.autograd.grad(refmath.swiglu(y32), y32, g.float())
        return dy.to(y.dtype)

    def fallback(y: Tensor) -> Tensor:
        return refmath.swiglu(y).to(y.dtype)

    for dtype in _dtypes(ctx):
        for ffn in (1, 37, 1376, 5504):
            y = _leaf((3, 5, 2 * ffn), dtype, ctx, scale=3.0)
            _fwd_bwd(
                tally,
                f"{dtype} F={ffn}",
                dtype,
                lambda t: k.NativeSwiGLU.apply(t, fallback, fallback_back),
                refmath.swiglu,
                [y],
            )
    return tally.summary(ctx, torch.empty(0, device=ctx.device), triton_kernel="swiglu")


@register("kernels.grad_accum")
def grad_accum(ctx: Context) -> str:
    """wgrad_gemm_accum_fp32/fp16: main_grad += grad_output^T @ total_input, in place."""
    k, tally = _kernel("grad_accum"), _Tally()
    for dtype in _dtypes(ctx):
        x = torch.randn(96, 40, device=ctx.device).to(dtype)
        g = torch.randn(96, 24, device=ctx.device).to(dtype)
        main = torch.randn(24, 40, device=ctx.device)
        ref = main + g.float().t() @ x.float()
        k.wgrad_gemm_accum_fp32(x, g, main)
        tally.compare(f"fp32 accum {dtype}", main, ref, dtype)
        main16 = torch.randn(24, 40, device=ctx.device).to(dtype)
        ref16 = main16.float() + g.float().t() @ x.float()
        k.wgrad_gemm_accum_fp16(x, g, main16)
        tally.compare(f"fp16 accum {dtype}", main16, ref16, dtype)
    return tally.summary(ctx, torch.empty(0, device=ctx.device))


@register("kernels.optimizer")
def optimizer(ctx: Context) -> str:
    """FusedAdam (Apex keywords) for 5 steps vs the AdamW and Adam+L2 update rules."""
    k, tally = _kernel("optimizer"), _Tally()
    for adam_w in (True, False):
        p = torch.nn.Parameter(torch.randn(1000, device=ctx.device))
        start = p.detach().clone()
        opt = k.FusedAdam(
            [p], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adam_w_mode=adam_w
        )
        grads = [torch.randn(1000, device=ctx.device) for _ in range(5)]
        for g in grads:
            p.grad = g.clone()
            opt.step()
        ref = refmath.adam_steps(start, grads, 1e-2, (0.9, 0.95), 1e-8, 0.1, adam_w)
        tally.compare(f"adam_w_mode={adam_w}", p, ref, torch.float32)
    return tally.summary(ctx, torch.empty(0, device=ctx.device))


@register("kernels.multi_tensor")
def multi_tensor(ctx: Context) -> str:
    """multi_tensor_applier with multi_tensor_l2norm (total and per tensor) and _scale (into
    other tensors and in place, as the gradient clip calls it)."""
    k, tally = _kernel("multi_tensor"), _Tally()
    noop = torch.zeros(1, dtype=torch.int, device=ctx.device)
    ts = [torch.randn(n, device=ctx.device) for n in (1, 100, 4097, 65536)]
    norm, per = k.multi_tensor_applier(k.multi_tensor_l2norm, noop, [ts], True)
    ref = torch.cat([t.double() for t in ts]).norm().float()
    tally.compare("l2norm total", norm.reshape(-1)[:1], ref.reshape(1), torch.float32)
    ref_per = torch.stack([t.double().norm() for t in ts]).float()
    tally.compare("l2norm per tensor", per.reshape(-1), ref_per, torch.float32)
    out = [torch.empty_like(t) for t in ts]
    k.multi_tensor_applier(k.multi_tensor_scale, noop, [ts, out], 0.25)
    for i, (t, o) in enumerate(zip(ts, out)):
        tally.compare(f"scale[{i}]", o, t * 0.25, torch.float32)
    k.multi_tensor_applier(k.multi_tensor_scale, noop, [out, out], 2.0)  # in place: the clip
    for i, (t, o) in enumerate(zip(ts, out)):
        tally.compare(f"scale in place[{i}]", o, t * 0.5, torch.float32)
    if noop.item() != 0:
        raise CheckFailed("noop/overflow flag set on finite inputs")
    return tally.summary(ctx, ts[0])


def _mask_types() -> type[enum.Enum]:
    """Megatron's AttnMaskType when a tree is importable, else a stand-in with its values."""
    try:
        from megatron.core.transformer.enums import AttnMaskType

        return AttnMaskType
    except ImportError:
        return enum.Enum(
            "AttnMaskType",
            {"padding": 1, "causal": 2, "no_mask": 3, "padding_causal": 4, "arbitrary": 5},
        )


@register("kernels.local_sdpa")
def attention(ctx: Context) -> str:
    """sdpa_attention (MHA and GQA, causal and no mask) vs softmax(QK^T)V, forward and backward."""
    k, tally, amt = _kernel("local_sdpa"), _Tally(), _mask_types()
    if not k.sdpa_enabled():
        raise Skip("SDPA attention is turned off (MEGATRON_ROCM_LOCAL_SDPA=0)")
    for dtype in _dtypes(ctx):
        for heads, groups in ((4, 4), (8, 2)):
            for mtype in (amt.causal, amt.no_mask):
                if not k.sdpa_supported(mtype, None):
                    raise CheckFailed(f"sdpa_supported({mtype.name}, None) is False")
                s = 128 if ctx.on_gpu else 32
                q = _leaf((s, 2, heads, 64), dtype, ctx)
                kk = _leaf((s, 2, groups, 64), dtype, ctx)
                v = _leaf((s, 2, groups, 64), dtype, ctx)
                causal = mtype is amt.causal
                _fwd_bwd(
                    tally,
                    f"{dtype} heads={heads}/{groups} {mtype.name}",
                    dtype,
                    lambda a, b, c, m=mtype: k.sdpa_attention(a, b, c, None, m),
                    lambda a, b, c, cz=causal: refmath.attention(a, b, c, cz, None, None),
                    [q, kk, v],
                )
    return tally.summary(ctx, torch.empty(0, device=ctx.device))
