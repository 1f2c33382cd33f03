"""LayerNorm / RMSNorm without Apex or TransformerEngine.

Upstream's only Apex-free norm, ``WrappedTorchNorm``, asserts that sequence parallelism,
zero-centred gamma, ``persist_layer_norm`` and ``memory_efficient_layer_norm`` are all off
(``persist_layer_norm`` defaults to True in the training arguments), so a stock ROCm install
cannot build a model with the default flags. ``FusedNorm`` supports all of them:

* on a GPU (CUDA or ROCm) RMSNorm runs a Triton kernel
  (:mod:`~megatron_rocm.runtime.kernels.norm_triton`) on calls of at least
  ``TRITON_NORM_MIN_ELEMENTS``: one read of ``x`` forward, one read of ``x`` and ``dy`` backward
  with ``dw`` summed in the same pass, where torch's backward runs two kernels reading both
  twice (docs/kernels.md); smaller calls, LayerNorm (unless ``MEGATRON_ROCM_TRITON_NORMS`` names
  it), other dtype mixes and rows wider than one block use torch's fused ``layer_norm`` /
  ``rms_norm`` (a fallback's reason is logged once); ``MEGATRON_ROCM_KERNELS=reference[:norm]``
  forces torch's;
* zero-centred gamma stores ``weight - 1`` (initialised to zero) and normalises with
  ``1 + weight``, as Apex and TE do;
* sequence parallelism needs no change in the math: Megatron all-reduces the grads of params
  flagged ``sequence_parallel``, so we only set the flag;
* the persistent / memory-efficient flags select Apex kernel variants: accepted, ignored
  (the fused torch kernels already keep only what backward needs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_rocm.runtime import settings
from megatron_rocm.runtime.kernels.launch import log_fallback_once, use_triton

_NORMS = settings.choices("MEGATRON_ROCM_TRITON_NORMS")  # ("LayerNorm", "RMSNorm")
# The norms the Triton kernel serves on a GPU by default. Its LayerNorm is correct (tested)
# and, timed alone without the host (CUDA graphs, H100), faster than torch's at every hidden
# size measured; but in the GPT 0.85B at micro-batch 2 (4096-row calls) a controlled A/B ran
# 11-25% slower with it: the host's cost per call, and at that shape its backward's partial
# sums cost the GPU as much as it saved (docs/kernels.md). So LayerNorm stays on torch's
# kernel; TRITON_NORMS_ENV overrides it.
TRITON_NORMS = ("RMSNorm",)
TRITON_NORMS_ENV = "MEGATRON_ROCM_TRITON_NORMS"
# By default a norm call smaller than this stays on torch's kernel. The Triton path costs the
# host more per call than torch's C++ op (the Python around its launches inside the autograd
# Function: 0.4-0.5 ms more per forward and backward on the lent H100 hosts, twenty-third
# session), and saves the GPU 2-3 us per million elements at large row counts (the backward).
# On a step the host bounds only the host's cost counts: the Llama 0.85B at micro-batch 2
# (4096 x 1536 per call) ran 12-18% slower with its RMSNorm on Triton; on a step the GPU
# bounds only the GPU's: at micro-batch 16 (32768 x 1536) Triton took 2% off. The threshold
# sits between those two shapes and assumes that small calls come from steps of small GEMMs,
# which the host bounds; that is a rule of thumb, not a measurement between them: sequence,
# tensor and context parallelism shrink a GPU-bound step's calls too, and a faster host moves
# the line (docs/kernels.md). MEGATRON_ROCM_TRITON_NORMS=RMSNorm routes every size.
TRITON_NORM_MIN_ELEMENTS = 1 << 24


def triton_norms() -> tuple[str, ...]:
    """The norms the Triton kernel serves: ``MEGATRON_ROCM_TRITON_NORMS`` (a comma-separated
    subset of LayerNorm, RMSNorm, for A/B runs in a model with nothing else changed) or, unset,
    ``TRITON_NORMS``. A name outside that set raises, so a typo cannot silently benchmark the
    default; ``MEGATRON_ROCM_KERNELS=reference:norm`` still puts every norm on torch's path."""
    return settings.get(TRITON_NORMS_ENV) or TRITON_NORMS  # type: ignore[return-value]


