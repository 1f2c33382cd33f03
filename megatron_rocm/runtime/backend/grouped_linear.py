"""TEGroupedLinear and its column/row-parallel wrappers without TransformerEngine (MoE experts).

Upstream's ``TEGroupedMLP`` (the experts of ``--moe-grouped-gemm`` on the TE spec) runs its
local experts' two projections through TE's ``GroupedLinear``: one grouped GEMM per
projection instead of one GEMM per expert. These classes keep the wrappers' contract at every
tag from core_v0.12.0 to main (``megatron/core/extensions/transformer_engine.py``):

* constructor keywords (``tp_group`` 0.13-0.15, ``pg_collection`` 0.16+, ``name`` 0.18+);
  unsupported TE features (FP4, delayed wgrad, grouped tensors, GTP) fail with one line;
* FP8 under current scaling (``--fp8-recipe tensorwise``): every expert's GEMMs run in one
  native FP8 function (``backend.fp8_experts``), each expert scaled by its own amax, on the token
  segments upstream's ``Fp8Padding`` (``backend.fp8_padding``) aligned to 16;
* parameters ``weight0..weight{n-1}`` ``[out, in]`` and ``bias0..`` (a plain empty tensor per
  expert without bias, as TE does), with the ``allreduce`` / ``tensor_model_parallel`` /
  ``partition_dim`` attributes the wrapper of the running tag leaves on them;
* expert-parallel sizing: with EP or expert-TP the layer holds only its TP shard, and the
  token dispatcher does every communication (TE's ``explicit_expert_comm``);
* ``forward(x, m_splits) -> (out, None)``, or ``(out, [bias_g])`` with ``skip_bias_add``;
  gradient-accumulation fusion into ``main_grad``;
* the TE wrappers' ``sharded_state_dict`` layout and load hooks (per-tag details in
  :mod:`._grouped_compat`).

The math is :func:`megatron_rocm.runtime.kernels.grouped_gemm.grouped_mm`. The expert weights
are allocated as equally spaced views of one ``[n, out, in]`` buffer, so ``torch._grouped_mm``
reads them through a strided view instead of stacking them every step (Megatron's distributed
optimizer later moves parameters into its own buffers; the Triton path reads them there in
place, the ``torch`` path then stacks: ``last_run()`` reports which happened).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_rocm.runtime.backend import _grouped_compat as compat
from megatron_rocm.runtime.backend._extra_state import NoFp8ExtraState
from megatron_rocm.runtime.backend._init_rng import tracker_fork
from megatron_rocm.runtime.backend._kwargs import accepted_kwargs, refuse_te_only_config, reject
from megatron_rocm.runtime.backend.fp8 import module_recipe, recipe_name, weight_reuse
from megatron_rocm.runtime.backend.fp8_experts import (
    EXPERT_ROW_BUCKET,
    ExpertsCall,
    ExpertWeightCache,
    fp8_experts,
)
from megatron_rocm.runtime.kernels.fp8_segments import Segments
from megatron_rocm.runtime.kernels.grad_accum import has_main_grad
from megatron_rocm.runtime.kernels.grouped_gemm import grouped_mm
from megatron_rocm.runtime.kernels.norm import param_device


def _wrapper_keywords(tp_group: Any = None, pg_collection: Any = None, name: Any = None) -> None:
    """Keywords some tags' wrappers take beyond the common ones (``name`` is only a label)."""


def _reject_te_features(owner: str, config: Any) -> None:
    bf16 = "train in bf16 (--bf16)"
    checks = (
        ("fp4", "FP4 (--fp4-format)", bf16),
        ("delay_wgrad_compute", "delayed wgrad (--delay-wgrad-compute)", "remove it"),
        (
            "overlap_dispatch_backward_with_experts_wgrad",
            "overlap_dispatch_backward_with_experts_wgrad",
            "remove it",
        ),
        ("moe_use_grouped_tensor", "moe_use_grouped_tensor (TE GroupedTensor)", "remove it"),
        ("moe_single_grouped_weight", "moe_single_grouped_weight", "remove it"),
        ("moe_single_grouped_bias", "moe_single_grouped_bias", "remove it"),
    )
    for attr, what, instead in checks:
        if getattr(config, attr, None):
            reject(owner, what, instead)
    refuse_te_only_config(owner, config)  # what every native linear refuses
    if (getattr(config, "expert_gtp_weight_remat_size", None) or 1) > 1:
        reject(owner, "expert GTP weight rematerialisation", "set its size to 1")


