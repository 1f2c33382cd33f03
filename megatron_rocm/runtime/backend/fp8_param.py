"""``--fp8-param-gather`` without TransformerEngine: FP8 weights the distributed optimizer
writes and all-gathers as bytes.

Upstream moves FP8 parameters through its DDP buffers, the distributed optimizer and
checkpointing by asking ``fp8_utils.is_float8tensor`` and calling a few hooks
(``modify_underlying_storage``, ``quantize_param_shard``, ``post_all_gather_processing``,
``dequantize_fp8_tensor``); it never needs TE's classes beyond that. The ``fp8-without-te``
patch binds those names to this module where TE is absent (:func:`install`), and the native
linears built under ``--fp8-param-gather`` hold an :class:`Fp8Param` as their weight
(:func:`convert_weight`): one byte an element in a uint8 DDP buffer, one per-tensor scale. The
optimizer step quantizes each rank's fp32 main shard straight into that buffer, with the scale
from the amax all-reduced over the data-parallel group, so the all-gather moves FP8 bytes and
the forward reads them with no quantize of its own.

The bytes and scale are bitwise what the linear would quantize from the all-gathered bf16
weight without the flag: current scaling takes the same amax (a max: the order of its
reduction does not matter) and the same ``_scale``/``_apply``; delayed scaling advances the
weight's amax history once a step, as the linear does on a step's first micro-batch.
Checkpoints hold the dequantized weight (the dtype a run without the flag saves), and loading
one quantizes it again (``copy_``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from megatron_rocm.runtime.kernels.fp8 import (
    AmaxHistory,
    _amax,
    _quantize_scaled,
    _scale,
    advance_history,
    cast_into,
    transpose_fp8,
)

aten = torch.ops.aten
# views of an Fp8Param: reshaped, it stays one (sharing the bytes and scale); sliced, only the
# part is dequantized. The distributed optimizer keeps ``param.detach().view(-1)[a:b]`` of
# every FP8 weight (delayed scaling; both recipes before 0.14): a dequantized whole weight
# behind each slice would hold two bytes an element for the whole run.
_RESHAPES = (aten.view.default, aten._unsafe_view.default)
_BYTE_VIEWS = (aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.as_strided.default)


@dataclass(eq=False)
class Fp8State:
    """One FP8 weight's state, shared by every alias of it (``param.data``, ``detach``)."""

    data: torch.Tensor  # uint8 [out, in]: a view into the DDP buffer once DDP is built
    dtype: torch.dtype  # the dtype the weight reports (the model's: bf16)
    fp8_dtype: torch.dtype
    margin: int
    scale_inv: torch.Tensor  # fp32 0-d: what the GEMMs multiply by (the scale's inverse)
    history: AmaxHistory | None = None  # delayed scaling: the weight's amaxes
    transpose: torch.Tensor | None = None  # [in, out] FP8, built when a backward needs it

    @property
    def fp8_max(self) -> float:
        return float(torch.finfo(self.fp8_dtype).max)

    def fp8(self) -> torch.Tensor:
        return self.data.view(self.fp8_dtype)

    def transposed(self) -> torch.Tensor:
        """The FP8 weight's transpose (the input gradient's operand), rebuilt after the bytes
        changed (``stale``)."""
        if self.transpose is None:
            self.transpose = transpose_fp8(self.fp8())
        return self.transpose

    def stale(self) -> None:
        self.transpose = None

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self.fp8().float() * self.scale_inv).to(dtype or self.dtype)

    def assign(self, source: torch.Tensor) -> None:
        """The whole weight quantized from ``source`` (construction, a checkpoint's load):
        current scaling; delayed scaling starts its history again from this amax, as a run
        starts it from the first quantize."""
        with torch.no_grad():
            x = source.detach().to(device=self.data.device, dtype=self.dtype)
            x_fp8, scale = _quantize_scaled(x, self.fp8_dtype, self.fp8_max, self.margin)
            self.data.copy_(x_fp8.view(torch.uint8))
            self.scale_inv.copy_(scale.reciprocal())
            if self.history is not None:
                self.history.started = False
                self.history.start(x)
                # the scale these bytes were cast with, which a checkpoint taken before the
                # first optimizer step gives back to the load's recast (cast_with_history)
                self.history.scale.copy_(scale)
        self.stale()

    def cast_with_history(self, source: torch.Tensor) -> None:
        """The whole weight cast from ``source`` with its delayed history's scale, which
        stays as it is: a history restored from a checkpoint, and the bytes the run that
        saved it held (``fp8_checkpoint.recast_loaded_weight``)."""
        with torch.no_grad():
            x = source.detach().to(device=self.data.device, dtype=self.dtype)
            cast_into(x, self.history.scale, self.data.view(-1), self.fp8_dtype)
            self.scale_inv.copy_(self.history.scale.reciprocal())
        self.stale()


