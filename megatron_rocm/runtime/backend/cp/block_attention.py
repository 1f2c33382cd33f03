"""Attention on one (query block, key/value block) pair with its log-sum-exp, forward and backward.

Context-parallel attention splits one softmax row over several key blocks. Each block returns
its output and the log-sum-exp (lse) of its scores; ``SoftmaxMerger`` combines them exactly.
The backward of a block is given the *final* output and lse, so the probabilities a kernel
recomputes, ``exp(S - lse)``, are the global ones, and ``dS = P * (dP - rowsum(dO * O))`` is the
global gradient restricted to the block: no block needs another block's scores.

Kernels take ``[b, heads, s, d]`` views (key/value may have fewer heads: GQA) and return
``out [b, heads, sq, dv]`` in the input dtype and ``lse [b, heads, sq]`` in fp32:

* ``flash``: ``aten._scaled_dot_product_flash_attention`` (CUDA and ROCm; fp16/bf16, equal
  query/value head dims, a multiple of 8, at most 256). Grouped kv heads are native on CUDA.
* ``efficient``: ``aten._scaled_dot_product_efficient_attention`` (CUDA and ROCm; head dims
  multiples of 8; fp32 too).
* ``cudnn``: ``aten._scaled_dot_product_cudnn_attention`` (CUDA builds with cuDNN SDPA; no
  dropout; not under deterministic algorithms, which torch's SDPA honours the same way). What
  torch's SDPA itself picks on Hopper GPUs, and much faster there than ``flash``
  (FlashAttention-2), so a CP block on ``flash`` is slower than the one-GPU SDPA it replaces.
  ``auto``'s first choice on NVIDIA GPUs, but only after a probe: two key blocks merged by
  log-sum-exp and differentiated with the merged output and lse must give the math kernel's
  output and gradients, or ``auto`` moves on to ``flash`` (an explicit request fails with the
  reason). On 2 x H100, CP=2 training of a 0.85B Llama at 16k takes 1454 ms per iteration on
  cuDNN blocks against 1783 ms on flash blocks (docs/performance.md). ROCm has no
  cuDNN: there ``auto`` starts at ``flash``. Grouped kv heads go in as they are when a second
  probe (``group_size`` > 1) passes, else they are expanded first.
* ``cpu_flash``: ``aten._scaled_dot_product_flash_attention_for_cpu`` (CPU, no dropout).
* ``math``: fp32 matmuls (any device). It materialises the block's scores: a fallback only.

``MEGATRON_ROCM_CP_KERNEL`` (flash, efficient, cudnn, cpu_flash, math; default auto) picks one
explicitly; an explicit kernel that cannot run raises, an automatic fallback is logged once.

Dropout: the GPU kernels return their philox seed and offset, which go back into their
backward, so it regenerates the same mask; ``math`` draws one seed per block from the current
generator and regenerates its mask from that seed. Dropout is elementwise and the merge is
linear, so the merged output is exactly dropout applied to the global softmax.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F

from megatron_rocm.runtime import settings
from megatron_rocm.runtime.kernels.launch import (
    AOTRITON_ARCHS,
    is_hip,
    log_fallback_once,
    rocm_arch,
)

Tensor = torch.Tensor
aten = torch.ops.aten


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for merging and summing blocks; fp64 stays fp64 (tests check gradients in fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class SoftmaxMerger:
    """Running (output, lse) of one softmax whose keys arrive block by block, in fp32."""

    def __init__(self, like_query: Tensor, value_dim: int) -> None:
        b, heads, s, _ = like_query.shape
        kw = {"device": like_query.device, "dtype": accumulation_dtype(like_query.dtype)}
        self.out = torch.empty(b, heads, s, value_dim, **kw)
        self.lse = torch.empty(b, heads, s, **kw)

    def add(self, rows: slice, out: Tensor, lse: Tensor, *, first: bool = False) -> None:
        """Fold a block's result for query rows ``rows`` into the running softmax.

        ``first``: these rows have seen no block yet, so the block is copied, not merged.
        """
        acc_out, acc_lse = self.out[:, :, rows], self.lse[:, :, rows]
        if first:
            acc_out.copy_(out)
            acc_lse.copy_(lse)
            return
        new_lse = torch.logaddexp(acc_lse, lse)
        acc_out.mul_(torch.exp(acc_lse - new_lse).unsqueeze(-1))
        acc_out.add_(out.to(acc_out.dtype) * torch.exp(lse - new_lse).unsqueeze(-1))
        acc_lse.copy_(new_lse)


class BlockKernel:
    """One attention kernel with lse: ``forward`` -> (out, lse, state); ``backward`` -> grads."""

    name = "?"

    def unsupported(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> str | None:
        """Why this kernel cannot run these inputs (None when it can)."""
        raise NotImplementedError

    def native_gqa(self, q: Tensor, k: Tensor) -> bool:
        """Whether the kernel takes ``k``/``v`` with fewer heads than ``q`` as they are."""
        return False

    def _fwd(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, p: float):  # noqa: ANN202
        raise NotImplementedError

    def _bwd(self, do, q, k, v, out, lse, state, causal, scale, p):  # noqa: ANN001, ANN202
        raise NotImplementedError

    def _heads(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"{q.shape[1]} query heads do not group over {k.shape[1]} kv heads")
        if k.shape[1] == q.shape[1] or self.native_gqa(q, k):
            return k, v
        repeat = q.shape[1] // k.shape[1]
        return k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, dropout_p: float
    ) -> tuple[Tensor, Tensor, Any]:
        """``(out, lse, state)`` with ``lse`` natural (base e), whatever base the kernel uses."""
        k, v = self._heads(q, k, v)
        out, lse, state = self._fwd(q, k, v, causal, scale, dropout_p)
        to_e = lse_to_natural(self, q)
        return out, (lse if to_e == 1.0 else lse * to_e), state

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        state: Any,
        *,
        causal: bool,
        scale: float,
        dropout_p: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of this block given the global ``out`` and ``lse`` of its query rows."""
        ke, ve = self._heads(q, k, v)
        to_e = lse_to_natural(self, q)  # the kernel's backward takes its own base back
        lse = lse if to_e == 1.0 else lse / to_e
        dq, dk, dv = self._bwd(dout, q, ke, ve, out, lse, state, causal, scale, dropout_p)
        if ke is not k:  # expanded heads: sum each group's gradient back onto its kv head
            groups = k.shape[1]
            dk = dk.unflatten(1, (groups, -1)).sum(2)
            dv = dv.unflatten(1, (groups, -1)).sum(2)
        return dq, dk, dv


