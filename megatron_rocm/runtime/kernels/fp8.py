"""FP8 GEMMs with current (per-tensor) scaling on ``torch._scaled_mm``, without TransformerEngine.

What upstream's ``--fp8-format {e4m3,hybrid} --fp8-recipe tensorwise`` asks of TE's linears:
each GEMM operand is quantized with the amax of the tensor itself (no history), the forward's
activations and weights in E4M3, the backward's output gradients in E5M2 (``hybrid``) or E4M3
(``e4m3``); the product comes out in the activations' dtype. The FP8 dtypes follow the GPU:
OCP ``float8_e4m3fn``/``float8_e5m2`` on CUDA and gfx950 (MI355), the ``fnuz`` variants on
gfx942 (MI300), whose E4M3 tops out at 240 instead of 448.

``torch._scaled_mm`` wants its second operand column-major and both of its dimensions (the
first operand's columns too) divisible by 16; the linears check their feature sizes when they
are built (``check_gemm_dims``), and the token dimension, which the weight gradient reduces
over, is zero-padded here. On the CPU the GEMM dequantizes and multiplies in fp32 (what the
GPU's FP8 tensor cores compute up to their accumulation order); ``scaled_mm`` is the GPU path
and the tests run it on the CPU where torch's own kernel takes the OCP dtypes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from megatron_rocm.runtime.kernels.fp8_amax_reduction import (
    AmaxReduction,
    current_scope,
    reduction_for,
)
from megatron_rocm.runtime.kernels.launch import (
    log_fallback_once,
    use_triton,
)

_ALIGN = 16  # torch._scaled_mm: every dimension of its operands a multiple of 16
# what fp8_triton's kernels read (here: that module imports Triton at import time)
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Fp8Formats:
    """The FP8 dtypes of one run: forward operands and output gradients."""

    forward: torch.dtype
    backward: torch.dtype


def gpu_arch() -> str | None:
    """The ROCm GPU's gfx name (``gfx942``), or None off ROCm or without a GPU."""
    if not getattr(torch.version, "hip", None) or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName.split(":")[0]


def uses_fnuz(arch: str | None = None) -> bool:
    """Whether this GPU's FP8 is the ``fnuz`` variant: ROCm on gfx942 (MI300); gfx950 and
    CUDA use the OCP formats."""
    if not getattr(torch.version, "hip", None):
        return False
    return (arch if arch is not None else gpu_arch()) == "gfx942"


def formats(fp8_format: str, arch: str | None = None) -> Fp8Formats:
    """The dtypes for upstream's ``--fp8-format`` (``e4m3`` or ``hybrid``) on this GPU."""
    if fp8_format not in ("e4m3", "hybrid"):
        raise ValueError(f"--fp8-format {fp8_format!r}: expected e4m3 or hybrid")
    fnuz = uses_fnuz(arch)
    e4m3 = torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn
    e5m2 = torch.float8_e5m2fnuz if fnuz else torch.float8_e5m2
    return Fp8Formats(forward=e4m3, backward=e5m2 if fp8_format == "hybrid" else e4m3)


def unsupported_gpu_reason() -> str | None:
    """Why this machine's GPU has no FP8 GEMM, or None (also None without a GPU: nothing to
    judge at argument validation on a CPU)."""
    if not torch.cuda.is_available():
        return None
    if getattr(torch.version, "hip", None):
        arch = gpu_arch()
        return None if arch in ("gfx942", "gfx950") else f"{arch} has no FP8 GEMMs"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"compute capability {major}.{minor} has no FP8 GEMMs (8.9 or later)"
    return None


def _scale(
    amax: torch.Tensor, fp8_max: float, margin: int, fallback: torch.Tensor | None = None
) -> torch.Tensor:
    """``fp8_max / amax / 2**margin`` in fp32 (``fp8_triton._scale_of`` computes the same bits
    on a GPU): ``fallback`` (1 by default) where the amax is zero or not finite (TE's rule:
    current scaling falls back to 1, delayed scaling keeps its scale), at most fp32's largest
    value (an amax under ``fp8_max / FLT_MAX`` would make it inf, and zeros NaN)."""
    usable = (amax > 0) & torch.isfinite(amax)
    keep = torch.ones_like(amax) if fallback is None else fallback
    scale = torch.where(usable, fp8_max / (amax * 2.0**margin), keep)
    return scale.clamp(max=torch.finfo(torch.float32).max)