class Fp8Param(torch.Tensor):
    """A weight stored as FP8 bytes and one scale that reports the model's dtype, as TE's
    ``Float8Tensor`` does: upstream sizes buffers, builds the optimizer and saves checkpoints
    from what it reports. ``copy_`` into it quantizes; any other operation sees the
    dequantized weight (a bf16 tensor), and other in-place operations are refused: only the
    optimizer's :func:`quantize_param_shard` and ``copy_`` change it."""

    _fp8: Fp8State

    @staticmethod
    def __new__(cls, state: Fp8State, requires_grad: bool = False) -> Fp8Param:
        t = torch.Tensor._make_wrapper_subclass(
            cls, state.data.shape, dtype=state.dtype, device=state.data.device,
            requires_grad=requires_grad,
        )  # fmt: skip
        t._fp8 = state
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (
            f"Fp8Param(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"fp8={self._fp8.fp8_dtype}, device={self.device})"
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight in ``dtype`` (the reported one by default). Defined on the class: the
        checkpoint writer looks for it there."""
        return self._fp8.dequantize(dtype)

    def from_float8(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """TE 1.x's name for :meth:`dequantize` (``fp8_utils.dequantize_fp8_tensor``)."""
        return self._fp8.dequantize(dtype)

    def __reduce_ex__(self, protocol: Any) -> Any:  # torch.save: the weight in bf16
        return self._fp8.dequantize().__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return cls(args[0]._fp8)
        if func in _RESHAPES and isinstance(args[0], cls):  # the same bytes, another shape
            state = args[0]._fp8
            shaped = dataclasses.replace(state, data=state.data.view(args[1]), transpose=None)
            return cls(shaped)
        if func in _BYTE_VIEWS and isinstance(args[0], cls):  # dequantize the part only
            state = args[0]._fp8
            part = func(state.data, *args[1:], **kwargs)
            return (part.view(state.fp8_dtype).float() * state.scale_inv).to(state.dtype)
        if func is aten.copy_.default and isinstance(args[0], cls):
            args[0]._fp8.assign(args[1])
            return args[0]
        if _writes_into_fp8_param(func, args, kwargs, cls):
            raise RuntimeError(
                f"{func}: an FP8 weight (--fp8-param-gather) changes only through copy_ or "
                "the distributed optimizer's step"
            )

        def plain(t: Any) -> Any:
            return t._fp8.dequantize() if isinstance(t, cls) else t

        return func(*tree_map(plain, args), **tree_map(plain, kwargs))


def _writes_into_fp8_param(func: Any, args: tuple, kwargs: dict, cls: type) -> bool:
    """Whether ``func`` writes into an ``Fp8Param`` argument, positional or keyword (``out=``)."""
    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        info = arg.alias_info
        if info is not None and info.is_write and isinstance(value, cls):
            return True
    return False


