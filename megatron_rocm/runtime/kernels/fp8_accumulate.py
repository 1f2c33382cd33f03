"""An FP8 GEMM that adds into its output: ``out += (a * a_inv) @ (b * b_inv)``, on cuBLASLt (CUDA)
or hipBLASLt (ROCm) with ``beta = 1``.

The FP8 linears' weight gradients go into Megatron's ``main_grad`` (gradient-accumulation
fusion). ``torch._scaled_mm`` has no ``beta``, so the gradient would land in a temporary fp32
tensor and a separate add would read it and ``main_grad`` and write ``main_grad`` again: on the
8B's linears that add costs a few percent of an FP8 step. TE adds in the GEMM's epilogue
(``beta = 1``); so does this module, through the same BLAS-Lt library torch itself calls for
``_scaled_mm``, found among the libraries the process has loaded and called with ``ctypes`` (the
two libraries share one API; only names and enum values differ). Into an fp32 ``out`` the
result is the separate add's to fp32 rounding; into a bf16 one (``--grad-reduce-in-bf16``) the
library's epilogue rounds more than ``out.add_(fp32)`` does (about twice the error on an NVIDIA
H200, as TE's accumulating GEMM has: ``scripts/bench/fp8_wgrad_accum.py``).

A library, format, shape or alignment the BLAS cannot serve answers False (``accumulate``) and
the caller adds as before. Each combination of operand formats and output dtype is checked once
per process against ``torch._scaled_mm`` plus the add on a small problem before the BLAS path
takes it; under hipBLASLt, which no AMD GPU has run here, every new plan (shape) is also checked
on its own shape first. A mismatch, an error or a failed call is logged once and leaves that
combination (or that plan) on the add.

Under block scaling (``--fp8-recipe blockwise``) the weight gradient's operands carry an fp32
scale per 128 elements along K (the tokens) on both sides; ``blocks=True`` sets cuBLASLt's
1 x 128 scale modes, as ``torch._scaled_mm`` does for them. cuBLASLt computes some
block-scaled problems wrong without an error (``fp8_blockwise.cublaslt_takes``), so every plan
of this mode is checked on its own call first, as under hipBLASLt.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rocm.runtime.kernels.launch import is_hip, log_fallback_once, reference_forced

WORKSPACE_BYTES = 32 * 1024 * 1024  # what TE gives cuBLASLt on Hopper
UNJUDGED_TRIES = 3  # calls whose product could not judge a new plan before it is given up


@dataclass(frozen=True)
class _Vendor:
    """One BLAS-Lt library: its file, its function prefix and the enum values this module sets."""

    library: str  # the shared object's name, as it appears among the loaded libraries
    prefix: str  # "cublasLt" or "hipblasLt"
    op_n: int
    op_t: int
    compute_32f: int
    r_32f: int
    types: dict[torch.dtype, int]  # torch dtype -> the library's data type
    desc_transa: int
    desc_transb: int
    desc_a_scale: int
    desc_b_scale: int
    pref_max_workspace: int
    pref_min_alignment: tuple[int, int, int, int] | None  # A, B, C, D; None: not settable
    algo_bytes: int  # sizeof(...MatmulAlgo_t)
    check_each_plan: bool  # no GPU of this vendor has run it here: check every new shape
    # (A's scale-mode attribute, B's, the mode of fp32 scales per 128 along K); None: no
    # block-scaled path here
    block_scales: tuple[int, int, int] | None


CUBLASLT = _Vendor(
    library="libcublasLt.so", prefix="cublasLt", op_n=0, op_t=1, compute_32f=68, r_32f=0,
    types={torch.float32: 0, torch.bfloat16: 14, torch.float8_e4m3fn: 28,
           torch.float8_e5m2: 29},
    desc_transa=3, desc_transb=4, desc_a_scale=17, desc_b_scale=18, pref_max_workspace=1,
    pref_min_alignment=(5, 6, 7, 8), algo_bytes=64, check_each_plan=False,
    block_scales=(31, 32, 4),  # CUBLASLT_MATMUL_DESC_{A,B}_SCALE_MODE, ..._SCALE_VEC128_32F
)  # fmt: skip
HIPBLASLT = _Vendor(
    library="libhipblaslt.so", prefix="hipblasLt", op_n=111, op_t=112, compute_32f=2, r_32f=0,
    types={torch.float32: 0, torch.bfloat16: 14, torch.float8_e4m3fn: 28,
           torch.float8_e5m2: 29, torch.float8_e4m3fnuz: 1000, torch.float8_e5m2fnuz: 1001},
    desc_transa=0, desc_transb=1, desc_a_scale=5, desc_b_scale=6, pref_max_workspace=1,
    pref_min_alignment=None, algo_bytes=24, check_each_plan=True,
    block_scales=None,  # hipBLASLt has no block-scaled FP8 GEMM: the Triton kernel adds instead
)  # fmt: skip
MIN_ALIGNMENT = 16  # bytes every pointer needs where the planner cannot be told its alignment
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _heuristic_type(vendor: _Vendor) -> type[ctypes.Structure]:
    """``...MatmulHeuristicResult_t``: the algorithm, then workspace, state, waves, reserved."""

    class Result(ctypes.Structure):
        _fields_ = [
            ("algo", ctypes.c_uint8 * vendor.algo_bytes),
            ("workspace", ctypes.c_size_t),
            ("state", ctypes.c_int),
            ("waves", ctypes.c_float),
            ("reserved", ctypes.c_int * 4),
        ]

    return Result


def _loaded_library(name: str) -> str | None:
    """The path of the loaded shared object whose file name starts with ``name``."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if path.rsplit("/", 1)[-1].startswith(name):
                    return path
    except OSError:
        return None
    return None