_LN2 = math.log(2.0)
_lse_factors: dict[tuple, float] = {}


def lse_to_natural(kernel: BlockKernel, q: Tensor) -> float:
    """What to multiply ``kernel``'s lse by to get a natural log-sum-exp: 1, or ln 2 for a
    kernel that returns base 2 (AOTriton <= 0.10, i.e. ROCm builds of torch <= 2.8:
    pytorch#156012, ROCm/aotriton#108). Found once per kernel, device, dtype and head dim by
    a probe on tiny inputs against ``logsumexp`` of explicit scores; merging blocks of any
    other scale would be silently wrong, so that raises, in one line."""
    if kernel.name == "math":  # ours: natural by construction
        return 1.0
    key = (kernel.name, str(q.device), q.dtype, q.shape[-1])
    if key not in _lse_factors:
        _lse_factors[key] = _probe_lse_base(kernel, q.device, q.dtype, q.shape[-1])
    return _lse_factors[key]


def _probe_lse_base(kernel: BlockKernel, device: torch.device, dtype: torch.dtype, dim: int):  # noqa: ANN202
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 1, 16, dim, generator=g).to(device, dtype) for _ in range(3))
    scale = 1.0 / math.sqrt(dim)
    with torch.no_grad():
        _, lse, _ = kernel._fwd(q, k, v, False, scale, 0.0)
        want = torch.logsumexp((q.double() @ k.double().transpose(-1, -2)) * scale, dim=-1)
    got = lse.double().reshape(want.shape)
    tol = 2e-2 * (1.0 + want.abs())
    if bool(((got - want).abs() <= tol).all()):
        return 1.0
    if bool(((got * _LN2 - want).abs() <= tol).all()):
        log_fallback_once(
            f"cp-lse-base2:{kernel.name}",
            f"context-parallel {kernel.name} blocks return their log-sum-exp in base 2 "
            "(AOTriton <= 0.10); converted to base e before merging",
        )
        return _LN2
    err = float((got - want).abs().max())
    raise RuntimeError(
        f"context-parallel {kernel.name} blocks: the kernel's log-sum-exp is neither base e nor "
        f"base 2 (max error {err:.3g} on a probe); blocks cannot be merged, set "
        "MEGATRON_ROCM_CP_KERNEL=math or upgrade torch"
    )