def convert_weight(linear: Any, recipe: Any) -> None:
    """``linear.weight`` replaced by an :class:`Fp8Param` quantized from it (current
    scaling; delayed scaling starts the recipe's weight history there), keeping its
    attributes (tensor-parallel ones, ``allreduce``, ...) and the weight as built for the
    optimizer's fp32 mains."""
    weight = linear.weight
    history = recipe.history("weight")
    if history is not None and history.group is not None:
        raise ValueError(
            f"{type(linear).__name__}: --fp8-param-gather with delayed scaling and tensor "
            "parallelism is not supported without TransformerEngine (the optimizer step does "
            "not reduce the weight amax over TP ranks); use --fp8-recipe tensorwise or TP 1"
        )
    state = Fp8State(
        data=torch.empty(weight.shape, dtype=torch.uint8, device=weight.device),
        dtype=weight.dtype,
        fp8_dtype=recipe.formats.forward,
        margin=recipe.margin,
        scale_inv=torch.ones((), dtype=torch.float32, device=weight.device),
        history=history,
    )
    state.assign(weight)
    param = torch.nn.Parameter(Fp8Param(state), requires_grad=weight.requires_grad)
    for key, value in vars(weight).items():
        if key not in ("_fp8", "_is_param"):
            setattr(param, key, value)
    if torch.is_grad_enabled():  # TE keeps it where grad is on: a run that trains
        _keep_init_val(param, weight.detach().to("cpu", copy=True))
    linear._parameters["weight"] = param  # in place: the parameters keep their order


def _keep_init_val(param: Fp8Param, init_val: torch.Tensor) -> None:
    """The weight as built, before quantization, behind TE's two methods on this parameter
    alone (the distributed optimizer starts its fp32 mains from it where the parameter has
    them, and clears it): once cleared, the methods are gone, as TE's are."""

    def get_high_precision_init_val() -> torch.Tensor:
        return init_val

    def clear_high_precision_init_val() -> None:
        del param.get_high_precision_init_val, param.clear_high_precision_init_val

    param.get_high_precision_init_val = get_high_precision_init_val
    param.clear_high_precision_init_val = clear_high_precision_init_val


def replace_raw_data(tensor: Fp8Param, new_raw_data: torch.Tensor) -> None:
    """``fp8_utils.modify_underlying_storage``: the weight's bytes moved into DDP's uint8
    param buffer (``new_raw_data``, a view of it)."""
    state = tensor._fp8
    if new_raw_data.dtype != torch.uint8 or new_raw_data.shape != state.data.shape:
        raise ValueError(
            f"FP8 weight storage: expected uint8 {tuple(state.data.shape)}, got "
            f"{new_raw_data.dtype} {tuple(new_raw_data.shape)}"
        )
    new_raw_data.detach().copy_(state.data)
    state.data = new_raw_data.detach()
    state.stale()


def quantize_param_shard(
    model_params: list,
    main_params: list,
    start_offsets: list,
    data_parallel_group: Any,
    fsdp_shard_model_params: Any = None,
) -> None:
    """``fp8_utils.quantize_param_shard``: each rank's fp32 main shards (None where this
    rank holds none of a weight) cast into the FP8 weights' bytes, at ``start_offsets`` of
    each weight, with every weight's scale agreed over ``data_parallel_group``.

    Each shard is first rounded to the weight's dtype (what a run without the flag copies
    into its bf16 weight). Delayed scaling: the weight's history advances (the same on every
    rank) and the shard casts with its scale, taking its amax in the same pass. Current
    scaling: the shard's amax is taken first. Then every weight's shard amax is all-reduced
    (max) in one collective: current scaling casts with the scale of it, delayed scaling
    makes it the history's running amax. Every weight's transpose is rebuilt at its next use.
    On a GPU a weight costs a few launches: each cast is one kernel (``cast_into``), and the
    scales of weights that share a format and margin are computed together."""
    if fsdp_shard_model_params is not None:
        raise RuntimeError("--fp8-param-gather without TransformerEngine: not with FSDP")
    params = list(model_params)
    if not params:
        return
    states = [p._fp8 for p in params]
    device = states[0].data.device
    shards = [
        None if main is None or main.numel() == 0 else main.detach().view(-1).to(state.dtype)
        for main, state in zip(main_params, states)
    ]
    delayed = [s.history is not None for s in states]
    with torch.no_grad():
        amaxes = torch.zeros(len(states), dtype=torch.float32, device=device)
        for i, state in enumerate(states):
            if delayed[i]:
                history = state.history
                # the update on the kernels where the shard casts on them (a rank without a
                # shard updates on torch: the same bits)
                source = shards[i] if shards[i] is not None else history.scale
                state.scale_inv.copy_(
                    advance_history(history, source, state.fp8_dtype, state.margin)
                )
                if shards[i] is not None:
                    _cast_shard(state, shards[i], start_offsets[i], history.scale, amaxes[i])
            elif shards[i] is not None:
                amaxes[i] = _amax(shards[i])
        # a NaN amax (current scaling keeps NaN) as +inf: MAX over ranks may drop a NaN, and
        # both make the scale fall back to 1, as the whole weight's NaN amax does
        amaxes = torch.where(amaxes.isnan(), torch.inf, amaxes)
        _all_reduce_max(amaxes, data_parallel_group)
        scales = _current_scales(states, delayed, amaxes)
        for i, state in enumerate(states):
            if delayed[i]:
                state.history.current.copy_(amaxes[i])
            elif shards[i] is not None:
                _cast_shard(state, shards[i], start_offsets[i], scales[i])
            state.stale()


