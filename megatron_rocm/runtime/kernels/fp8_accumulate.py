"""An FP8 GEMM that adds into its output: ``out += (a * a_inv) @ (b * b_inv)``, on cuBLASLt (CUDA)
or hipBLASLt (ROCm) with ``beta = 1``.

The FP8 linears' weight gradients go into Megatron's ``main_grad`` (gradient-accumulation
fusion). ``torch._scaled_mm`` has no ``beta``, so the gradient would land in a temporary fp32
tensor and a separate add would read it and ``main_grad`` and write ``main_grad`` again: on the
8B's linears that add costs a few percent of an FP8 step. TE adds in the GEMM's epilogue
(``beta = 1``); so does this module, through the same BLAS-Lt library torch itself calls for
``_scaled_mm``, found among the libraries the process has loaded and called with ``ctypes`` (the
two libraries share one API; only names and enum values differ). The epilogue computes
``1 * acc + 1 * out`` in fp32 and rounds once into ``out``'s dtype, as ``out.add_(fp32)`` does.

A library, format or shape the BLAS cannot serve answers False (``accumulate``) and the caller
adds as before. Each combination of operand formats and output dtype is checked once per
process against ``torch._scaled_mm`` plus the add on a small problem before the BLAS path takes
it; a mismatch or an error is logged once and leaves that combination on the add. No AMD GPU has
run the hipBLASLt branch here: there the first check decides.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rocm.runtime.kernels.launch import is_hip, log_fallback_once, reference_forced

WORKSPACE_BYTES = 32 * 1024 * 1024  # what TE gives cuBLASLt on Hopper


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
    algo_bytes: int  # sizeof(...MatmulAlgo_t)


CUBLASLT = _Vendor(
    library="libcublasLt.so", prefix="cublasLt", op_n=0, op_t=1, compute_32f=68, r_32f=0,
    types={torch.float32: 0, torch.bfloat16: 14, torch.float8_e4m3fn: 28,
           torch.float8_e5m2: 29},
    desc_transa=3, desc_transb=4, desc_a_scale=17, desc_b_scale=18, pref_max_workspace=1,
    algo_bytes=64,
)  # fmt: skip
HIPBLASLT = _Vendor(
    library="libhipblaslt.so", prefix="hipblasLt", op_n=111, op_t=112, compute_32f=2, r_32f=0,
    types={torch.float32: 0, torch.bfloat16: 14, torch.float8_e4m3fn: 28,
           torch.float8_e5m2: 29, torch.float8_e4m3fnuz: 1000, torch.float8_e5m2fnuz: 1001},
    desc_transa=0, desc_transb=1, desc_a_scale=5, desc_b_scale=6, pref_max_workspace=1,
    algo_bytes=24,
)  # fmt: skip


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


class _BlasLt:
    """One process's handle on the library: a handle, a workspace, and a plan per problem."""

    def __init__(self, vendor: _Vendor, path: str, device: torch.device) -> None:
        self.vendor, self.lib = vendor, ctypes.CDLL(path)
        self.handle = ctypes.c_void_p()
        self._check(self._fn("Create")(ctypes.byref(self.handle)), "Create")
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.plans: dict[tuple, tuple] = {}
        self.lock = threading.Lock()  # the backward's thread and the main one share the plans
        self.heuristic = _heuristic_type(vendor)

    def _fn(self, name: str) -> Any:
        return getattr(self.lib, self.vendor.prefix + name)

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{self.vendor.prefix}{what} returned status {status}")

    def _set(
        self, setter: str, obj: ctypes.c_void_p, attr: int, value: ctypes._SimpleCData
    ) -> None:
        self._check(self._fn(setter)(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), setter)

    def _layout(self, dtype: torch.dtype, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        create = self._fn("MatrixLayoutCreate")
        status = create(
            ctypes.byref(layout), self.vendor.types[dtype], ctypes.c_uint64(rows),
            ctypes.c_uint64(cols), ctypes.c_int64(ld),
        )  # fmt: skip
        self._check(status, "MatrixLayoutCreate")
        return layout

    def plan(
        self, m: int, n: int, k: int, a: torch.dtype, b: torch.dtype, out: torch.dtype
    ) -> tuple:
        """The descriptor, layouts and algorithm of ``out [m, n] += a [m, k] @ b [k, n]``.

        In the library's column-major terms ``out^T [n, m] += b^T a^T``: its first operand is
        ``b``'s memory ([k, n] column-major read transposed), its second ``a``'s ([m, k]
        row-major is [k, m] column-major) untransposed: the TN layout FP8 GEMMs require."""
        key = (m, n, k, a, b, out)
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        v = self.vendor
        desc = ctypes.c_void_p()
        self._check(
            self._fn("MatmulDescCreate")(ctypes.byref(desc), v.compute_32f, v.r_32f),
            "MatmulDescCreate",
        )
        self._set("MatmulDescSetAttribute", desc, v.desc_transa, ctypes.c_int32(v.op_t))
        self._set("MatmulDescSetAttribute", desc, v.desc_transb, ctypes.c_int32(v.op_n))
        first = self._layout(b, k, n, k)
        second = self._layout(a, k, m, k)
        result = self._layout(out, n, m, n)
        pref = ctypes.c_void_p()
        self._check(self._fn("MatmulPreferenceCreate")(ctypes.byref(pref)), "PreferenceCreate")
        self._set(
            "MatmulPreferenceSetAttribute", pref, v.pref_max_workspace,
            ctypes.c_uint64(WORKSPACE_BYTES),
        )  # fmt: skip
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
        plan = self.plans[key] = (desc, first, second, result, found)
        return plan

    def matmul(
        self,
        out: torch.Tensor,
        a: torch.Tensor,
        a_inv: torch.Tensor,
        b: torch.Tensor,
        b_inv: torch.Tensor,
    ) -> None:
        m, k = a.shape
        n = b.shape[1]
        v = self.vendor
        one = ctypes.c_float(1.0)
        stream = ctypes.c_void_p(torch.cuda.current_stream(out.device).cuda_stream)
        with self.lock:
            desc, first, second, result, found = self.plan(m, n, k, a.dtype, b.dtype, out.dtype)
            self._set(
                "MatmulDescSetAttribute", desc, v.desc_a_scale, ctypes.c_void_p(b_inv.data_ptr())
            )
            self._set(
                "MatmulDescSetAttribute", desc, v.desc_b_scale, ctypes.c_void_p(a_inv.data_ptr())
            )
            status = self._fn("Matmul")(
                self.handle, desc, ctypes.byref(one), ctypes.c_void_p(b.data_ptr()), first,
                ctypes.c_void_p(a.data_ptr()), second, ctypes.byref(one),
                ctypes.c_void_p(out.data_ptr()), result, ctypes.c_void_p(out.data_ptr()), result,
                ctypes.byref(found.algo), ctypes.c_void_p(self.workspace.data_ptr()),
                ctypes.c_size_t(WORKSPACE_BYTES), stream,
            )  # fmt: skip
        self._check(status, "Matmul")


_blas: dict[int, _BlasLt | None] = {}  # device index -> the library, None where unusable
_checked: dict[tuple, bool] = {}  # (device, a, b, out dtypes) -> passed the first-use check


def _library(device: torch.device) -> _BlasLt | None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _blas:
        vendor = HIPBLASLT if is_hip() else CUBLASLT
        path = _loaded_library(vendor.library)
        try:
            if path is None:
                raise RuntimeError(f"{vendor.library} is not loaded in this process")
            with torch.cuda.device(index):
                _blas[index] = _BlasLt(vendor, path, torch.device("cuda", index))
        except (OSError, AttributeError, RuntimeError) as exc:
            log_fallback_once(
                "fp8_accumulate",
                f"FP8 weight gradients add into main_grad separately: {vendor.prefix} "
                f"unusable ({exc})",
            )
            _blas[index] = None
    return _blas[index]


def _first_use_check(blas: _BlasLt, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """The BLAS path against ``torch._scaled_mm`` plus the add on a small problem of these
    formats: the same to fp32 rounding of a sum of 64 products (``out``'s dtype's otherwise)."""
    gen = torch.Generator(device=out.device).manual_seed(0)

    def fp8(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        x = torch.randn(rows, cols, device=out.device, generator=gen)
        return x.clamp(-8, 8).to(dtype)

    m, n, k = 32, 48, 64
    a8 = fp8(m, k, a.dtype)
    b8 = fp8(n, k, b.dtype).t()  # column-major, as the callers' second operand
    a_inv = torch.tensor(0.5, device=out.device)
    b_inv = torch.tensor(0.25, device=out.device)
    start = torch.randn(m, n, device=out.device, generator=gen).to(out.dtype)
    want = start.clone()
    want.add_(torch._scaled_mm(a8, b8, scale_a=a_inv, scale_b=b_inv, out_dtype=torch.float32))
    got = start.clone()
    blas.matmul(got, a8, a_inv, b8, b_inv)
    tol = 1e-5 if out.dtype == torch.float32 else 1e-2
    return bool(torch.allclose(got.float(), want.float(), rtol=tol, atol=tol))


def accumulate(
    out: torch.Tensor,
    a: torch.Tensor,
    a_inv: torch.Tensor,
    b: torch.Tensor,
    b_inv: torch.Tensor,
) -> bool:
    """``out += (a * a_inv) @ (b * b_inv)`` in one GEMM, for a row-major FP8 ``a`` [M, K], a
    column-major FP8 ``b`` [K, N] and a contiguous fp32 or bf16 ``out`` [M, N] on a GPU; False
    (nothing done) where this GPU's BLAS cannot, and the caller adds itself."""
    if (
        out.device.type != "cuda"
        or reference_forced("fp8_accumulate")
        or out.dtype not in (torch.float32, torch.bfloat16)
        or not (out.is_contiguous() and a.is_contiguous() and b.t().is_contiguous())
        or torch.cuda.is_current_stream_capturing()  # the first use must not be captured
        and (out.device.index, a.dtype, b.dtype, out.dtype) not in _checked
    ):
        return False
    blas = _library(out.device)
    if blas is None or a.dtype not in blas.vendor.types or b.dtype not in blas.vendor.types:
        return False
    key = (out.device.index, a.dtype, b.dtype, out.dtype)
    if key not in _checked:
        try:
            _checked[key] = _first_use_check(blas, a, b, out)
            reason = "its result differs from torch._scaled_mm plus the add"
        except RuntimeError as exc:
            _checked[key] = False
            reason = str(exc)
        if not _checked[key]:
            log_fallback_once(
                f"fp8_accumulate {key}",
                f"FP8 weight gradients ({a.dtype} x {b.dtype} into {out.dtype}) add into "
                f"main_grad separately: {blas.vendor.prefix}'s accumulating GEMM failed its "
                f"first-use check ({reason})",
            )
    if not _checked[key]:
        return False
    try:
        blas.matmul(out, a, a_inv, b, b_inv)
    except RuntimeError as exc:
        _checked[key] = False
        log_fallback_once(f"fp8_accumulate {key} call", f"FP8 weight gradient GEMM: {exc}")
        return False
    return True