def triton_serves(normalization: str, elements: int) -> bool:
    """Whether the Triton kernel takes a ``normalization`` call over ``elements`` elements:
    any size for a norm ``MEGATRON_ROCM_TRITON_NORMS`` names, else a norm of ``TRITON_NORMS``
    on calls of ``TRITON_NORM_MIN_ELEMENTS`` or more (the host's cost per call, above)."""
    named = settings.get(TRITON_NORMS_ENV)  # every norm call asks: parsed once per text
    if named:
        return normalization in named  # type: ignore[operator]
    return normalization in TRITON_NORMS and elements >= TRITON_NORM_MIN_ELEMENTS


class FusedNorm(torch.nn.Module):
    """LayerNorm or RMSNorm over the last dimension with Megatron's parameter conventions.

    State-dict keys are ``weight`` (and ``bias`` for LayerNorm), the same names as
    ``torch.nn.LayerNorm``, Apex's ``FusedLayerNorm`` and TE's norms, so checkpoints move
    between implementations.
    """

    # main's LayerNormInterface: this norm does not fuse the residual add.
    returns_residual = False

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | int | None = None,
        persist_layer_norm: bool = False,
        memory_efficient_layer_norm: bool = False,
    ) -> None:
        super().__init__()
        if normalization not in _NORMS:
            raise ValueError(f"normalization must be one of {_NORMS}, got {normalization!r}")
        if normalization == "RMSNorm" and not hasattr(F, "rms_norm"):
            raise RuntimeError("RMSNorm needs torch >= 2.4 (torch.nn.functional.rms_norm)")
        self.normalization = normalization
        self.hidden_size = int(hidden_size)
        self.normalized_shape = (self.hidden_size,)
        self.eps = float(eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.sequence_parallel = bool(sequence_parallel)
        factory = {"device": device, "dtype": params_dtype}
        self.weight = torch.nn.Parameter(torch.empty(self.hidden_size, **factory))
        if normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.empty(self.hidden_size, **factory))
        else:
            self.register_parameter("bias", None)
        for param in self.parameters():
            # Megatron all-reduces grads of params carrying this flag across the TP group.
            param.sequence_parallel = self.sequence_parallel
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_norm_parameters(self.weight, self.bias, self.zero_centered_gamma)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_norm(
            x, self.weight, self.bias, self.eps, self.normalization, self.zero_centered_gamma
        )

    def extra_repr(self) -> str:
        return (
            f"{self.normalization}, hidden_size={self.hidden_size}, eps={self.eps}, "
            f"zero_centered_gamma={self.zero_centered_gamma}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


def reset_norm_parameters(
    weight: torch.Tensor, bias: torch.Tensor | None, zero_centered_gamma: bool
) -> None:
    """gamma = 1 (0 when zero-centred: the math uses 1 + gamma), beta = 0; meta params stay.

    ``FusedNorm`` and the native backend's norm-in-front-of-a-linear share it."""
    if weight.device.type == "meta":
        return
    with torch.no_grad():
        if zero_centered_gamma:
            weight.zero_()
        else:
            weight.fill_(1.0)
        if bias is not None:
            bias.zero_()


def apply_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    normalization: str = "LayerNorm",
    zero_centered_gamma: bool = False,
) -> torch.Tensor:
    """The norm as a function of its parameters: ``FusedNorm`` and the native backend's
    norm-in-front-of-a-linear (``TELayerNormColumnParallelLinear``) share it."""
    gamma = weight + 1 if zero_centered_gamma else weight
    # An fp32 input with low-precision params (fp32 residual stream) upcasts exactly; the
    # other mix is left to torch, which normalises in fp32 with the fp32 gamma.
    if gamma.dtype != x.dtype and x.dtype == torch.float32:
        gamma = gamma.to(x.dtype)
    if triton_serves(normalization, x.numel()) and use_triton(x, kernel="norm"):
        reason = _triton_unsupported(x, gamma, bias)
        if reason is None:
            return _TritonNorm.apply(x, gamma, bias, eps, normalization == "RMSNorm")
        log_fallback_once(f"norm:{reason}", f"{normalization} on torch's kernels: {reason}")
    shape = (x.shape[-1],)
    if normalization == "LayerNorm":
        if bias is not None and bias.dtype != gamma.dtype and x.dtype == torch.float32:
            bias = bias.to(x.dtype)
        return F.layer_norm(x, shape, gamma, bias, eps)
    if normalization == "RMSNorm":
        return F.rms_norm(x, shape, gamma, eps)
    raise ValueError(f"normalization must be one of {_NORMS}, got {normalization!r}")