def expert_fp8_recipe(owner: str, config: Any, weight: torch.Tensor) -> Any:
    """The experts' current-scaling FP8 recipe (formats and margin: each expert is still
    scaled by its own amax, ``backend.fp8_experts``), or None (bf16: no ``--fp8-format``, or a
    layer ``--first-last-layers-bf16`` keeps in bf16). ``weight``: one expert's, all alike.
    What the experts cannot do in FP8
    fails with one line: delayed scaling (an expert's amax history would be reduced with other
    ranks' different experts), FP8 weights (``--fp8-param-gather``), and core 0.12, whose
    experts import TE's ``Fp8Padding`` without the extension module."""
    if not getattr(config, "fp8", None):
        return None
    if compat.megatron_version() < (0, 13):
        reject(owner, "FP8 (--fp8-format) for MoE experts on core 0.12", "train in bf16 (--bf16)")
    name = recipe_name(config)
    if name != "tensorwise":
        reject(owner, f"--fp8-recipe {name} for MoE experts", "use --fp8-recipe tensorwise")
    if getattr(config, "fp8_param", False):
        reject(owner, "--fp8-param-gather for MoE experts", "drop --fp8-param-gather")
    return module_recipe(owner, config, weight)


def _divide(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"TEGroupedLinear: {what}={size} is not divisible by the TP size {parts}")
    return size // parts


