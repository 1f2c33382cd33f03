"""FP8 training in the native TE-spec linears: upstream's FP8 flags without TransformerEngine.

Upstream reads ``--fp8-format`` / ``--fp8-recipe`` into ``TransformerConfig.fp8`` /
``fp8_recipe`` and enters ``get_fp8_context`` around each layer's construction (``is_init``)
and forward; without TE that function returns a null context and FP8 flags would train in
bf16. The ``fp8-without-te`` patch makes it return :func:`layer_context` instead, so the
native column, row, norm-fused and duplicated linears built inside a layer learn whether the
layer trains in FP8 (``--first-last-layers-bf16`` keeps its first and last layers in bf16),
and read the recipe from the config when they are built (:func:`module_recipe`). Deciding at
construction keeps recomputed forwards (activation checkpointing) on the same path as the
first one. Three recipes exist here: current scaling (``--fp8-recipe tensorwise``), delayed
scaling (``delayed``, upstream's default: ``--fp8-amax-history-len``,
``--fp8-amax-compute-algo``, ``kernels.fp8.AmaxHistory``) and block scaling (``blockwise``:
``backend.fp8_blockwise``); argument validation refuses the rest (``options``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rocm.runtime.backend._linear_function import (
    deliver_wgrad,
    keep_for_backward,
    wgrad_from_activations,
)
from megatron_rocm.runtime.kernels.fp8 import (
    AmaxHistory,
    Fp8Formats,
    check_gemm_dims,
    formats,
    fp8_mm,
    quantize,
    quantize_transposed,
)
from megatron_rocm.runtime.kernels.fp8_accumulate import accumulate
from megatron_rocm.runtime.kernels.fp8_amax_reduction import Scope, active
from megatron_rocm.runtime.kernels.grad_accum import main_grad_for_wgrad

_bf16_layer: list[bool] = []  # innermost layer under construction: kept out of FP8?


NATIVE_RECIPES = ("tensorwise", "delayed", "blockwise")
# argument validation's line, and the linear's where it is built without validation
BLOCKWISE_PARAM_GATHER = (
    "--fp8-param-gather with --fp8-recipe blockwise: without TransformerEngine the FP8 weights "
    "are scaled per tensor; use --fp8-recipe tensorwise or delayed, or drop --fp8-param-gather"
)


@dataclass(frozen=True)
class DelayedScaling:
    """One linear's amax histories (``--fp8-recipe delayed``): its input, its weight and its
    output gradient each scale by their own earlier amaxes."""

    input: AmaxHistory
    weight: AmaxHistory
    grad_output: AmaxHistory


@dataclass(eq=False)
class WeightCache:
    """One linear's quantized weight ``(w_fp8, w_fp8_t or None, inverse_scale)``, kept for the
    micro-batches of a step after the first (TE's parameter cache: see :func:`weight_reuse`),
    with the weight storage it was taken from."""

    quantized: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None
    source: int = 0  # the weight's data_ptr

    def get(self, weight: torch.Tensor, transposed: bool) -> tuple | None:
        """The cached FP8 weight if it is ``weight``'s and has the transpose when asked."""
        q = self.quantized
        if q is None or self.source != weight.data_ptr() or (transposed and q[1] is None):
            return None
        return q

    def put(self, weight: torch.Tensor, quantized: tuple) -> None:
        self.quantized, self.source = quantized, weight.data_ptr()


@dataclass(frozen=True)
class Fp8Recipe:
    """What one native linear needs to know about the run's FP8 recipe (one per linear: a
    delayed recipe carries the linear's own histories, and each its weight cache)."""

    formats: Fp8Formats
    margin: int = 0
    wgrad_in_fp8: bool = True  # upstream's --fp8-wgrad (default on; --no-fp8-wgrad: bf16)
    delayed: DelayedScaling | None = None  # None: current scaling (tensorwise) or blockwise
    blockwise: bool = False  # 1 x 128 / 128 x 128 block scales (backend.fp8_blockwise)
    weight_cache: WeightCache = field(default_factory=WeightCache)

    def history(self, tensor: str) -> AmaxHistory | None:
        """The amax history of ``tensor`` (input, weight, grad_output), None under current
        scaling."""
        return None if self.delayed is None else getattr(self.delayed, tensor)


def recipe_name(config: Any) -> str:
    """``config.fp8_recipe`` as text (an ``Fp8Recipe`` enum or a string, by version)."""
    recipe = getattr(config, "fp8_recipe", "delayed")
    return str(getattr(recipe, "value", recipe))


def is_first_last_bf16_layer(config: Any, layer_no: int) -> bool:
    """Upstream's rule: with ``first_last_layers_bf16``, the first ``num_layers_at_start_in_bf16``
    and the last ``num_layers_at_end_in_bf16`` layers (global numbers from 0) stay in bf16."""
    if layer_no < 0 or not getattr(config, "first_last_layers_bf16", False):
        return False
    start = getattr(config, "num_layers_at_start_in_bf16", 0)
    end = getattr(config, "num_layers_at_end_in_bf16", 0)
    return layer_no < start or layer_no >= config.num_layers - end


def layer_context(config: Any, layer_no: int = -1, is_init: bool = False) -> Any:
    """``get_fp8_context`` without TE. Around a layer's construction under ``--fp8-format``
    it records whether that layer trains in FP8 (the modules decide when they are built);
    around a forward under delayed scaling it is a :func:`forward_region` (current scaling
    has no amaxes to reduce)."""
    if not getattr(config, "fp8", None):
        return contextlib.nullcontext()
    if not is_init:
        return forward_region() if recipe_name(config) == "delayed" else contextlib.nullcontext()
    return _building(is_first_last_bf16_layer(config, layer_no))


@contextlib.contextmanager
def _building(bf16: bool) -> Iterator[None]:
    _bf16_layer.append(bf16)
    try:
        yield
    finally:
        _bf16_layer.pop()


@dataclass
class _ForwardRegion:
    """The outermost forward region open now: the scope its forward's amaxes defer to, the
    one its backward's defer to, and whether its first FP8 linear is still to come."""

    forward: Scope = field(default_factory=Scope)
    backward: Scope = field(default_factory=Scope)
    first_open: bool = True


_open_regions: list[_ForwardRegion | None] = []  # the outermost region, then None per nested


@contextlib.contextmanager
def forward_region() -> Iterator[None]:
    """Where upstream enters its FP8 context around a forward (the whole block's under
    delayed scaling), the amax all-reduces of delayed scaling batch as in TE's
    ``fp8_autocast`` (``kernels.fp8_amax_reduction``): the outermost region's end reduces its
    forward's amaxes, and its first FP8 linear the backward's at the end of its own backward,
    the region's last. Not on an exception: the other ranks may not be here."""
    region = None if _open_regions else _ForwardRegion()
    _open_regions.append(region)
    try:
        if region is None:
            yield
        else:
            with active(region.forward):
                yield
    finally:
        _open_regions.pop()
    if region is not None:
        region.forward.flush()


def backward_scope(backward_comes: bool) -> tuple[Scope | None, bool]:
    """For a linear's forward: the scope its backward's amaxes defer to (None outside a
    forward region), and whether its backward flushes that scope at its end (the first FP8
    linear of the region whose backward will run: ``backward_comes``)."""
    region = _open_regions[0] if _open_regions else None
    if region is None:
        return None, False
    settles = backward_comes and region.first_open
    region.first_open &= not settles
    return region.backward, settles


def module_recipe(
    owner: str, config: Any, weight: torch.Tensor, weight_split: bool = False
) -> Fp8Recipe | None:
    """The recipe a native linear built now with ``weight`` [out, in] trains under, or None
    (no ``--fp8-format``, or a layer kept in bf16). ``weight_split``: the weight is one TP
    rank's part (see :func:`_delayed_scaling`)."""
    fmt = getattr(config, "fp8", None)
    if not fmt or (_bf16_layer and _bf16_layer[-1]):
        return None
    name = recipe_name(config)
    if name not in NATIVE_RECIPES:
        raise ValueError(
            f"{owner}: --fp8-recipe {name} needs TransformerEngine, which is not installed; "
            "use --fp8-recipe tensorwise, delayed or blockwise"
        )
    check_gemm_dims(owner, weight.shape[1], weight.shape[0])
    return Fp8Recipe(
        formats=formats(str(fmt)),
        margin=int(getattr(config, "fp8_margin", 0) or 0),
        wgrad_in_fp8=bool(getattr(config, "fp8_wgrad", True)),
        delayed=_delayed_scaling(config, weight_split) if name == "delayed" else None,
        blockwise=name == "blockwise",
    )


def attach_recipe(linear: Any, owner: str, config: Any) -> None:
    """A native linear's FP8 state, set where it is built: its recipe (:func:`module_recipe`)
    and ``is_first_microbatch``, the flag Megatron's schedules set on every module that has it
    before a step's first micro-batch (:func:`weight_reuse`)."""
    split = tp_world_size(linear) > 1
    linear.fp8_recipe = module_recipe(owner, config, linear.weight, split)
    linear.is_first_microbatch = True
    if linear.fp8_recipe is not None and getattr(config, "fp8_param", False):
        if linear.fp8_recipe.blockwise:
            raise ValueError(f"{owner}: {BLOCKWISE_PARAM_GATHER}")
        from megatron_rocm.runtime.backend.fp8_param import convert_weight

        convert_weight(linear, linear.fp8_recipe)  # --fp8-param-gather: FP8 bytes in DDP


def tp_world_size(linear: Any) -> int:
    """How many TP ranks split ``linear``'s weight: a column or row linear's full size over
    its partition (1 for a duplicated or whole weight)."""
    for full, part in (
        ("output_size", "output_size_per_partition"),
        ("input_size", "input_size_per_partition"),
    ):
        if getattr(linear, part, None) not in (None, getattr(linear, full, None)):
            return getattr(linear, full) // getattr(linear, part)
    return 1


def _delayed_scaling(config: Any, weight_split: bool = False) -> DelayedScaling:
    """Fresh histories from upstream's ``fp8_amax_history_len`` / ``fp8_amax_compute_algo``;
    activations and gradients reduce their amax over upstream's amax reduction group, and so
    does a weight split over TP ranks (as TE reduces every amax of the step): a checkpoint
    holds TP rank 0's histories for all ranks (upstream's ``_extra_state`` is replicated over
    TP), which holds for every rank only where their histories agree."""
    if int(getattr(config, "fp8_interval", 1) or 1) != 1:
        warnings.warn(
            "--fp8-interval is deprecated and ignored (as TransformerEngine 1.8 and later "
            "ignore it): delayed scaling updates the scale at every quantize",
            stacklevel=2,
        )
    length = int(getattr(config, "fp8_amax_history_len", 1))
    algo = str(getattr(config, "fp8_amax_compute_algo", "most_recent"))
    if algo not in ("max", "most_recent"):
        raise ValueError(f"--fp8-amax-compute-algo {algo!r}: expected max or most_recent")
    group = amax_reduction_group(config)

    def history(reduce: bool) -> AmaxHistory:
        return AmaxHistory(length, algo == "most_recent", group if reduce else None)

    return DelayedScaling(
        input=history(True), weight=history(weight_split), grad_output=history(True)
    )


def amax_reduction_group(config: Any) -> Any:
    """Upstream's amax reduction group (data, tensor and context parallel ranks; tensor and
    context parallel only with ``--tp-only-amax-red``) where it has more than one rank, else
    None."""
    try:
        from megatron.core import parallel_state
    except ImportError:  # a model built outside Megatron (tests): one rank
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_amax_reduction_group(
        with_context_parallel=True,
        tp_only_amax_red=bool(getattr(config, "tp_only_amax_red", False)),
    )
    if group is None or torch.distributed.get_world_size(group) == 1:
        return None
    return group


class Fp8LinearFunction(torch.autograd.Function):
    """``y = x W^T`` with every GEMM in FP8 under per-tensor scaling (current, or delayed
    with the recipe's histories).

    Forward: ``x`` and ``W`` in the forward format. Backward: the output gradient in the
    backward format, ``dx = dy W`` in FP8, ``dW = dy^T x`` in FP8 with an fp32 result (in
    fp32 from the activations without ``wgrad_in_fp8``). The weight gradient keeps
    ``LinearFunction``'s contract: with gradient-accumulation fusion it is added into
    ``weight.main_grad`` and autograd gets Megatron's placeholder.

    The backward's GEMMs want ``W``, ``x`` and ``dy`` transposed (``torch._scaled_mm``: the
    second operand column-major); each operand a backward GEMM needs is quantized together with
    its transpose (``quantize_transposed``), and the forward saves only the transposes it will
    need (none without grad mode).
    """

    @staticmethod
    def forward(ctx, x, weight, fuse_wgrad, recipe, grad_enabled, reuse_weight=None):  # noqa: ANN001, ANN205
        fmt = recipe.formats.forward
        rows = x.reshape(-1, x.shape[-1])
        # needs_input_grad follows requires_grad even under no_grad (evaluation, a reentrant
        # recompute's first pass): the caller's grad mode says whether a backward can come
        need_dgrad = grad_enabled and ctx.needs_input_grad[0]
        need_wgrad = grad_enabled and ctx.needs_input_grad[1]
        x_fp8_t = saved_x = None
        x_history, w_history = recipe.history("input"), recipe.history("weight")
        if need_wgrad and recipe.wgrad_in_fp8:
            x_fp8, x_fp8_t, x_inv = quantize_transposed(rows, fmt, recipe.margin, x_history)
        else:
            x_fp8, x_inv = quantize(rows, fmt, recipe.margin, history=x_history)
            saved_x = rows if need_wgrad else None
        stored = getattr(weight, "_fp8", None)  # --fp8-param-gather: the bytes DDP gathered
        cached = None
        if stored is None and reuse_weight:
            cached = recipe.weight_cache.get(weight, need_dgrad)
        if stored is not None:
            w_fp8, w_inv = stored.fp8(), stored.scale_inv.clone()
            w_fp8_t = stored.transposed() if need_dgrad else None
        elif cached is not None:
            w_fp8, w_fp8_t, w_inv = cached
        elif need_dgrad:
            w_fp8, w_fp8_t, w_inv = quantize_transposed(weight, fmt, recipe.margin, w_history)
        else:
            w_fp8, w_inv = quantize(weight, fmt, recipe.margin, history=w_history)
            w_fp8_t = None
        if stored is None and cached is None and reuse_weight is not None:
            recipe.weight_cache.put(weight, (w_fp8, w_fp8_t, w_inv))
        out = fp8_mm(x_fp8, x_inv, w_fp8.t(), w_inv, x.dtype, fast_accum=True)
        ctx.save_for_backward(x_fp8_t, saved_x, x_inv, w_fp8_t, w_inv, weight)
        keep_for_backward(ctx, recipe, x, fuse_wgrad, weight)
        ctx.amax_scope, ctx.settles = backward_scope(need_dgrad or need_wgrad)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205 - autograd signature
        x_fp8_t, saved_x, x_inv, w_fp8_t, w_inv, weight = ctx.saved_tensors
        recipe: Fp8Recipe = ctx.recipe
        fmt = recipe.formats.backward
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        wgrad_fp8 = ctx.needs_input_grad[1] and recipe.wgrad_in_fp8
        dy_history = recipe.history("grad_output")
        with active(ctx.amax_scope):
            if wgrad_fp8:
                dy_fp8, dy_fp8_t, dy_inv = quantize_transposed(dy, fmt, recipe.margin, dy_history)
            else:
                dy_fp8, dy_inv = quantize(dy, fmt, recipe.margin, history=dy_history)
        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:  # [M, N] x [N, K]: W^T's transpose is W, column-major
            grad_input = fp8_mm(dy_fp8, dy_inv, w_fp8_t.t(), w_inv, ctx.x_dtype)
            grad_input = grad_input.view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            if wgrad_fp8:  # [N, M'] x [M', K], M' the tokens padded to 16 with zeros
                grad_weight = fp8_wgrad(
                    ctx.fuse_wgrad, weight, (dy_fp8_t, dy_inv), (x_fp8_t.t(), x_inv), dy
                )
            else:
                grad_weight = wgrad_from_activations(ctx, dy, saved_x, weight)
        if ctx.settles:  # the forward region's last FP8 backward: its amaxes reduced
            ctx.amax_scope.flush()
        return grad_input, grad_weight, None, None, None, None


def fp8_wgrad(
    fuse: bool,
    weight: Any,
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    like: torch.Tensor,
) -> Any:
    """The weight gradient ``a @ b`` of two FP8 operands with their inverse scales (``a``
    row-major, ``b`` column-major), delivered as :func:`deliver_wgrad` delivers it; under
    gradient-accumulation fusion the GEMM adds into ``main_grad`` itself where the GPU's BLAS
    can (``kernels.fp8_accumulate``: no fp32 temporary, no separate add)."""
    main_grad = main_grad_for_wgrad(weight) if fuse else None
    if fuse and accumulate(main_grad, a[0], a[1], b[0], b[1]):
        return deliver_wgrad(fuse, weight, None, like, main_grad)  # added: nothing left to add
    wgrad = fp8_mm(a[0], a[1], b[0], b[1], torch.float32)
    return deliver_wgrad(fuse, weight, wgrad, like, main_grad)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    fuse_wgrad: bool,
    recipe: Fp8Recipe,
    reuse_weight: bool | None = None,
) -> Any:
    """``x W^T`` on ``Fp8LinearFunction``. ``reuse_weight`` (``weight_reuse``): True takes
    the FP8 weight the step's first micro-batch quantized, False quantizes and keeps it, None
    quantizes and keeps nothing. Block scaling runs ``fp8_blockwise``'s function."""
    function = Fp8LinearFunction
    if recipe.blockwise:
        from megatron_rocm.runtime.backend.fp8_blockwise import Fp8BlockwiseLinearFunction

        function = Fp8BlockwiseLinearFunction
    return function.apply(x, weight, fuse_wgrad, recipe, torch.is_grad_enabled(), reuse_weight)


