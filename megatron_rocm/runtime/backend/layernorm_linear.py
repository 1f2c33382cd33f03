"""TELayerNormColumnParallelLinear without TransformerEngine: the norm in the linear's input path.

The TE spec folds each block's input norm into the next column-parallel linear (``linear_qkv``
and ``linear_fc1`` own ``layer_norm_weight``/``layer_norm_bias``; the layer's own norms are
``IdentityOp``). Checkpoints therefore name the norm ``...linear_qkv.layer_norm_weight``; the
local spec maps its ``input_layernorm.weight`` onto that name. This module keeps TE's names,
parameter order and checkpoint layout, so a checkpoint moves between TE and this backend, and
computes norm then GEMM: the norm is ``kernels.norm.apply_norm`` (RMSNorm on a Triton kernel
on a GPU for calls of ``TRITON_NORM_MIN_ELEMENTS`` or more; smaller calls, LayerNorm unless
``MEGATRON_ROCM_TRITON_NORMS`` names it, and RMSNorm elsewhere on torch's fused kernels), the
linear is the
running tree's ``ColumnParallelLinear`` (sequence-parallel all-gather of the normalised
activations, gradient accumulation into ``main_grad``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from megatron_rocm.runtime.backend._init_rng import te_style_init
from megatron_rocm.runtime.backend._kwargs import refuse_te_only_config
from megatron_rocm.runtime.backend.fp8 import attach_recipe, parallel_forward
from megatron_rocm.runtime.backend.fp8_checkpoint import DelayedScalingCheckpoint
from megatron_rocm.runtime.backend.linear import column_parallel_kwargs
from megatron_rocm.runtime.kernels.norm import apply_norm, reset_norm_parameters


class TELayerNormColumnParallelLinear(DelayedScalingCheckpoint, ColumnParallelLinear):
    """LayerNorm/RMSNorm followed by a column-parallel linear, with TE's contract."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Callable,
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        skip_weight_param_allocation: bool = False,
        tp_comm_buffer_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        if is_expert:
            raise ValueError(f"{owner}: TE linear layers do not yet support MoE")
        refuse_te_only_config(owner, config)
        extra = column_parallel_kwargs(owner, gather_output, skip_weight_param_allocation, kwargs)
        with te_style_init():  # TE builds without a seeded tracker (see _init_rng)
            super().__init__(
                input_size,
                output_size,
                config=config,
                init_method=init_method,
                bias=bias,
                gather_output=False,
                skip_bias_add=skip_bias_add,
                is_expert=False,
                tp_comm_buffer_name=tp_comm_buffer_name,
                **extra,
            )
        self.normalization = config.normalization
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"{owner}: normalization {self.normalization!r} is not supported")
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = bool(config.layernorm_zero_centered_gamma)
        device = self.weight.device
        factory = {"device": device, "dtype": config.params_dtype}
        norm_params = OrderedDict(
            layer_norm_weight=torch.nn.Parameter(torch.empty(input_size, **factory))
        )
        if self.normalization == "LayerNorm":
            norm_params["layer_norm_bias"] = torch.nn.Parameter(torch.empty(input_size, **factory))
        for param in norm_params.values():
            # Replicated over TP; with sequence parallelism each rank normalises other tokens,
            # so Megatron all-reduces the grads of params flagged like this.
            param.sequence_parallel = bool(config.sequence_parallel)
        # TE registers the norm's parameters first: keep that order (state dict, optimizer).
        self._parameters = OrderedDict(list(norm_params.items()) + list(self._parameters.items()))
        self.reset_layer_norm_parameters()
        attach_recipe(self, owner, config)

    def reset_layer_norm_parameters(self) -> None:
        """gamma = 1 (0 when zero-centred: the kernel uses 1 + gamma), beta = 0."""
        reset_norm_parameters(
            self.layer_norm_weight,
            getattr(self, "layer_norm_bias", None),
            self.zero_centered_gamma,
        )

    def forward(
        self,
        x: torch.Tensor,
        around_a2a: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Norm, then GEMM; or, with ``around_a2a`` (``a2a_projection``), norm, then that
        function of the normalised input, which computes the GEMM itself. Either way inside
        the module's call, so that its hooks run first: Megatron's DDP waits there for this
        module's parameters (``--overlap-param-gather``)."""
        normed = self.normalize(x)
        if around_a2a is not None:
            return around_a2a(normed), None
        if self.fp8_recipe is not None:  # the GEMM in FP8 (backend.fp8)
            return parallel_forward(self, normed, "column")
        return super().forward(normed)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """The norm in front of the GEMM."""
        # An fp32 residual stream meets low-precision params here: TE narrows the input too.
        if x.dtype != self.layer_norm_weight.dtype:
            x = x.to(self.layer_norm_weight.dtype)
        return apply_norm(
            x,
            self.layer_norm_weight,
            getattr(self, "layer_norm_bias", None),
            self.eps,
            self.normalization,
            self.zero_centered_gamma,
        )

    def extra_repr(self) -> str:
        return f"{self.normalization} -> " + super().extra_repr()


def split_te_layernorm_column_parallel_linear(
    fused_layer: TELayerNormColumnParallelLinear,
    config: Any,
    init_method: Callable | None = None,
    tp_group: Any = None,
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """TE's helper of the same name: the fused norm-linear as a ``TENorm`` and a
    ``TEColumnParallelLinear`` holding copies of its weights. MLA calls it once when it caches
    latents for inference (``cache_mla_latents``), to run the norm and the up-projection apart.
    """
    from megatron_rocm.runtime.backend.linear import TEColumnParallelLinear
    from megatron_rocm.runtime.backend.norm import TENorm

    norm = TENorm(config=config, hidden_size=fused_layer.input_size, eps=fused_layer.eps)
    bias = fused_layer.bias is not None
    extra = (
        {"tp_group": tp_group or fused_layer.tp_group} if hasattr(fused_layer, "tp_group") else {}
    )
    linear = TEColumnParallelLinear(
        fused_layer.input_size,
        fused_layer.output_size,
        config=config,
        init_method=init_method or (lambda weight: None),  # the weights are copied below
        gather_output=False,
        bias=bias,
        skip_bias_add=fused_layer.skip_bias_add,
        is_expert=False,
        **extra,
    )
    with torch.no_grad():
        norm.weight.copy_(fused_layer.layer_norm_weight)
        if getattr(fused_layer, "layer_norm_bias", None) is not None:
            norm.bias.copy_(fused_layer.layer_norm_bias)
        linear.weight.copy_(fused_layer.weight)
        if bias:
            linear.bias.copy_(fused_layer.bias)
    device = fused_layer.weight.device  # TE builds on the GPU; follow the fused layer
    return norm.to(device), linear.to(device)
