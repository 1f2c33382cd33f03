"""TELinear, TEColumnParallelLinear and TERowParallelLinear without TransformerEngine.

TE's column/row linears and Megatron's local ``ColumnParallelLinear`` / ``RowParallelLinear``
compute the same thing: the same weight layout (``weight`` [out/tp, in] or [out, in/tp],
``bias``), tensor and sequence parallelism, gradient accumulation straight into ``main_grad``
(the ``grad-accum-fusion`` patch gives the local classes our wgrad kernel), ``skip_bias_add``,
the same ``sharded_state_dict`` (``weight``/``bias`` split on the TP axis, ``_extra_state``
kept), and the same expert-parallel behaviour. So the column and row wrappers *are* the local
classes of the running tree, with the TE wrappers' constructor contract on top: their keyword
set (which drifts per tag), and their refusals (``gather_output``, ``input_is_parallel=False``,
``skip_weight_param_allocation``), so code written against TE fails the same way here.

``TELinear`` itself is used directly only with ``parallel_mode="duplicated"`` (MLA and MoE
latent down-projections): a replicated weight, no TP communication, its gradient reduced over
TP by Megatron when sequence parallelism shards the input (``sequence_parallel`` attribute).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_rocm.runtime.backend._extra_state import NoFp8ExtraState
from megatron_rocm.runtime.backend._init_rng import te_style_init
from megatron_rocm.runtime.backend._kwargs import accepted_kwargs, refuse_te_only_config
from megatron_rocm.runtime.backend._linear_function import (
    LinearFunction,
    project_attention_output,
)
from megatron_rocm.runtime.backend.fp8 import (
    attach_recipe,
    fp8_linear,
    parallel_forward,
    weight_reuse,
)
from megatron_rocm.runtime.backend.fp8_checkpoint import DelayedScalingCheckpoint
from megatron_rocm.runtime.kernels.norm import param_device

_TE_ONLY_INERT = {"symmetric_ar_type": None, "gtp_remat_group": None, "gtp_replica_group": None}


def _label_only(name: str | None = None) -> None:
    """The keywords a duplicated ``TELinear`` takes beyond its own: a module name (a label)."""


def _check_te_contract(owner: str, skip_weight_param_allocation: bool) -> None:
    if skip_weight_param_allocation:
        raise ValueError(f"{owner}: TE linear layers do not support skip_weight_param_allocation")


def column_parallel_kwargs(
    owner: str, gather_output: bool, skip_weight_param_allocation: bool, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """TE's refusals for a column-parallel linear, then the drifting keywords this tree's
    ``ColumnParallelLinear`` knows (shared by the plain and the norm-fused column linear)."""
    if gather_output:
        raise ValueError(f"{owner}: TE linear layers do not support gather_output=True")
    _check_te_contract(owner, skip_weight_param_allocation)
    return accepted_kwargs(
        ColumnParallelLinear.__init__, kwargs, owner=owner, inert={"stride": 1, **_TE_ONLY_INERT}
    )


class TEColumnParallelLinear(DelayedScalingCheckpoint, ColumnParallelLinear):
    """Column-parallel linear (output split over TP) with TE's constructor contract."""

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
        refuse_te_only_config(type(self).__name__, config)
        extra = column_parallel_kwargs(
            type(self).__name__, gather_output, skip_weight_param_allocation, kwargs
        )
        with te_style_init():  # TE builds without a seeded tracker (see _init_rng)
            super().__init__(
                input_size,
                output_size,
                config=config,
                init_method=init_method,
                bias=bias,
                gather_output=False,
                skip_bias_add=skip_bias_add,
                is_expert=is_expert,
                tp_comm_buffer_name=tp_comm_buffer_name,
                **extra,
            )
        attach_recipe(self, type(self).__name__, config)

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Upstream's forward, or under ``--fp8-format`` the FP8 GEMM (``backend.fp8``)."""
        if self.fp8_recipe is None or args or any(v is not None for v in kwargs.values()):
            return super().forward(input_, *args, **kwargs)
        return parallel_forward(self, input_, "column")


class TERowParallelLinear(DelayedScalingCheckpoint, RowParallelLinear):
    """Row-parallel linear (input split over TP) with TE's constructor contract."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Callable,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not input_is_parallel:
            raise ValueError("TERowParallelLinear: TE linear layers need input_is_parallel=True")
        refuse_te_only_config(type(self).__name__, config)
        extra = accepted_kwargs(
            RowParallelLinear.__init__,
            kwargs,
            owner=type(self).__name__,
            inert={"stride": 1, **_TE_ONLY_INERT},
        )
        with te_style_init():  # TE builds without a seeded tracker (see _init_rng)
            super().__init__(
                input_size,
                output_size,
                config=config,
                init_method=init_method,
                bias=bias,
                input_is_parallel=True,
                skip_bias_add=skip_bias_add,
                is_expert=is_expert,
                tp_comm_buffer_name=tp_comm_buffer_name,
                **extra,
            )
        attach_recipe(self, type(self).__name__, config)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Upstream's forward, except where the input is an a2a attention output with
        handoffs for this layer (``cp.early_output``, ``cp.handoff``) and nothing but the GEMM
        is in play (one TP rank, a trainable weight, no CPU offloading): then the same GEMM,
        over the rank's own heads while the peers' land, and whose backward starts the
        attention's exchange ahead of the weight gradient. Under ``--fp8-format``, the FP8
        GEMM (``backend.fp8``)."""
        if self.fp8_recipe is not None:
            return parallel_forward(self, input_, "row")
        fuse = bool(self.gradient_accumulation_fusion)
        output = project_attention_output(input_, self.weight, fuse) if self._gemm_only() else None
        if output is None:
            return super().forward(input_)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None

    def _gemm_only(self) -> bool:
        return gemm_only(self, self.input_size_per_partition == self.input_size)