def weight_reuse(linear: Any) -> bool | None:
    """Whether this forward of ``linear`` takes its FP8 weight from the step's first
    micro-batch (True), quantizes and keeps it (False), or keeps nothing (None): TE's parameter
    cache, driven the same way. Megatron's schedules set ``is_first_microbatch`` on every module
    that has it before a step's first micro-batch (``MegatronModule.set_is_first_microbatch``;
    the weights change only between steps), the linear clears it in its forward, and
    ``--disable-parameter-transpose-cache`` turns the cache off. A forward outside the
    schedules (nothing sets the flag again) reuses, as TE's linears do under Megatron; the
    cache also refreshes where the weight's storage moved."""
    first = getattr(linear, "is_first_microbatch", True)
    linear.is_first_microbatch = False
    if getattr(linear.config, "disable_parameter_transpose_cache", False):
        return None
    return not first


def plain_gemm_problem(linear: Any) -> str | None:
    """Why upstream's forward of a column or row parallel ``linear`` holds more than its GEMM
    and the tensor-parallel communication around it (what FP8 runs here), or None."""
    weight = linear.weight
    if getattr(linear, "gtp_remat_size", 1) != 1:
        return "GTP"
    if getattr(linear.config, "cpu_offloading", False):
        return "CPU offloading"
    if hasattr(weight, "__fsdp_param__"):
        return "Megatron-FSDP"
    if (
        linear.gradient_accumulation_fusion
        and weight.requires_grad
        and not hasattr(weight, "main_grad")
    ):
        return "gradient-accumulation fusion without Megatron's DDP (no main_grad)"
    return None


def parallel_forward(linear: Any, x: torch.Tensor, mode: str) -> tuple[torch.Tensor, Any]:
    """The FP8 forward of a native ``mode`` ("column" or "row") parallel linear, upstream's
    return value: the FP8 GEMM inside the communication upstream's forward puts around its
    own (``tp_comm``)."""
    problem = plain_gemm_problem(linear)
    if problem is not None:
        raise ValueError(
            f"{type(linear).__name__}: FP8 (--fp8-format) without TransformerEngine runs "
            f"the GEMM and its tensor-parallel communication only, not with {problem}; train "
            "in bf16 or drop it"
        )
    weight = linear.weight
    fuse = bool(linear.gradient_accumulation_fusion) and weight.requires_grad
    split = tp_world_size(linear) > 1  # else upstream's exchanges are identities
    if split:
        from megatron_rocm.runtime.backend import tp_comm
    if split and mode == "column":
        x = tp_comm.column_input(linear, x)
    out = fp8_linear(x, weight, fuse, linear.fp8_recipe, weight_reuse(linear))
    if split and mode == "row":
        out = tp_comm.row_output(linear, out)
    if linear.skip_bias_add:
        return out, linear.bias
    return (out + linear.bias if linear.bias is not None else out), None