class TEGroupedLinear(NoFp8ExtraState):
    """``num_gemms`` expert linears ``y_g = x_g W_g^T (+ b_g)`` run as one grouped GEMM."""

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: str | None,
        config: Any,
        init_method: Callable,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        extra = accepted_kwargs(_wrapper_keywords, kwargs, owner=owner)
        _reject_te_features(owner, config)
        version = compat.megatron_version()
        if version >= (0, 16):
            assert is_expert, "TEGroupedLinear only supports expert parallelism"
        self.config = config
        self.te_return_bias = skip_bias_add and bias
        self.is_first_microbatch = True
        self.disable_parameter_transpose_cache = getattr(
            config, "disable_parameter_transpose_cache", False
        )
        self.delay_wgrad_compute = False
        self.save_original_input = False  # we always keep the original input (no FP8 copy)
        self.te_quant_params = None
        self.ub_name = tp_comm_buffer_name
        self.expert_parallel = config.expert_model_parallel_size > 1
        self._pg_collection, self._tp_group = compat.resolve_groups(
            version, is_expert, extra.get("tp_group"), extra.get("pg_collection")
        )
        if compat.group_size(getattr(self._pg_collection, "expt_gtp_remat", None)) > 1:
            reject(owner, "expert GTP weight rematerialisation", "set its size to 1")
        tp_size = compat.group_size(self._tp_group)
        self.explicit_expert_comm = is_expert and (tp_size > 1 or self.expert_parallel)
        original_mode = parallel_mode
        if self.explicit_expert_comm:
            if parallel_mode == "column":
                output_size = _divide(output_size, tp_size, "output_size")
            elif parallel_mode == "row":
                input_size = _divide(input_size, tp_size, "input_size")
            parallel_mode, tp_size = None, 1
        elif tp_size > 1:
            raise ValueError(
                f"{owner}: is_expert=False with tensor parallelism needs TE's own TP "
                "communication; use TEColumnParallelLinear/TERowParallelLinear instead"
            )
        if parallel_mode not in (None, "column", "row"):
            raise ValueError(f"{owner}: parallel_mode {parallel_mode!r} not supported")
        self.num_gemms, self.in_features, self.out_features = num_gemms, input_size, output_size
        self.use_bias, self.return_bias = bias, self.te_return_bias
        self.apply_bias = bias and not self.te_return_bias
        self.parallel_mode, self.tp_size, self.sequence_parallel = parallel_mode, tp_size, False
        self.fuse_wgrad_accumulation = bool(config.gradient_accumulation_fusion)
        self.rng_tracker_name = compat.expert_rng_tracker_name() if is_expert else None
        self._allocate(init_method)
        self.fp8_recipe = expert_fp8_recipe(owner, config, self.weight0)
        self._fp8_weight_cache = ExpertWeightCache()
        compat.mark_parameters(
            self,
            version=version,
            original_mode=original_mode,
            is_expert=is_expert,
            use_expert_pgs=compat.uses_expert_groups(version, config, is_expert),
        )
        self._register_load_state_dict_pre_hook(compat.load_pre_hook, with_module=True)

    def _allocate(self, init_method: Callable) -> None:
        """Experts' weights as views of one ``[n, out, in]`` buffer, registered like TE's."""
        config, n = self.config, self.num_gemms
        device, dtype = param_device(config), config.params_dtype
        weights = torch.empty(n, self.out_features, self.in_features, device=device, dtype=dtype)
        biases = torch.empty(
            n if self.use_bias else 0, self.out_features, device=device, dtype=dtype
        )
        for i in range(n):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(weights[i]))
            if self.use_bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(biases[i]))
            else:
                setattr(self, f"bias{i}", torch.empty(0, device=device, dtype=dtype))
        if not getattr(config, "perform_initialization", True) or device == "meta":
            return
        for i in range(n):  # TE's order: one fork of the RNG tracker per weight
            with tracker_fork(self.rng_tracker_name):
                init_method(getattr(self, f"weight{i}"))
        if self.use_bias:
            with torch.no_grad():
                biases.zero_()

    def forward(
        self, x: torch.Tensor, m_splits: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """``(out, None)``, or ``(out, [bias_g])`` when the bias add is left to the caller."""
        n = self.num_gemms
        weights = self._weights()
        biases = [getattr(self, f"bias{i}") for i in range(n)] if self.use_bias else None
        if self.fp8_recipe is not None:
            out = self._fp8_forward(x, weights, m_splits, biases if self.apply_bias else None)
        else:
            out = grouped_mm(
                x,
                weights,
                m_splits,
                bias=biases if self.apply_bias else None,
                fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
            )
        self.is_first_microbatch = False
        if self.te_return_bias:
            return out, [b.to(out.dtype) for b in biases]
        return out, None

    def _weights(self) -> list[torch.Tensor]:
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def _fp8_forward(
        self,
        x: torch.Tensor,
        weights: list[torch.Tensor],
        m_splits: Any,
        biases: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        """Every expert's rows through its weight in FP8 (``backend.fp8_experts``: the experts
        quantized together, the weights once a step as the dense linears do:
        ``weight_reuse``), plus each expert's bias."""
        x = x.reshape(-1, x.shape[-1])
        splits = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits)
        if len(splits) != self.num_gemms or sum(splits) != x.shape[0]:
            raise ValueError(
                f"{type(self).__name__}: {len(splits)} splits summing to {sum(splits)} for "
                f"{self.num_gemms} experts and {x.shape[0]} rows"
            )
        fuse = bool(self.fuse_wgrad_accumulation)  # for each weight that trains
        lacking = [w for w in weights if w.requires_grad and not has_main_grad(w)]
        if fuse and torch.is_grad_enabled() and lacking:
            raise RuntimeError(
                f"{type(self).__name__}: gradient_accumulation_fusion needs "
                "weight.main_grad (set by Megatron's DDP or FSDP wrapper); build the model "
                "with gradient_accumulation_fusion=False otherwise"
            )
        call = ExpertsCall(
            segs=Segments(tuple(int(c) for c in splits), EXPERT_ROW_BUCKET),
            recipe=self.fp8_recipe,
            fuse_wgrad=fuse,
            cache=self._fp8_weight_cache,
            reuse_weight=weight_reuse(self),
        )
        out = fp8_experts(x, tuple(weights), call)
        if biases is None:
            return out
        return torch.cat([rows + b for rows, b in zip(out.split(splits), biases, strict=True)])

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward pass (no delayed wgrad)."""

    def _sharded_state_dict_grouped(
        self, tp_axis_map: dict, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None
    ) -> dict:
        return compat.sharded_state_dict_grouped(
            self, tp_axis_map, prefix, sharded_offsets, metadata
        )

    def extra_repr(self) -> str:
        return (
            f"per expert([in={self.in_features}, out={self.out_features}]) X "
            f"num_gemms={self.num_gemms}, bias={self.use_bias}, TP={self.tp_size}"
        )


class _TensorParallelGroupedLinear(TEGroupedLinear):
    """TE's column/row grouped linears take TEGroupedLinear's arguments less ``parallel_mode``,
    which the subclass fixes."""

    _parallel_mode: str

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Callable,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            num_gemms,
            input_size,
            output_size,
            parallel_mode=self._parallel_mode,
            config=config,
            init_method=init_method,
            bias=bias,
            skip_bias_add=skip_bias_add,
            is_expert=is_expert,
            tp_comm_buffer_name=tp_comm_buffer_name,
            **kwargs,
        )


class TEColumnParallelGroupedLinear(_TensorParallelGroupedLinear):
    """Grouped linear whose experts' outputs are split over expert-TP (weights on axis 0)."""

    _parallel_mode = "column"

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None
    ) -> dict:
        """Per expert: weight and bias sharded on TP axis 0, experts on the EP axis."""
        axes = {}
        for g in range(self.num_gemms):
            axes.update({f"{g}.weight": 0, f"{g}.bias": 0})
        return self._sharded_state_dict_grouped(axes, prefix, sharded_offsets, metadata)


class TERowParallelGroupedLinear(_TensorParallelGroupedLinear):
    """Grouped linear whose experts' inputs are split over expert-TP (weights on axis 1)."""

    _parallel_mode = "row"

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None
    ) -> dict:
        """Per expert: weight sharded on TP axis 1, bias replicated, experts on the EP axis."""
        axes = {f"{g}.weight": 1 for g in range(self.num_gemms)}
        return self._sharded_state_dict_grouped(axes, prefix, sharded_offsets, metadata)