def _pad_lse(lse: Tensor, length: int) -> Tensor:
    """The kernels' backward wants the lse length their forward produced (CUDA pads to 32)."""
    lse = lse.contiguous()
    return lse if lse.shape[-1] == length else F.pad(lse, (0, length - lse.shape[-1]))


class FlashKernel(BlockKernel):
    name = "flash"

    def unsupported(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> str | None:
        if not q.is_cuda:
            return "needs a GPU"
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"needs fp16/bf16, got {q.dtype}"
        if q.shape[-1] != v.shape[-1] or q.shape[-1] % 8 or q.shape[-1] > 256:
            return f"needs equal q/v head dims, multiples of 8 and <= 256 (got {q.shape[-1]}, {v.shape[-1]})"
        if not torch.backends.cuda.flash_sdp_enabled():
            return "flash SDPA is disabled (torch.backends.cuda.enable_flash_sdp)"
        available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
        if not available():
            return "this torch build has no flash attention"
        if not is_hip() and torch.cuda.get_device_capability(q.device) < (8, 0):
            return "flash attention needs sm80 or newer"
        return _aotriton_problem(q.device)

    def native_gqa(self, q: Tensor, k: Tensor) -> bool:
        # ROCm's flash kernels of several torch releases reject grouped heads.
        return not is_hip()

    def _fwd(self, q, k, v, causal, scale, p):  # noqa: ANN001, ANN202
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            aten._scaled_dot_product_flash_attention(q, k, v, p, causal, False, scale=scale)
        )
        sq = q.shape[2]
        state = (cum_q, cum_k, max_q, max_k, seed, offset, lse.shape[-1])
        return out, lse[..., :sq].float(), state

    def _bwd(self, do, q, k, v, out, lse, state, causal, scale, p):  # noqa: ANN001, ANN202
        cum_q, cum_k, max_q, max_k, seed, offset, length = state
        return aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, out, _pad_lse(lse, length), cum_q, cum_k, max_q, max_k, p, causal,
            seed, offset, scale=scale,
        )  # fmt: skip


def _aotriton_problem(device: torch.device) -> str | None:
    """ROCm's flash and efficient SDPA are AOTriton's, compiled for a few GPUs only."""
    if not is_hip():
        return None
    arch = rocm_arch(device)
    if arch in AOTRITON_ARCHS:
        return None
    return f"has no AOTriton kernels for {arch or 'this GPU'} (ROCm builds ship {', '.join(sorted(AOTRITON_ARCHS))})"


class EfficientKernel(BlockKernel):
    name = "efficient"

    def unsupported(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> str | None:
        if not q.is_cuda:
            return "needs a GPU"
        if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"needs fp16/bf16/fp32, got {q.dtype}"
        if q.shape[-1] % 8 or v.shape[-1] % 8:
            return f"needs head dims that are multiples of 8 (got {q.shape[-1]}, {v.shape[-1]})"
        if not torch.backends.cuda.mem_efficient_sdp_enabled():
            return (
                "memory-efficient SDPA is disabled (torch.backends.cuda.enable_mem_efficient_sdp)"
            )
        return _aotriton_problem(q.device)

    def _fwd(self, q, k, v, causal, scale, p):  # noqa: ANN001, ANN202
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, p, causal, scale=scale
        )
        return out, lse[..., : q.shape[2]].float(), (seed, offset, lse.shape[-1])

    def _bwd(self, do, q, k, v, out, lse, state, causal, scale, p):  # noqa: ANN001, ANN202
        seed, offset, length = state
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, None, out, _pad_lse(lse, length), seed, offset, p,
            [True, True, True, False], causal, scale=scale,
        )  # fmt: skip
        return dq, dk, dv