def _cast_shard(
    state: Fp8State,
    shard: torch.Tensor,
    start: int,
    scale: torch.Tensor,
    amax_out: torch.Tensor | None = None,
) -> None:
    """``shard`` cast into the weight's bytes from ``start`` on (``cast_into``)."""
    start = int(start)
    out = state.data.view(-1)[start : start + shard.numel()]
    cast_into(shard, scale, out, state.fp8_dtype, amax_out)


def _current_scales(
    states: list[Fp8State], delayed: list[bool], amaxes: torch.Tensor
) -> dict[int, torch.Tensor]:
    """Current scaling's weights: their scales (by index) from the all-reduced ``amaxes``,
    and their ``scale_inv`` set to the inverses. ``_scale`` is taken once for all weights of
    one format and margin (elementwise, so bitwise each weight's own)."""
    scales: dict[int, torch.Tensor] = {}
    groups: dict[tuple[float, int], list[int]] = {}
    for i, state in enumerate(states):
        if not delayed[i]:
            groups.setdefault((state.fp8_max, state.margin), []).append(i)
    for (fp8_max, margin), members in groups.items():
        # over every amax (a few dozen numbers; no index tensor, whose copy to the GPU
        # would wait for the stream), each member taking its own
        every_scale = _scale(amaxes, fp8_max, margin)
        every_inverse = every_scale.reciprocal()
        torch._foreach_copy_(
            [states[i].scale_inv for i in members], [every_inverse[i] for i in members]
        )
        scales.update((i, every_scale[i]) for i in members)
    return scales


def _all_reduce_max(t: torch.Tensor, group: Any) -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)


def post_all_gather(model_params: list) -> None:
    """After the param all-gather wrote the FP8 weights' bytes: their transposes are stale."""
    for p in model_params:
        if isinstance(p, Fp8Param):
            p._fp8.stale()


def install(namespace: dict) -> None:
    """Bind upstream's FP8-parameter hooks in ``megatron.core.fp8_utils`` (its module
    namespace, TE absent) to the native ones; names a version lacks are left alone."""
    te_is_float8tensor = namespace["is_float8tensor"]

    def is_float8tensor(tensor: Any) -> bool:
        return isinstance(tensor, Fp8Param) or te_is_float8tensor(tensor)

    namespace["is_float8tensor"] = is_float8tensor
    namespace["_modify_underlying_storage_impl"] = replace_raw_data
    namespace["_quantize_param_shard_impl"] = quantize_param_shard
    if "dequantize_fp8_tensor" in namespace:
        te_dequantize = namespace["dequantize_fp8_tensor"]

        def dequantize_fp8_tensor(tensor: Any) -> torch.Tensor:
            return tensor.dequantize() if isinstance(tensor, Fp8Param) else te_dequantize(tensor)

        namespace["dequantize_fp8_tensor"] = dequantize_fp8_tensor
    if "post_all_gather_processing" in namespace:
        te_post = namespace["post_all_gather_processing"]

        def post_all_gather_processing(model_params: Any) -> None:
            params = model_params if isinstance(model_params, list) else [model_params]
            post_all_gather(params)
            te_post([p for p in params if not isinstance(p, Fp8Param)])

        namespace["post_all_gather_processing"] = post_all_gather_processing