def _apply(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, fp8_max: float
) -> torch.Tensor:
    """``x * scale`` in fp32, clamped and cast."""
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)


def _amax(x: torch.Tensor) -> torch.Tensor:
    """The largest ``|x|`` in fp32, one read of ``x`` (exact: it is one of ``x``'s values)."""
    return torch.linalg.vector_norm(x, float("inf")).float()


def _quantize_scaled(
    x: torch.Tensor, dtype: torch.dtype, fp8_max: float, margin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, scale)`` by ``x``'s own amax, in eager torch."""
    scale = _scale(_amax(x), fp8_max, margin)
    return _apply(x, scale, dtype, fp8_max), scale


def _quantize(
    x: torch.Tensor, dtype: torch.dtype, fp8_max: float, margin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager torch: the reference every other path is bitwise equal to."""
    x_fp8, scale = _quantize_scaled(x, dtype, fp8_max, margin)
    return x_fp8, scale.reciprocal()


_eager_keys: set[tuple[torch.dtype, torch.dtype]] = set()  # their Triton launch failed
_BYTES_KEY = (torch.uint8, torch.uint8)  # the byte transpose's entry in ``_eager_keys``


def failed_kernels() -> frozenset[tuple[torch.dtype, torch.dtype]]:
    """The (FP8 dtype, input dtype) keys whose Triton launch failed in this process (they
    quantize on torch's path since; ``(uint8, uint8)``: the byte transpose)."""
    return frozenset(_eager_keys)


def _fall_back_once(key: tuple[torch.dtype, torch.dtype], exc: Exception) -> None:
    """Remember ``key`` as failed and say so once: the training step goes on, slower."""
    _eager_keys.add(key)
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    what = "byte transpose" if key == _BYTES_KEY else f"quantize ({key[1]} to {key[0]})"
    log_fallback_once(
        f"fp8-triton-{key}",
        f"FP8 {what} kernel failed ({type(exc).__name__}: {reason[:200]}); using eager torch",
    )


def _triton_takes(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``x`` quantizes through ``fp8_triton``: a GPU tensor (or the interpreter), a
    dtype the kernels read, not forced to the reference, not failed before."""
    return (
        x.numel() > 0
        and x.dtype in _TRITON_DTYPES
        and (dtype, x.dtype) not in _eager_keys
        and use_triton(x, kernel="fp8")
    )


def _launch_or_none(key: tuple[torch.dtype, torch.dtype], launch: Any) -> Any:
    """``launch()``, or None once it failed (logged once; the caller quantizes with torch).
    Out-of-memory is no kernel failure: it raises."""
    try:
        return launch()
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - a kernel failure: torch still works
        _fall_back_once(key, exc)
        return None


def _quantize_triton(
    x: torch.Tensor, dtype: torch.dtype, margin: int, ld_t: int | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
    """``(x_fp8, x_fp8_t, inverse_scale)`` of a 2-D ``x`` in three launches
    (``fp8_triton``); None where the grid would not fit or once the kernels failed for this
    key (logged once). Only the launches are guarded: a bad ``margin`` raises as eager does."""
    from megatron_rocm.runtime.kernels import fp8_triton

    fp8_max, margin_factor = float(torch.finfo(dtype).max), 2.0**margin
    if not fp8_triton.fits_grid(*x.shape):
        return None
    with torch.no_grad(), _on_device(x):
        x = x.detach().contiguous()

        def launch() -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
            scale, inverse = fp8_triton.scales(x, fp8_max, margin_factor)
            return (*fp8_triton.cast_transpose(x, scale, dtype, fp8_max, ld_t), inverse)

        return _launch_or_none((dtype, x.dtype), launch)


def _on_device(x: torch.Tensor) -> Any:
    """Launch on ``x``'s GPU (Triton launches on the current device)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


@dataclass(eq=False)
class AmaxHistory:
    """Delayed scaling's state for one tensor a linear quantizes on every call (its input, its
    weight or its output gradient): the last ``length`` amaxes (upstream's
    ``--fp8-amax-history-len``) and the scale the next quantize uses (TE's ``DelayedScaling``).

    Each quantize first advances (:meth:`advance`): the previous quantize's amax joins the
    history and the scale becomes ``fp8_max / amax / 2**margin`` of the history's largest entry
    (``--fp8-amax-compute-algo max``) or of that amax alone (``most_recent``), kept where that
    amax is not finite; then it casts with that scale and takes the tensor's own amax in the
    same pass. As in TE, NaN elements are left out of an amax and a zero amax changes nothing.
    TE starts every tensor at scale 1; here a tensor's first quantize scales by its own amax
    (current scaling), so the first step's output gradients do not flush to zero in E5M2. The
    state lives on the device (no host sync), so a CUDA graph captured after the first
    quantize replays it; capturing the first one raises. ``group``: each quantize's amax is
    all-reduced (max) over it, as TE reduces over upstream's amax reduction group: at once, or
    inside a forward region or its backward together with the group's other amaxes at the
    region's end (``fp8_amax_reduction``), and always before this history advances again, so
    every rank scales alike and a checkpoint, which one rank writes for all, holds the group's
    amax; None for a whole weight (the same on every rank that holds it) and single-rank
    groups, the group for a weight split over TP ranks.
    """

    length: int
    most_recent: bool
    group: Any = None
    started: bool = False
    history: torch.Tensor | None = None  # fp32 [length], a ring
    current: torch.Tensor | None = None  # fp32 0-d: the running quantize's amax
    pos: torch.Tensor | None = None  # int32 0-d: where ``current`` goes next
    scale: torch.Tensor | None = None  # fp32 0-d: the scale the next cast uses
    reduction: AmaxReduction | None = None  # the group's batched all-reduces (``current``'s)
    buffer_index: int = -1  # which of the reduction's buffers holds ``current``
    deferred_at: int = -1  # the reduction's flush count when ``current`` was last deferred

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"--fp8-amax-history-len {self.length}: expected 1 or more")

    def allocate(self, device: torch.device) -> None:
        """The state on ``device``, empty."""
        self.history = torch.zeros(self.length, dtype=torch.float32, device=device)
        if self.group is None:
            self.current = torch.zeros((), dtype=torch.float32, device=device)
        else:  # a slot in the group's buffers, all-reduced together
            self.reduction = reduction_for(self.group)
            self.current, self.buffer_index = self.reduction.slot(device)
            self.deferred_at = -1
        self.pos = torch.zeros((), dtype=torch.int32, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)

    def start(self, x: torch.Tensor) -> None:
        """After a first quantize (by current scaling): ``x``'s amax is the running one."""
        self._begin(x)
        self.current.copy_(amax_without_nan(x.detach()))

    def skip(self, x: torch.Tensor, fp8_max: float, margin: int) -> None:
        """A quantize of an empty ``x`` on a rank of an amax reduction group: nothing to cast,
        but the steps the group's other ranks take (their first quantize's start, or the
        history's advance; then the all-reduce of the amax), so every rank's collectives and
        history stay in step. An empty tensor adds amax 0, which changes nothing (TE's rule).
        Where every rank's first tensor is empty, the first non-empty one casts at scale 1,
        TE's starting scale."""
        if not self.started:
            self._begin(x)
        else:
            self.settle()
            self.advance(fp8_max, margin, triton=False)
        self.reduce()

    def _begin(self, x: torch.Tensor) -> None:
        """The state allocated on ``x``'s device, started; never inside a CUDA graph capture."""
        if capturing(x):
            raise RuntimeError(
                "FP8 delayed scaling: a linear's first quantize is being captured in a CUDA "
                "graph; run at least one eager iteration first (--cuda-graph-warmup-steps)"
            )
        self.allocate(x.device)
        self.started = True

    def reduce(self) -> None:
        """After each quantize's cast: the running amax all-reduced (max) over ``group``,
        deferred to the active scope's end where there is one (``fp8_amax_reduction``), else,
        and while a CUDA graph is being captured (a replay runs no flush), at once."""
        if self.group is None:
            return
        scope = current_scope()
        if scope is None or capturing(self.current):
            torch.distributed.all_reduce(
                self.current, op=torch.distributed.ReduceOp.MAX, group=self.group
            )
            return
        self.deferred_at = self.reduction.defer(self.buffer_index)
        scope.add(self.reduction)

    def settle(self) -> None:
        """The running amax reduced over ``group`` if it is not yet (a flush of every
        buffer of the group the amax shares): before the history advances, outside the
        kernels' fallback (a collective is no kernel failure, and is issued once)."""
        if self.reduction is not None and not self.reduction.settled(self.deferred_at):
            self.reduction.flush()

    def advance(self, fp8_max: float, margin: int, triton: bool) -> torch.Tensor:
        """Fold the running amax into the history and set the scale (``fp8_triton``'s
        ``_delayed_update`` on a GPU, the same bits in torch otherwise); returns the scale's
        inverse, a new tensor (a linear saves it for its backward, by which time the state
        may have moved on). A zero amax (an all-zero tensor) changes nothing, as in TE: it
        neither joins the history nor pushes an entry out. The caller settles the amax first
        (:meth:`settle`)."""
        inverse = torch.empty((), dtype=torch.float32, device=self.scale.device)
        if triton:
            from megatron_rocm.runtime.kernels import fp8_triton

            fp8_triton.delayed_update(
                self.history, self.current, self.pos, self.scale, inverse, fp8_max,
                2.0**margin, self.most_recent,
            )  # fmt: skip
            return inverse
        seen = self.current > 0
        at = self.pos.long().reshape(1)
        entry = torch.where(seen, self.current, self.history[at].reshape(()))
        self.history.index_copy_(0, at, entry.reshape(1))
        amax = self.current if self.most_recent else self.history.max()
        self.scale.copy_(torch.where(seen, _scale(amax, fp8_max, margin, self.scale), self.scale))
        self.pos.copy_(torch.where(seen, (self.pos + 1) % self.length, self.pos))
        self.current.zero_()
        return inverse.copy_(self.scale.reciprocal())


def capturing(x: torch.Tensor) -> bool:
    """Whether ``x``'s GPU stream is being captured into a CUDA graph."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def amax_without_nan(x: torch.Tensor, dims: tuple[int, ...] = ()) -> torch.Tensor:
    """The largest ``|x|`` in fp32 with NaN elements left out (TE's amax under delayed
    scaling and block scaling, ``fmaxf``: one NaN must not freeze a history's scale for its
    whole length), over ``dims`` (all of them by default)."""
    return torch.where(x.isnan(), 0, x.abs()).amax(dim=dims).float()


def _quantize_delayed(
    x: torch.Tensor, dtype: torch.dtype, margin: int, ld_t: int | None, history: AmaxHistory
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(x_fp8, x_fp8_t or None, inverse_scale)`` of a 2-D, non-empty ``x`` under delayed
    scaling: two launches and one read of ``x`` on a GPU (``fp8_triton``), torch elsewhere,
    with ``MEGATRON_ROCM_KERNELS=reference:fp8`` or once the kernels failed (logged once)."""
    fp8_max = float(torch.finfo(dtype).max)
    key = (dtype, x.dtype)
    with torch.no_grad(), _on_device(x):
        x = x.detach()
        triton = _triton_takes(x, dtype)
        if triton:
            from megatron_rocm.runtime.kernels import fp8_triton

            triton = fp8_triton.fits_grid(*x.shape)
            x = x.contiguous()
        inverse = advance_history(history, x, dtype, margin, triton)
        cast = None
        if triton:
            cast = _launch_or_none(
                key,
                lambda: fp8_triton.cast_transpose(
                    x, history.scale, dtype, fp8_max, ld_t, history.current
                ),
            )
        if cast is None:
            torch.maximum(history.current, amax_without_nan(x), out=history.current)
            x_fp8 = _apply(x, history.scale, dtype, fp8_max)
            cast = (x_fp8, None if ld_t is None else _padded_transpose(x_fp8))
    return cast[0], cast[1], inverse


def advance_history(
    history: AmaxHistory,
    x: torch.Tensor,
    dtype: torch.dtype,
    margin: int,
    triton: bool | None = None,
) -> torch.Tensor:
    """``history.advance`` before a delayed quantize of ``x`` into ``dtype``; its inverse
    scale. On the Triton update where ``x`` quantizes on the kernels (``triton``: None asks
    ``_triton_takes``), else, or once that launch failed (logged once), torch's."""
    fp8_max = float(torch.finfo(dtype).max)
    history.settle()
    if _triton_takes(x, dtype) if triton is None else triton:
        inverse = _launch_or_none((dtype, x.dtype), lambda: history.advance(fp8_max, margin, True))
        if inverse is not None:
            return inverse
    return history.advance(fp8_max, margin, False)


def cast_into(
    x: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    dtype: torch.dtype,
    amax_out: torch.Tensor | None = None,
) -> None:
    """``out`` (contiguous uint8, as many elements as ``x``): the bytes of ``_apply(x, scale)``
    in the FP8 ``dtype``, written in place (``--fp8-param-gather``'s shard of a weight, cast
    into the distributed optimizer's buffer). ``amax_out`` (an fp32 element, delayed scaling):
    raised to ``amax_without_nan(x)``. One launch on a GPU (``fp8_triton.cast_flat``, bitwise
    torch's), torch's ops elsewhere or once the kernel failed (logged once)."""
    fp8_max = float(torch.finfo(dtype).max)
    x = x.detach().reshape(-1)
    if out.dtype != torch.uint8 or out.numel() != x.numel() or not out.is_contiguous():
        raise ValueError(
            f"cast_into: out must be {x.numel()} contiguous uint8 bytes, got {out.dtype} "
            f"{tuple(out.shape)}"
        )
    if x.numel() == 0:  # nothing to cast, no amax to raise
        return
    if _triton_takes(x, dtype):
        from megatron_rocm.runtime.kernels import fp8_triton

        with torch.no_grad(), _on_device(x):
            x = x.contiguous()

            def launch() -> bool:
                fp8_triton.cast_flat(x, scale, out, fp8_max, dtype, amax_out)
                return True

            if _launch_or_none((dtype, x.dtype), launch):
                return
    with torch.no_grad():
        out.copy_(_apply(x, scale, dtype, fp8_max).view(torch.uint8))
        if amax_out is not None:
            amax_out.copy_(torch.maximum(amax_out, amax_without_nan(x)))


def transpose_fp8(x_fp8: torch.Tensor) -> torch.Tensor:
    """``x_fp8`` [R, C] (contiguous, one byte an element) as a new contiguous [C, R] tensor:
    one launch on a GPU (``fp8_triton.transpose_bytes``), torch's copy elsewhere or once the
    kernel failed (logged once)."""
    if x_fp8.element_size() != 1 or x_fp8.dim() != 2:
        raise ValueError(
            f"transpose_fp8: expected a 2-D tensor of one byte an element, got {x_fp8.dtype} "
            f"{tuple(x_fp8.shape)}"
        )
    if (
        x_fp8.numel()
        and x_fp8.is_contiguous()
        and _BYTES_KEY not in _eager_keys
        and use_triton(x_fp8, kernel="fp8")
    ):
        from megatron_rocm.runtime.kernels import fp8_triton

        if fp8_triton.fits_grid(*x_fp8.shape):
            with torch.no_grad(), _on_device(x_fp8):
                done = _launch_or_none(_BYTES_KEY, lambda: fp8_triton.transpose_bytes(x_fp8))
            if done is not None:
                return done
    return x_fp8.t().contiguous()


_Quantized = TypeVar("_Quantized", bound=tuple)


def _padded_transpose(x_fp8: torch.Tensor) -> torch.Tensor:
    """``x_fp8``'s transpose with its rows padded to a multiple of 16 (torch's path; on a
    GPU the cast-transpose kernel writes it)."""
    return pad_rows(x_fp8).t().contiguous()


def _on_history(
    history: AmaxHistory | None,
    x: torch.Tensor,
    dtype: torch.dtype,
    margin: int,
    delayed: Callable[[], _Quantized],
    current: Callable[[], _Quantized],
) -> _Quantized:
    """Delayed scaling's bookkeeping around one quantize (``quantize``, ``quantize_transposed``):
    ``delayed()`` once ``history`` has started; else ``current()`` (current scaling), whose
    tensor starts the history; then the amax is all-reduced over the history's group (at
    once, or deferred to the active scope: ``AmaxHistory.reduce``). An
    empty ``x`` casts by ``current()``; on a rank of an amax reduction group it keeps the
    history in step with the group (:meth:`AmaxHistory.skip`), elsewhere it leaves the
    history as it was."""
    if history is None:
        return current()
    if x.numel() == 0:
        if history.group is not None:
            history.skip(x, float(torch.finfo(dtype).max), margin)
        return current()
    if history.started:
        done = delayed()
    else:
        done = current()
        history.start(x)
    history.reduce()  # a collective: outside the kernels' fallback, issued once
    return done


def quantize(
    x: torch.Tensor,
    dtype: torch.dtype,
    margin: int = 0,
    *,
    triton: bool | None = None,
    history: AmaxHistory | None = None,
) -> tuple[torch.Tensor, Any]:
    """``(x_fp8, inverse_scale)``: ``x * scale`` cast with saturation, where ``scale =
    fp8_max / amax(x) / 2**margin`` (``_scale``: 1 where ``x`` is all zeros or not finite, at
    most fp32's largest value); ``x_fp8 * inverse_scale`` is ``x`` again up to FP8 rounding.
    Both scales stay fp32 tensors on the device (no host sync); neither carries autograd (the
    FP8 linear's own backward uses them). ``triton``: through ``fp8_triton`` (bitwise the
    eager path; True asks for it without the checks, as the benchmark and the tests do); None
    (the default) takes it on a GPU unless ``MEGATRON_ROCM_KERNELS`` names ``fp8`` for the
    reference path or the kernels failed once (logged). ``history``: delayed scaling (the
    scale from ``x``'s earlier amaxes, :class:`AmaxHistory`) instead of ``x``'s own amax; after
    its first quantize the kernels are chosen as with ``triton=None``."""
    fp8_max = float(torch.finfo(dtype).max)

    def rows() -> torch.Tensor:  # 2-D, for the kernels (not for an empty x: no last dim to keep)
        return x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)

    def delayed() -> tuple[torch.Tensor, torch.Tensor]:
        x_fp8, _, inverse = _quantize_delayed(rows(), dtype, margin, None, history)
        return x_fp8.view(x.shape), inverse

    def current() -> tuple[torch.Tensor, Any]:
        if x.numel() == 0:  # no amax to take
            return x.detach().to(dtype), torch.ones((), device=x.device)
        if triton if triton is not None else _triton_takes(x, dtype):
            done = _quantize_triton(rows(), dtype, margin, None)
            if done is not None:
                return done[0].view(x.shape), done[2]
        with torch.no_grad():
            return _quantize(x.detach(), dtype, fp8_max, margin)

    return _on_history(history, x, dtype, margin, delayed, current)


def quantize_transposed(
    x: torch.Tensor, dtype: torch.dtype, margin: int = 0, history: AmaxHistory | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_fp8, x_fp8_t, inverse_scale)`` of a 2-D ``x`` [R, C]: ``quantize``'s result and its
    transpose [C, R'] (R rounded up to a multiple of 16, zeros past R) -- the layouts
    ``torch._scaled_mm`` takes for the weight gradient's operands and the input gradient's
    weight, with no copy left for it to make. On a GPU one Triton pass writes both
    (``fp8_triton.cast_transpose``, bitwise ``quantize``); elsewhere, with
    ``MEGATRON_ROCM_KERNELS=reference:fp8``, or once the kernels failed (logged once), torch
    quantizes and copies. ``history``: delayed scaling, as ``quantize``."""
    rows = x.shape[0]
    ld_t = rows + (-rows % _ALIGN)

    def current() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        done = _quantize_triton(x, dtype, margin, ld_t) if _triton_takes(x, dtype) else None
        if done is None:
            x_fp8, inverse_scale = quantize(x, dtype, margin, triton=False)
            done = x_fp8, _padded_transpose(x_fp8), inverse_scale
        return done  # type: ignore[return-value]

    return _on_history(
        history,
        x,
        dtype,
        margin,
        lambda: _quantize_delayed(x, dtype, margin, ld_t, history),
        current,
    )


def dequantize(x_fp8: torch.Tensor, inverse_scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of a quantized tensor."""
    return x_fp8.float() * inverse_scale


def scaled_mm(
    a: torch.Tensor,
    a_inv: torch.Tensor,
    b: torch.Tensor,
    b_inv: torch.Tensor,
    out_dtype: Any,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``(a * a_inv) @ (b * b_inv)`` for 2-D FP8 ``a`` [M, K] and ``b`` [K, N] on
    ``torch._scaled_mm``: ``a`` made row-major and ``b`` column-major where they are not.
    ``fast_accum``: Hopper's faster, less exact FP8 accumulation (TE and torchao use it for
    the forward's GEMM only; other GPUs ignore it)."""
    if not a.is_contiguous():
        a = a.contiguous()
    if not b.t().is_contiguous():
        b = b.t().contiguous().t()
    return torch._scaled_mm(
        a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype, use_fast_accum=fast_accum
    )


def _emulated_mm(
    a: torch.Tensor,
    a_inv: torch.Tensor,
    b: torch.Tensor,
    b_inv: torch.Tensor,
    out_dtype: Any,
    fast_accum: bool = False,
) -> torch.Tensor:
    return (dequantize(a, a_inv) @ dequantize(b, b_inv)).to(out_dtype)


def fp8_mm(
    a: torch.Tensor,
    a_inv: torch.Tensor,
    b: torch.Tensor,
    b_inv: torch.Tensor,
    out_dtype: Any,
    fast_accum: bool = False,
) -> torch.Tensor:
    """The FP8 GEMM of this device: ``scaled_mm`` on a GPU, the fp32 emulation on the CPU."""
    mm = scaled_mm if a.device.type == "cuda" else _emulated_mm
    return mm(a, a_inv, b, b_inv, out_dtype, fast_accum)


def fp8_mm_into(
    out: torch.Tensor,
    a: torch.Tensor,
    a_inv: torch.Tensor,
    b: torch.Tensor,
    b_inv: torch.Tensor,
    fast_accum: bool = False,
) -> None:
    """``fp8_mm`` written into ``out`` (contiguous, ``out``'s dtype), for a row-major ``a`` and
    a column-major ``b``: no output allocated on a GPU (``torch._scaled_mm(out=)``)."""
    if a.device.type != "cuda":
        out.copy_(_emulated_mm(a, a_inv, b, b_inv, out.dtype))
        return
    torch._scaled_mm(
        a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out.dtype, use_fast_accum=fast_accum,
        out=out,
    )  # fmt: skip


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] with zero rows up to a multiple of 16 (the weight gradient's inner
    dimension): zeros add nothing to the product."""
    extra = -x.shape[0] % _ALIGN
    return x if extra == 0 else torch.nn.functional.pad(x, (0, 0, 0, extra))


def check_gemm_dims(owner: str, in_features: int, out_features: int) -> None:
    """One line when a linear's GEMM cannot run on ``torch._scaled_mm``."""
    if in_features % _ALIGN or out_features % _ALIGN:
        raise ValueError(
            f"{owner}: FP8 (--fp8-format) needs the GEMM's sizes divisible by {_ALIGN}, got "
            f"in={in_features}, out={out_features} (per tensor-parallel rank); train in bf16"
        )