def gemm_only(linear: Any, whole: bool) -> bool:
    """Whether upstream's forward of a column or row parallel ``linear`` is a plain GEMM here
    whose weight gradient the native Functions compute alike (``whole``: its weight is not
    split over TP ranks): no TP, expert, remat or offloading path, a trainable weight,
    Megatron's DDP ``main_grad`` where the gradient goes into it (upstream raises without
    one), not Megatron-FSDP's (whose buffers main writes over), no FP8 (its own GEMMs)."""
    weight = linear.weight
    return (
        whole
        and not linear.sequence_parallel
        and not linear.explicit_expert_comm
        and getattr(linear, "gtp_remat_size", 1) == 1
        and not getattr(linear.config, "cpu_offloading", False)
        and weight.requires_grad
        and (hasattr(weight, "main_grad") or not linear.gradient_accumulation_fusion)
        and not hasattr(weight, "__fsdp_param__")
        and getattr(linear, "fp8_recipe", None) is None
    )


class TELinear(DelayedScalingCheckpoint, NoFp8ExtraState):
    """TE's plain ``Linear`` as Megatron uses it: ``parallel_mode="duplicated"`` (or None).

    Column/row parallel TE linears are ``TEColumnParallelLinear`` / ``TERowParallelLinear``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: str | None,
        config: Any,
        init_method: Callable,
        bias: bool,
        skip_bias_add: bool,
        skip_weight_param_allocation: bool,
        tp_comm_buffer_name: str | None = None,
        is_expert: bool = False,
        tp_group: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        if parallel_mode not in ("duplicated", None):
            raise ValueError(
                f"{owner}: parallel_mode={parallel_mode!r}: use TEColumnParallelLinear or "
                f"TERowParallelLinear for tensor-parallel linears"
            )
        if parallel_mode == "duplicated" and tp_group is not None:
            raise ValueError(f"{owner}: a duplicated linear should not have tp_group set")
        _check_te_contract(owner, skip_weight_param_allocation)
        refuse_te_only_config(owner, config)
        accepted_kwargs(_label_only, kwargs, owner=owner, inert=_TE_ONLY_INERT)
        self.config = config
        self.parallel_mode = parallel_mode
        self.skip_bias_add = skip_bias_add
        self.te_return_bias = skip_bias_add and bias
        self.is_expert = is_expert
        self.in_features, self.out_features = input_size, output_size
        device = param_device(config)
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, device=device, dtype=dtype)
        )
        self.bias = (
            torch.nn.Parameter(torch.empty(output_size, device=device, dtype=dtype))
            if bias
            else None
        )
        if getattr(config, "perform_initialization", True) and device != "meta":
            _initialize(self.weight, init_method)
            if self.bias is not None:
                with torch.no_grad():
                    self.bias.zero_()
        expert_parallel = getattr(config, "expert_model_parallel_size", 1) > 1
        for param in self.parameters():
            param.allreduce = not (is_expert and expert_parallel)
            param.tensor_model_parallel = False
            if parallel_mode == "duplicated":
                # Sequence-parallel input: each TP rank saw a different slice of tokens.
                param.sequence_parallel = bool(config.sequence_parallel)
        attach_recipe(self, owner, config)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        fuse = bool(getattr(self.config, "gradient_accumulation_fusion", False))
        if self.fp8_recipe is not None:
            fuse = fuse and self.weight.requires_grad
            out = fp8_linear(x, self.weight, fuse, self.fp8_recipe, weight_reuse(self))
        else:
            out = LinearFunction.apply(x, self.weight, fuse)
        if self.bias is None:
            return out, None
        if self.te_return_bias:
            return out, self.bias
        return out + self.bias, None

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Replicated across TP and DP, like TE's duplicated ``TELinear``."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, None, sharded_offsets)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, parallel_mode={self.parallel_mode}"
        )


def _initialize(weight: torch.nn.Parameter, init_method: Callable) -> None:
    """Initialise with the default generator, which Megatron seeds alike on every TP rank: a
    duplicated weight must start identical everywhere (TE uses its data-parallel RNG tracker
    for the same reason; the model-parallel tracker differs per TP rank)."""
    init_method(weight)