class CudnnKernel(BlockKernel):
    name = "cudnn"

    def unsupported(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> str | None:
        if not q.is_cuda or is_hip():
            return "needs an NVIDIA GPU (cuDNN)"
        if dropout_p > 0:
            return "is used without dropout only"
        if deterministic_algorithms_required():
            # torch's own SDPA dispatcher skips cuDNN for the same reason (check_cudnn_deterministic)
            return "is not deterministic (torch.use_deterministic_algorithms, --deterministic-mode)"
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"needs fp16/bf16, got {q.dtype}"
        if q.shape[-1] != v.shape[-1] or q.shape[-1] % 8 or q.shape[-1] > 128:
            return f"needs equal q/v head dims, multiples of 8 and <= 128 (got {q.shape[-1]}, {v.shape[-1]})"
        if not hasattr(aten, "_scaled_dot_product_cudnn_attention"):
            return f"torch {torch.__version__} has no cuDNN attention op"
        if not getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)():
            return "cuDNN SDPA is disabled (torch.backends.cuda.enable_cudnn_sdp)"
        return _cudnn_probe(q.device, q.dtype, q.shape[-1])

    def native_gqa(self, q: Tensor, k: Tensor) -> bool:
        """Grouped kv heads as they are, if the probe says cuDNN handles them; else expanded.

        Expanding copies K/V ``heads / kv heads`` times per block and sums dK/dV back: for a
        Llama's 3:1 grouping that is ~3x the K/V traffic of every block, forward and backward.
        """
        group_size = q.shape[1] // k.shape[1]
        reason = _cudnn_probe(q.device, q.dtype, q.shape[-1], group_size)
        if reason is not None:
            log_fallback_once(
                f"cp-cudnn-gqa:{reason}",
                f"cuDNN context-parallel blocks expand grouped kv heads ({group_size} query "
                f"heads each): grouped heads {reason}",
            )
        return reason is None

    def _fwd(self, q, k, v, causal, scale, p):  # noqa: ANN001, ANN202
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, p, causal, False, scale=scale
            )
        )
        b, heads, sq = q.shape[:3]
        state = (cum_q, cum_k, max_q, max_k, seed, offset, tuple(lse.shape))
        return out, lse.reshape(b, heads, sq).float(), state

    def _bwd(self, do, q, k, v, out, lse, state, causal, scale, p):  # noqa: ANN001, ANN202
        cum_q, cum_k, max_q, max_k, seed, offset, lse_shape = state
        # attn_bias None: an undefined tensor (an empty one would be taken for a 1-D bias)
        return aten._scaled_dot_product_cudnn_attention_backward(
            laid_out_like(do, q), q, k, v, laid_out_like(out, q),
            lse.reshape(lse_shape).contiguous(), seed, offset, None, cum_q, cum_k, max_q, max_k,
            p, causal, scale=scale,
        )  # fmt: skip


def laid_out_like(x: Tensor, query: Tensor) -> Tensor:
    """``x`` (the output or its gradient, shaped like ``query``) with the query's strides.

    torch caches cuDNN's backward graph by the q/k/v layouts alone, yet bakes the output's and
    its gradient's strides into it: a later call with the same q/k/v but other strides for those
    two would reuse a wrong plan. One rule for every call keeps the cache right: they always
    have the query's strides, which is also what torch's own SDPA gives them (its forward
    allocates the output like the query). The CP schemes hand over ``[s, b, heads, d]`` views,
    as the query is, so this copies nothing there; the probe's merged fp32 output is copied.
    """
    if _addressing(x) == _addressing(query):
        return x
    return torch.empty_strided(query.shape, query.stride(), dtype=x.dtype, device=x.device).copy_(x)


def _addressing(x: Tensor) -> list[tuple[int, int]]:
    """(size, stride) of every dim but those of size 1, whose strides address nothing."""
    return [(n, st) for n, st in zip(x.shape, x.stride(), strict=True) if n > 1]


def deterministic_algorithms_required() -> bool:
    """``torch.use_deterministic_algorithms(True)`` without ``warn_only`` (upstream's
    ``--deterministic-mode`` turns it on)."""
    return torch.are_deterministic_algorithms_enabled() and not (
        torch.is_deterministic_algorithms_warn_only_enabled()
    )