def _triton_unsupported(
    x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | None
) -> str | None:
    """Why the Triton kernel cannot take these tensors (None: it can)."""
    from megatron_rocm.runtime.kernels import norm_triton as kernel

    if x.shape[-1] == 0:
        return "empty rows"
    if x.dtype not in kernel.SUPPORTED_DTYPES:
        return f"input dtype {x.dtype}"
    if gamma.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return f"params in {gamma.dtype} with input in {x.dtype}"
    if x.shape[-1] > kernel.max_columns():
        return f"rows of {x.shape[-1]} > {kernel.max_columns()} columns"
    return None


class _TritonNorm(torch.autograd.Function):
    """LayerNorm / RMSNorm on the Triton kernels: one pass forward, one pass backward."""

    @staticmethod
    def forward(ctx, x, gamma, bias, eps, is_rms):  # noqa: ANN001, ANN205 - autograd signature
        from megatron_rocm.runtime.kernels import norm_triton as kernel

        x2d = x.reshape(-1, x.shape[-1])
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        y, mean, rstd = kernel.norm_forward(x2d, gamma, bias, eps, is_rms)
        ctx.save_for_backward(x2d, gamma, mean, rstd)
        ctx.has_bias, ctx.is_rms = bias is not None, is_rms
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205 - autograd signature
        from megatron_rocm.runtime.kernels import norm_triton as kernel

        x2d, gamma, mean, rstd = ctx.saved_tensors
        dy2d = grad.reshape(-1, grad.shape[-1])
        if dy2d.stride(-1) != 1:
            dy2d = dy2d.contiguous()
        dx, dw, db = kernel.norm_backward(dy2d, x2d, gamma, mean, rstd, ctx.has_bias, ctx.is_rms)
        return dx.view(grad.shape), dw, db, None, None


def param_device(config: Any) -> torch.device | str | int | None:
    """Where TE would create the params: cpu / meta / the current GPU (tags 0.12 .. main)."""
    if getattr(config, "use_cpu_initialization", False):
        return "cpu"
    if getattr(config, "init_model_with_meta_device", False):
        return "meta"
    if torch.cuda.is_available():
        return torch.cuda.current_device()
    return None


def build_norm(
    config: Any,
    hidden_size: int,
    eps: float = 1e-5,
    persist_layer_norm: bool = False,
    zero_centered_gamma: bool = False,
    normalization: str = "LayerNorm",
) -> FusedNorm:
    """A ``FusedNorm`` from a TransformerConfig; same signature as ``WrappedTorchNorm``.

    The last three arguments are the unused ones of ``WrappedTorchNorm.__new__``: like
    upstream, the config is the source of truth.
    """
    return FusedNorm(
        hidden_size,
        eps=eps,
        normalization=getattr(config, "normalization", "LayerNorm"),
        zero_centered_gamma=getattr(config, "layernorm_zero_centered_gamma", False),
        sequence_parallel=getattr(config, "sequence_parallel", False),
        params_dtype=getattr(config, "params_dtype", torch.float32),
        device=param_device(config),
    )


def norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    normalization: str = "LayerNorm",
) -> torch.Tensor:
    """Unfused fp32 math: the parity oracle for tests and the naive baseline for benchmarks."""
    xf = x.float()
    if normalization == "LayerNorm":
        mean = xf.mean(-1, keepdim=True)
        var = (xf - mean).pow(2).mean(-1, keepdim=True)
        y = (xf - mean) * torch.rsqrt(var + eps)
    else:
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