def alignment(ptr: int) -> int:
    """The largest power of two up to 256 that divides ``ptr`` (a planner's alignment)."""
    return min(256, ptr & -ptr) if ptr else 256


class _BlasLt:
    """One device's handle on the library: a handle, a workspace per stream (two GEMMs on two
    streams must not share one), and a plan per problem."""

    def __init__(self, vendor: _Vendor, path: str, device: torch.device) -> None:
        self.vendor, self.lib, self.device = vendor, ctypes.CDLL(path), device
        self.handle = ctypes.c_void_p()
        self._check(self._fn("Create")(ctypes.byref(self.handle)), "Create")
        self.workspaces: dict[int, torch.Tensor] = {}  # stream -> its workspace
        self.plans: dict[tuple, tuple | None] = {}  # None: this plan failed, add instead
        self.unjudged: dict[tuple, int] = {}  # plan key -> calls that could not check it
        self.lock = threading.Lock()  # the backward's thread and the main one share the plans
        self.heuristic = _heuristic_type(vendor)

    def workspace(self, stream: int) -> torch.Tensor:
        """``stream``'s workspace, made on first use (on a stream being captured, from the
        graph's pool, which keeps it while this module holds it)."""
        space = self.workspaces.get(stream)
        if space is None:
            space = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            self.workspaces[stream] = space
        return space

    def _fn(self, name: str) -> Any:
        return getattr(self.lib, self.vendor.prefix + name)

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{self.vendor.prefix}{what} returned status {status}")

    def _set(
        self, setter: str, obj: ctypes.c_void_p, attr: int, value: ctypes._SimpleCData
    ) -> None:
        size = ctypes.c_size_t(ctypes.sizeof(value))
        self._check(self._fn(setter)(obj, attr, ctypes.byref(value), size), setter)

    def _layout(self, dtype: torch.dtype, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        create = self._fn("MatrixLayoutCreate")
        status = create(
            ctypes.byref(layout), self.vendor.types[dtype], ctypes.c_uint64(rows),
            ctypes.c_uint64(cols), ctypes.c_int64(ld),
        )  # fmt: skip
        self._check(status, "MatrixLayoutCreate")
        return layout

    def plan(self, key: tuple, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple:
        """The descriptor, layouts and algorithm of ``out [m, n] += a [m, k] @ b [k, n]``; with
        block ``scales`` (``a_inv``, ``b_inv``) their pointers are set before the planner is
        asked, as TE and torch do (each call sets its own).

        In the library's column-major terms ``out^T [n, m] += b^T a^T``: its first operand is
        ``b``'s memory ([k, n] column-major read transposed), its second ``a``'s ([m, k]
        row-major is [k, m] column-major) untransposed: the TN layout FP8 GEMMs require."""
        m, n, k, a, b, out, aligns, blocks = key
        v = self.vendor
        desc = ctypes.c_void_p()
        self._check(
            self._fn("MatmulDescCreate")(ctypes.byref(desc), v.compute_32f, v.r_32f),
            "MatmulDescCreate",
        )
        self._set("MatmulDescSetAttribute", desc, v.desc_transa, ctypes.c_int32(v.op_t))
        self._set("MatmulDescSetAttribute", desc, v.desc_transb, ctypes.c_int32(v.op_n))
        if blocks:
            a_mode, b_mode, vec128 = v.block_scales
            for attr in (a_mode, b_mode):
                self._set("MatmulDescSetAttribute", desc, attr, ctypes.c_int32(vec128))
            self._scale_pointers(desc, *scales)
        first = self._layout(b, k, n, k)
        second = self._layout(a, k, m, k)
        result = self._layout(out, n, m, n)
        pref = ctypes.c_void_p()
        self._check(self._fn("MatmulPreferenceCreate")(ctypes.byref(pref)), "PreferenceCreate")
        self._set(
            "MatmulPreferenceSetAttribute", pref, v.pref_max_workspace,
            ctypes.c_uint64(WORKSPACE_BYTES),
        )  # fmt: skip
        for attr, align in zip(v.pref_min_alignment or (), aligns, strict=False):
            # the operands' own alignment (main_grad is a view into DDP's buffer), so the
            # planner picks no kernel that needs more
            self._set("MatmulPreferenceSetAttribute", pref, attr, ctypes.c_uint32(align))
        found = self.heuristic()
        count = ctypes.c_int(0)
        status = self._fn("MatmulAlgoGetHeuristic")(
            self.handle, desc, first, second, result, result, pref, 1, ctypes.byref(found),
            ctypes.byref(count),
        )  # fmt: skip
        self._fn("MatmulPreferenceDestroy")(pref)
        self._check(status, "MatmulAlgoGetHeuristic")
        if count.value < 1 or found.workspace > WORKSPACE_BYTES:
            raise RuntimeError(f"{v.prefix}: no algorithm for {key}")
        return desc, first, second, result, found

    def release(self, plan: tuple) -> None:
        """Free a plan's descriptor and layouts (one that is not kept)."""
        desc, first, second, result, _ = plan
        self._fn("MatmulDescDestroy")(desc)
        for layout in (first, second, result):
            self._fn("MatrixLayoutDestroy")(layout)

    def _scale_pointers(
        self, desc: ctypes.c_void_p, a_inv: torch.Tensor, b_inv: torch.Tensor
    ) -> None:
        """The library's A is our ``b``, its B our ``a`` (see :meth:`plan`)."""
        v = self.vendor
        self._set("MatmulDescSetAttribute", desc, v.desc_a_scale, ctypes.c_void_p(b_inv.data_ptr()))
        self._set("MatmulDescSetAttribute", desc, v.desc_b_scale, ctypes.c_void_p(a_inv.data_ptr()))

    def matmul(
        self,
        out: torch.Tensor,
        a: torch.Tensor,
        a_inv: torch.Tensor,
        b: torch.Tensor,
        b_inv: torch.Tensor,
        plan: tuple,
    ) -> None:
        """``out += a @ b`` on ``plan`` (:meth:`plan`), on the current stream."""
        one = ctypes.c_float(1.0)
        stream = torch.cuda.current_stream(out.device).cuda_stream
        workspace = self.workspace(stream)
        with self.lock:
            desc, first, second, result, found = plan
            self._scale_pointers(desc, a_inv, b_inv)
            status = self._fn("Matmul")(
                self.handle, desc, ctypes.byref(one), ctypes.c_void_p(b.data_ptr()), first,
                ctypes.c_void_p(a.data_ptr()), second, ctypes.byref(one),
                ctypes.c_void_p(out.data_ptr()), result, ctypes.c_void_p(out.data_ptr()), result,
                ctypes.byref(found.algo), ctypes.c_void_p(workspace.data_ptr()),
                ctypes.c_size_t(WORKSPACE_BYTES), ctypes.c_void_p(stream),
            )  # fmt: skip
        self._check(status, "Matmul")


_blas: dict[int, _BlasLt | None] = {}  # device index -> the library, None where unusable
_checked: dict[tuple, bool] = {}  # (device, a, b, out dtypes, blocks) -> passed its first use
_setup = threading.Lock()  # the first uses, from the main thread or autograd's


def _vendor() -> _Vendor:
    """The BLAS-Lt library of this build: hipBLASLt on ROCm, cuBLASLt on CUDA."""
    return HIPBLASLT if is_hip() else CUBLASLT


def _library(index: int) -> _BlasLt | None:
    if index not in _blas:
        vendor = _vendor()
        path = _loaded_library(vendor.library)
        try:
            if path is None:
                raise RuntimeError(f"{vendor.library} is not loaded in this process")
            with torch.cuda.device(index):
                _blas[index] = _BlasLt(vendor, path, torch.device("cuda", index))
        except Exception as exc:  # noqa: BLE001 - any failure of a library never run leaves the add
            log_fallback_once(
                "fp8_accumulate",
                f"FP8 weight gradients add into main_grad separately: {vendor.prefix} "
                f"unusable ({exc})",
            )
            _blas[index] = None
    return _blas[index]


def _fp8(rows: int, cols: int, dtype: torch.dtype, device: torch.device, gen: Any) -> torch.Tensor:
    return torch.randn(rows, cols, device=device, generator=gen).clamp(-8, 8).to(dtype)


def _agrees(
    blas: _BlasLt,
    out_dtype: torch.dtype,
    gen: Any,
    a: torch.Tensor,
    a_inv: torch.Tensor,
    b: torch.Tensor,
    b_inv: torch.Tensor,
    plan: tuple,
    blocks: bool = False,
) -> bool | None:
    """The BLAS path against ``torch._scaled_mm`` plus the add, from a random ``out_dtype``
    start of the product's own size (so a wrong product shows in a bf16 sum too): the same to
    fp32 rounding (bf16's for a bf16 ``out``), relative to the result's largest value. None
    where the product cannot judge: not finite, or zeros only."""
    scale_a = a_inv.t() if blocks else a_inv  # torch takes the 1 x 128 scales as [M, K / 128]
    want = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=b_inv, out_dtype=torch.float32)
    largest = want.abs().max()
    if not bool(torch.isfinite(largest)) or not bool(largest > 0):
        return None
    noise = torch.randn(want.shape, device=want.device, generator=gen).mul_(largest)
    start = noise.to(out_dtype)
    del noise
    want.add_(start)
    got = start.clone()
    del start
    blas.matmul(got, a, a_inv, b, b_inv, plan)
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    return bool(((got.float() - want).abs().max() <= tol * want.abs().max()).item())


def _block_inverses(blocks: int, rows: int, device: torch.device, gen: Any) -> torch.Tensor:
    """Inverse scales [blocks, rows] that differ block by block: powers of two, 2^-4 to 2^3."""
    powers = torch.randint(-4, 4, (blocks, rows), device=device, generator=gen)
    return torch.exp2(powers.float())


def _first_use_check(blas: _BlasLt, key: tuple) -> bool:
    """The formats of ``key`` on a small problem (``_agrees``); with ``blocks``, K of three
    blocks, the last one partial."""
    index, a_dtype, b_dtype, out_dtype, blocks = key
    device = torch.device("cuda", index)
    gen = torch.Generator(device=device).manual_seed(0)
    m, n, k = (32, 48, 320) if blocks else (32, 48, 64)
    a = _fp8(m, k, a_dtype, device, gen)
    b = _fp8(n, k, b_dtype, device, gen).t()  # column-major, as the callers' second operand
    if blocks:
        a_inv = _block_inverses(3, m, device, gen)
        b_inv = _block_inverses(3, n, device, gen)
    else:
        a_inv, b_inv = torch.tensor(0.5, device=device), torch.tensor(0.25, device=device)
    plan_key = (m, n, k, a_dtype, b_dtype, out_dtype, (256, 256, 256, 256), blocks)
    plan = blas.plan(plan_key, (a_inv, b_inv) if blocks else None)
    try:
        return _agrees(blas, out_dtype, gen, a, a_inv, b, b_inv, plan, blocks) is True
    finally:
        blas.release(plan)


def _plan_for(
    blas: _BlasLt,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[tuple, tuple | None]:
    """This call's plan key and plan (made, and where the vendor asks or block ``scales`` are
    given, checked on this call's operands on first use), or None where it cannot be made,
    failed, or the pointers are less aligned than a vendor that cannot be told their alignment
    needs. A call whose product cannot judge the plan (not finite, zeros, or no memory for the
    check) adds apart and leaves the check to the next; after ``UNJUDGED_TRIES`` such calls the
    shape stays on the add."""
    aligns = tuple(alignment(t.data_ptr()) for t in (b, a, out, out))  # A, B, C, D of the BLAS
    blocks = scales is not None
    key = (a.shape[0], b.shape[1], a.shape[1], a.dtype, b.dtype, out.dtype, aligns, blocks)
    if blas.vendor.pref_min_alignment is None and min(aligns) < MIN_ALIGNMENT:
        return key, None
    if key in blas.plans:
        return key, blas.plans[key]
    if torch.cuda.is_current_stream_capturing():
        return key, None  # planned and checked eagerly, never inside a capture
    plan = None
    try:
        plan = blas.plan(key, scales)
        if blas.vendor.check_each_plan or blocks:
            gen = torch.Generator(device=out.device).manual_seed(1)
            one = torch.ones((), device=out.device, dtype=torch.float32)
            a_inv, b_inv = scales if blocks else (one, one)
            try:
                verdict = _agrees(blas, out.dtype, gen, a, a_inv, b, b_inv, plan, blocks)
            except torch.OutOfMemoryError:  # the check holds a few [M, N] tensors; the add one
                verdict = None
            if verdict is None:  # nothing to judge by: this call adds apart, a later one asks
                blas.release(plan)
                tries = blas.unjudged[key] = blas.unjudged.get(key, 0) + 1
                if tries < UNJUDGED_TRIES:
                    return key, None
                plan = None
                raise RuntimeError(f"{tries} calls could not check it (non-finite or zero "
                                   "products, or no memory for the check)")  # fmt: skip
            if not verdict:
                raise RuntimeError("its result differs from torch._scaled_mm plus the add")
    except Exception as exc:  # noqa: BLE001 - see _library
        if plan is not None:
            blas.release(plan)
        plan = None
        log_fallback_once(
            f"fp8_accumulate plan {key}",
            f"FP8 weight gradient {key[:3]} adds into main_grad separately: {exc}",
        )
    blas.plans[key] = plan
    return key, plan


def _block_scales_fit(a_inv: torch.Tensor, b_inv: torch.Tensor, m: int, n: int, k: int) -> bool:
    """1 x 128 inverse scales as cuBLASLt reads them: fp32 [ceil(K/128), M] and [ceil(K/128),
    N], contiguous, each row 16-byte aligned (M and N multiples of 4)."""
    blocks = -(-k // 128)
    return (
        _vendor().block_scales is not None
        and m % 4 == 0
        and n % 4 == 0
        and all(
            s.dtype == torch.float32 and s.is_contiguous() and tuple(s.shape) == (blocks, rows)
            for s, rows in ((a_inv, m), (b_inv, n))
        )
    )


def _takes(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """What the BLAS path serves: FP8 operands, an fp32 or bf16 ``out`` of their product's shape,
    the layouts the callers pass, on the current GPU."""
    return (
        out.device.type == "cuda"
        and out.device.index == torch.cuda.current_device()
        and a.dtype in FP8_DTYPES
        and b.dtype in FP8_DTYPES
        and out.dtype in (torch.float32, torch.bfloat16)
        and a.dim() == b.dim() == out.dim() == 2
        and a.shape[1] == b.shape[0]
        and tuple(out.shape) == (a.shape[0], b.shape[1])
        and out.is_contiguous()
        and a.is_contiguous()
        and b.t().is_contiguous()
    )


def served(
    device: torch.device, a: torch.dtype, b: torch.dtype, out: torch.dtype, blocks: bool = False
) -> bool:
    """Whether these formats into this ``out`` dtype on ``device`` (with 1 x 128 ``blocks``)
    passed the first-use check (the BLAS path serves them; False also where none has been asked
    yet)."""
    return _checked.get((device.index, a, b, out, blocks), False)


def plans_served(device: torch.device, blocks: bool) -> int:
    """How many shapes of this mode (1 x 128 ``blocks`` or one scale a tensor) the BLAS path
    serves on ``device`` so far: planned and, where asked, checked on their own call."""
    blas = _blas.get(device.index)
    if blas is None:
        return 0
    return sum(plan is not None and key[-1] == blocks for key, plan in blas.plans.items())


def library_name() -> str:
    """The BLAS-Lt library this build would call."""
    return _vendor().prefix


def accumulate(
    out: torch.Tensor,
    a: torch.Tensor,
    a_inv: torch.Tensor,
    b: torch.Tensor,
    b_inv: torch.Tensor,
    blocks: bool = False,
) -> bool:
    """``out += (a * a_inv) @ (b * b_inv)`` in one GEMM, for a row-major FP8 ``a`` [M, K], a
    column-major FP8 ``b`` [K, N] and a contiguous fp32 or bf16 ``out`` [M, N] on a GPU; False
    (nothing done) where this GPU's BLAS cannot, and the caller adds itself. The inverse scales
    are one value each, or with ``blocks`` one per 128 along K: ``a_inv`` [ceil(K/128), M] and
    ``b_inv`` [ceil(K/128), N], contiguous (the memory ``torch._scaled_mm`` reads for them)."""
    if reference_forced("fp8_accumulate") or not _takes(out, a, b):
        return False
    if blocks and not _block_scales_fit(a_inv, b_inv, a.shape[0], b.shape[1], a.shape[1]):
        return False
    key = (out.device.index, a.dtype, b.dtype, out.dtype, blocks)
    with _setup:
        if key not in _checked:
            if torch.cuda.is_current_stream_capturing():
                return False  # the first use must not be captured
            blas = _library(out.device.index)
            if blas is None or not {a.dtype, b.dtype} <= set(blas.vendor.types):
                _checked[key] = False
                return False
            try:
                _checked[key] = _first_use_check(blas, key)
                reason = "its result differs from torch._scaled_mm plus the add"
            except torch.OutOfMemoryError:
                raise  # a problem of 32 x 48: the device is full, not the library at fault
            except Exception as exc:  # noqa: BLE001 - see _library
                _checked[key] = False
                reason = str(exc)
            if not _checked[key]:
                log_fallback_once(
                    f"fp8_accumulate {key}",
                    f"FP8 weight gradients ({a.dtype} x {b.dtype} into {out.dtype}"
                    f"{', 1 x 128 block scales' if blocks else ''}) add into "
                    f"main_grad separately: {blas.vendor.prefix}'s accumulating GEMM failed "
                    f"its first-use check ({reason})",
                )
        if not _checked[key]:
            return False
        blas = _blas[out.device.index]
        plan_key, plan = _plan_for(blas, out, a, b, (a_inv, b_inv) if blocks else None)
    if plan is None:
        return False
    try:
        blas.matmul(out, a, a_inv, b, b_inv, plan)
    except Exception as exc:  # noqa: BLE001 - see _library; a failed call queues nothing
        blas.plans[plan_key] = None
        log_fallback_once(f"fp8_accumulate call {plan_key}", f"FP8 weight gradient GEMM: {exc}")
        return False
    return True