@functools.lru_cache(maxsize=32)
def _cudnn_probe(
    device: torch.device, dtype: torch.dtype, dim: int, group_size: int = 1
) -> str | None:
    """None when cuDNN's kernel can serve a CP block, else why not.

    64 queries against 128 keys in two blocks (the causal diagonal, then 64 keys all visible),
    merged by log-sum-exp and differentiated with the merged output and lse, as the ring does:
    output and gradients must match fp64 math over all the keys. ``group_size`` > 1 gives the
    kernel ``group_size`` query heads per kv head as they are (GQA without expanding).
    """
    try:
        # The first CP call may come under no_grad or inference_mode (evaluation, inference):
        # the probe's reference needs autograd either way.
        with torch.inference_mode(False), torch.enable_grad():
            return _cudnn_probe_errors(device, dtype, dim, group_size)
    except Exception as exc:  # noqa: BLE001 - any failure means "do not use it"
        return f"failed its probe ({type(exc).__name__}: {exc})"[:300]


def _cudnn_probe_errors(
    device: torch.device, dtype: torch.dtype, dim: int, group_size: int
) -> str | None:
    """``_cudnn_probe``'s body: None, or how cuDNN's merged blocks differ from fp64 math."""
    gen = torch.Generator(device=device).manual_seed(0)
    kv_heads = 2

    def rand(tokens: int, heads: int = kv_heads) -> Tensor:
        # [s, b, heads, d] seen as [b, heads, s, d]: the layout the ring hands its blocks
        x = torch.randn(tokens, 1, heads, dim, device=device, generator=gen, dtype=dtype)
        return x.permute(1, 2, 0, 3)

    q_heads = kv_heads * group_size
    q, keys, values, do = rand(64, q_heads), rand(128), rand(128), rand(64, q_heads)
    scale, kernel = dim**-0.5, KERNELS["cudnn"]
    blocks = [(slice(0, 64), True), (slice(64, 128), False)]
    merger, states = SoftmaxMerger(q, dim), []
    for i, (cols, causal) in enumerate(blocks):
        kb, vb = keys[:, :, cols], values[:, :, cols]
        out, lse, state = kernel._fwd(q, kb, vb, causal, scale, 0.0)
        merger.add(slice(None), out, lse, first=i == 0)
        states.append(state)
    out = merger.out.to(dtype)
    grads = [
        kernel._bwd(
            do, q, keys[:, :, cols], values[:, :, cols], out, merger.lse, state, causal, scale,
            0.0,
        )
        for (cols, causal), state in zip(blocks, states)
    ]  # fmt: skip
    square = torch.ones(64, 64, dtype=torch.bool, device=device)
    visible = torch.cat([square.tril(), square], dim=1)  # the diagonal block, then all visible
    qf, kf, vf = (x.double().requires_grad_() for x in (q, keys, values))
    kx, vx = (x.repeat_interleave(group_size, dim=1) for x in (kf, vf))
    scores = (qf @ kx.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    reference = torch.softmax(scores, -1) @ vx
    reference.backward(do.double())
    got = {
        "out": out,
        "dq": grads[0][0] + grads[1][0],
        "dk": torch.cat([grads[0][1], grads[1][1]], 2),
        "dv": torch.cat([grads[0][2], grads[1][2]], 2),
    }
    want = {"out": reference, "dq": qf.grad, "dk": kf.grad, "dv": vf.grad}
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    for name, value in got.items():
        if value.shape != want[name].shape:
            return f"its probe gave {name} of shape {tuple(value.shape)}, not {tuple(want[name].shape)}"
        err = (value.double() - want[name]).abs().max().item()
        if not err <= tol * (1 + want[name].abs().max().item()):
            return f"its probe differs from fp64 math ({name}: max abs error {err:.3g})"
    return None


class CpuFlashKernel(BlockKernel):
    name = "cpu_flash"

    def unsupported(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> str | None:
        if q.is_cuda:
            return "runs on the CPU only"
        if dropout_p > 0:
            return "cannot replay dropout in its backward"
        if q.shape[-1] != v.shape[-1]:
            return f"needs equal q/v head dims (got {q.shape[-1]}, {v.shape[-1]})"
        return None

    def _fwd(self, q, k, v, causal, scale, p):  # noqa: ANN001, ANN202
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse.to(accumulation_dtype(q.dtype)), None

    def _bwd(self, do, q, k, v, out, lse, state, causal, scale, p):  # noqa: ANN001, ANN202
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale
        )


class MathKernel(BlockKernel):
    name = "math"

    def unsupported(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> str | None:
        return None

    @staticmethod
    def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
        acc = accumulation_dtype(q.dtype)
        scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
        if causal:
            sq, sk = scores.shape[-2:]
            upper = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(upper, float("-inf"))
        return scores

    @staticmethod
    def _keep(seed: int, like: Tensor, p: float) -> Tensor:
        generator = torch.Generator(device=like.device).manual_seed(seed)
        keep = torch.rand(like.shape, generator=generator, device=like.device) >= p
        return keep.to(like.dtype) / (1.0 - p)

    def _fwd(self, q, k, v, causal, scale, p):  # noqa: ANN001, ANN202
        scores = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1))
        seed = None
        if p > 0:
            seed = int(torch.randint(0, 2**62, (1,), device=q.device).item())
            probs = probs * self._keep(seed, probs, p)
        return torch.matmul(probs, v.to(probs.dtype)).to(q.dtype), lse, seed

    def _bwd(self, do, q, k, v, out, lse, seed, causal, scale, p):  # noqa: ANN001, ANN202
        probs = torch.exp(self._scores(q, k, causal, scale) - lse.unsqueeze(-1))
        acc = probs.dtype
        do_acc = do.to(acc)
        dprobs = torch.matmul(do_acc, v.to(acc).transpose(-1, -2))
        kept = probs
        if seed is not None:
            keep = self._keep(seed, probs, p)
            kept, dprobs = probs * keep, dprobs * keep
        dv = torch.matmul(kept.transpose(-1, -2), do_acc)
        delta = (do_acc * out.to(acc)).sum(-1, keepdim=True)
        dscores = probs * (dprobs - delta) * scale
        dq = torch.matmul(dscores, k.to(acc))
        dk = torch.matmul(dscores.transpose(-1, -2), q.to(acc))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


KERNELS: dict[str, BlockKernel] = {
    k.name: k
    for k in (FlashKernel(), EfficientKernel(), CudnnKernel(), CpuFlashKernel(), MathKernel())
}


def auto_order(q: Tensor) -> tuple[str, ...]:
    """The kernels ``auto`` tries, fastest first; each one's ``unsupported`` has the last word
    (``cudnn`` declines on ROCm, and on NVIDIA for any input or setting its kernel or probe
    cannot serve)."""
    return ("cudnn", "flash", "efficient") if q.is_cuda else ("cpu_flash",)


def requested_kernel() -> str:
    """The block kernel ``MEGATRON_ROCM_CP_KERNEL`` names (``auto`` if unset)."""
    return str(settings.get("MEGATRON_ROCM_CP_KERNEL"))


def pick_kernel(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float, order: tuple[str, ...] | None = None
) -> BlockKernel:
    """The fastest kernel that runs these inputs, the one ``MEGATRON_ROCM_CP_KERNEL`` names, or
    the first of ``order`` (the kernels ``--attention-backend`` names) that runs them."""
    if order is not None:
        reasons = []
        for name in order:
            reason = KERNELS[name].unsupported(q, k, v, dropout_p)
            if reason is None:
                return KERNELS[name]
            reasons.append(f"{name} {reason}")
        raise ValueError(
            "context-parallel attention: no kernel that --attention-backend names runs these "
            f"inputs ({'; '.join(reasons)}); use --attention-backend auto"
        )
    requested = requested_kernel()
    if requested != "auto":
        kernel = KERNELS[requested]
        reason = kernel.unsupported(q, k, v, dropout_p)
        if reason:
            raise ValueError(f"MEGATRON_ROCM_CP_KERNEL={requested}: this kernel {reason}")
        return kernel
    reasons = []
    for name in auto_order(q):
        reason = KERNELS[name].unsupported(q, k, v, dropout_p)
        if reason is None:
            if reasons and not is_hip():  # cuDNN declined on an NVIDIA GPU: say so, once
                why = "; ".join(reasons)
                log_fallback_once(
                    f"cp-kernel:{name}:{why}",
                    f"context-parallel attention runs {name} blocks ({why})",
                )
            return KERNELS[name]
        reasons.append(f"{name} {reason}")
    message = "; ".join(reasons)
    log_fallback_once(
        f"cp-math:{message}",
        f"context-parallel attention uses the unfused math kernel ({message})",
    )
    return KERNELS["math"]
