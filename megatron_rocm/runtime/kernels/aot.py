"""Ahead-of-time launch specs of the Triton kernels, and the AMD compile gate that uses them.

No AMD GPU runs in CI, so CI compiles every Triton kernel for AMD targets instead
(``tests/runtime/kernels/test_amd_compile_gate.py``): the PyPI Triton wheel carries the AMD
backend, linker and device libraries, so a CPU box can build gfx942/gfx950/gfx90a code objects
and read their LDS, scratch and wave counts.

Every module that defines a ``@triton.jit`` kernel also defines ``aot_configs(shapes)``: the
launches its own planner chooses for the model shapes in ``shapes`` (run with
``torch.version.hip`` set, so planners take their AMD branch). :func:`discover` finds every
kernel under ``megatron_rocm.runtime`` by walking the modules, so a new kernel without a hook
fails the gate: kernels are covered by construction, not by a hand-kept list.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import math
import pkgutil
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

HOOK = "aot_configs"

# LDS per workgroup (bytes) and the gate's share of it: a kernel at exactly the limit runs one
# workgroup per CU and fails to launch the day a compiler adds a byte.
LDS_BYTES = {"gfx90a": 64 * 1024, "gfx942": 64 * 1024, "gfx950": 160 * 1024}
LDS_SHARE = 0.9
WAVE = 64
MAX_THREADS = 1024
ARCHS = tuple(LDS_BYTES)

_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Model shapes the planners are asked about (the ranges real models span).

    ``model_*``: the shapes of the models the docs train; the gate asserts no scratch for them
    (wider shapes only have to compile and fit LDS).
    """

    head_dims: tuple[int, ...] = (64, 80, 96, 128, 192, 256)
    rotary_fractions: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    hiddens: tuple[int, ...] = (1024, 2048, 4096, 5120, 8192, 12288, 16384, 32768)
    ffn_hiddens: tuple[int, ...] = (1376, 2816, 11008, 14336, 28672)
    vocabs: tuple[int, ...] = (32000, 128256, 151936, 256000)
    tp_sizes: tuple[int, ...] = (1, 2, 8)
    experts: tuple[int, ...] = (8, 64, 256)
    seq_lens: tuple[int, ...] = (128, 1000, 4096, 16384, 32768, 65536)
    heads: tuple[int, ...] = (8, 32, 64, 128)
    batch: tuple[int, ...] = (1, 8)
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
    model_hiddens: tuple[int, ...] = (1024, 2048, 4096, 8192)
    model_seq_lens: tuple[int, ...] = (1000, 2048, 4096, 8192)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch a planner chooses: kernel, argument types, constexprs and launch options."""

    kernel: Any  # triton.runtime.jit.JITFunction
    signature: tuple[tuple[str, str], ...]  # (argument, Triton type) in argument order
    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int
    num_stages: int = 2
    grid: tuple[int, ...] = (1,)
    model_shape: bool = True  # a shape of a model in docs: no scratch allowed
    options: tuple[tuple[str, Any], ...] = ()
    neutral: tuple[str, ...] = ()  # constexprs that change no shape (a sign, a scalar load)
    archs: tuple[str, ...] = ARCHS  # where ROCm launches it (FP8 GEMMs: their arch's format)

    @property
    def key(self) -> tuple:
        """Identity of the compiled object (the grid and shape class do not change the code)."""
        return (
            id(self.kernel),
            self.signature,
            self.constexprs,
            self.num_warps,
            self.num_stages,
            self.options,
        )

    def describe(self) -> str:
        consts = ", ".join(f"{k}={v}" for k, v in self.constexprs)
        return f"{self.kernel.__name__}[{consts}; warps={self.num_warps}, stages={self.num_stages}]"


def launch(
    kernel: Any,
    constexprs: dict[str, Any],
    *,
    ptrs: dict[str, torch.dtype | str],
    floats: Iterable[str] = (),
    i64: Iterable[str] = (),
    num_warps: int,
    num_stages: int = 2,
    grid: Sequence[int] = (1,),
    model_shape: bool = True,
    neutral: Sequence[str] = (),
    archs: Sequence[str] = ARCHS,
    **options: Any,
) -> Launch:
    """A :class:`Launch` of ``kernel``: arguments in ``ptrs`` are pointers to that dtype, those in
    ``floats`` fp32 and ``i64`` int64 scalars, constexprs take ``constexprs``, the rest int32."""
    floats, i64 = set(floats), set(i64)
    sig = []
    for name, param in zip(kernel.arg_names, kernel.params, strict=True):
        if param.is_constexpr:
            if name not in constexprs:
                raise ValueError(f"{kernel.__name__}: constexpr {name} has no value")
            kind = "constexpr"
        elif name in ptrs:
            dt = ptrs[name]
            kind = "*" + (dt if isinstance(dt, str) else _TYPES[dt])
        elif name in floats:
            kind = "fp32"
        else:
            kind = "i64" if name in i64 else "i32"
        sig.append((name, kind))
    return Launch(
        kernel,
        tuple(sig),
        tuple(sorted(constexprs.items())),
        num_warps,
        num_stages,
        tuple(grid),
        model_shape,
        tuple(sorted(options.items())),
        tuple(neutral),
        tuple(archs),
    )


# -- discovery --------------------------------------------------------------------------------


@dataclasses.dataclass
class Found:
    kernels: dict[str, list[Any]]  # module name -> its JITFunctions
    unimportable: dict[str, str]  # module name -> why (only modules whose source has triton.jit)


def _jit_functions(module: Any) -> list[Any]:
    from triton.runtime.jit import JITFunction

    return [
        v
        for v in vars(module).values()
        if isinstance(v, JITFunction) and getattr(v.fn, "__module__", None) == module.__name__
    ]


def _mentions_jit(path: str | None) -> bool:
    if not path or not path.endswith(".py"):
        return False
    tree = ast.parse(Path(path).read_text())
    return any(isinstance(n, ast.Attribute) and n.attr == "jit" for n in ast.walk(tree))


def discover(package: str = "megatron_rocm.runtime") -> Found:
    """Every JITFunction defined under ``package``, by module. A module that does not import
    here (needs megatron) is only a problem if its source uses ``triton.jit``."""
    root = importlib.import_module(package)
    found = Found({}, {})
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        try:
            module = importlib.import_module(info.name)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            spec = importlib.util.find_spec(info.name)
            if _mentions_jit(spec.origin if spec else None):
                found.unimportable[info.name] = f"{type(exc).__name__}: {exc}"
            continue
        fns = _jit_functions(module)
        if fns:
            found.kernels[info.name] = fns
    return found


def missing_hooks(found: Found) -> list[str]:
    """One line per kernel module without an ``aot_configs`` hook (or that cannot be read)."""
    out = [
        f"{m}: uses triton.jit but does not import here ({why})"
        for m, why in found.unimportable.items()
    ]
    for name in found.kernels:
        if not callable(getattr(importlib.import_module(name), HOOK, None)):
            out.append(f"{name}: defines Triton kernels but no {HOOK}(shapes) (kernels/aot.py)")
    return out


def collect(found: Found, shapes: Shapes) -> list[Launch]:
    """Every launch the hooks of the discovered modules declare for ``shapes``."""
    out: list[Launch] = []
    for name in found.kernels:
        hook = getattr(importlib.import_module(name), HOOK, None)
        if callable(hook):
            out += hook(shapes)
    return out


def device_functions(kernels: Iterable[Any], pool: Iterable[Any]) -> set[str]:
    """Names of the JITFunctions of ``pool`` called (transitively) from ``kernels``' source."""
    by_name = {f.__name__: f for f in pool}
    seen: set[str] = set()
    todo = list(kernels)
    while todo:
        src = todo.pop().src
        for name, fn in by_name.items():
            if name not in seen and re.search(rf"\b{re.escape(name)}\s*\(", src):
                seen.add(name)
                todo.append(fn)
    return seen


# -- compiling and checking -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Result:
    shared: int  # LDS bytes
    scratch: int  # private segment bytes per lane (spills and private arrays)
    num_warps: int


def _scratch(amdgcn: str) -> int:
    m = re.search(r"\.private_segment_fixed_size:\s*(\d+)", amdgcn)
    return int(m.group(1)) if m else 0


def compile_for(spec: Launch, arch: str) -> Result:
    """Compile ``spec`` for ``arch`` (raises what Triton raises) and read its resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(spec.signature)
    src = ASTSource(spec.kernel, sig, dict(spec.constexprs))
    options = dict(spec.options, num_warps=spec.num_warps, num_stages=spec.num_stages)
    k = triton.compile(src, target=GPUTarget("hip", arch, WAVE), options=options)
    return Result(k.metadata.shared, _scratch(k.asm["amdgcn"]), k.metadata.num_warps)


def problems_of(spec: Launch, arch: str, result: Result | Exception) -> list[str]:
    """The gate's verdict on one compiled launch: one line per problem, empty when fine."""
    where = f"{arch} {spec.describe()}"
    if isinstance(result, Exception):
        first = (str(result).strip().splitlines() or [type(result).__name__])[-1]
        return [f"{where}: does not compile: {first}"]
    out = []
    limit = int(LDS_BYTES[arch] * LDS_SHARE)
    if result.shared > limit:
        out.append(f"{where}: LDS {result.shared} B > {limit} B (90% of {LDS_BYTES[arch]})")
    if spec.model_shape and result.scratch:
        out.append(f"{where}: {result.scratch} B of scratch per lane (register spills)")
    if result.num_warps * WAVE > MAX_THREADS:
        out.append(f"{where}: {result.num_warps} waves x {WAVE} > {MAX_THREADS} threads")
    return out


def grid_problems(spec: Launch) -> list[str]:
    """Grid limits of both vendors: x < 2^31, y and z <= 65535, every dim >= 1."""
    g = spec.grid
    bad = g[0] > 2**31 - 1 or any(d > 65535 for d in g[1:]) or any(d < 1 for d in g)
    return [f"{spec.describe()}: grid {g} outside the launch limits"] if bad else []


def arange_problems(spec: Launch) -> list[str]:
    """Block constexprs (``BLOCK*``/``*_P``/``B[MNK]``) must be powers of two for tl.arange."""
    out = []
    for name, value in spec.constexprs:
        if _blocky(name) and isinstance(value, int) and not isinstance(value, bool):
            if value and value & (value - 1):
                out.append(f"{spec.describe()}: {name}={value} is not a power of two")
    return out


def _compile_job(job: tuple) -> Result | Exception:
    """Worker side of :func:`gate`: find the kernel by module and name, compile it."""
    module, name, spec_fields, arch = job
    kernel = getattr(importlib.import_module(module), name)
    spec = Launch(kernel, *spec_fields)
    try:
        return compile_for(spec, arch)
    except Exception as exc:  # noqa: BLE001 - a compile error is a finding
        return RuntimeError(str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc))


def compile_all(
    specs: Sequence[Launch], archs: Sequence[str], cache: dict, workers: int = 1
) -> None:
    """Fill ``cache[(spec.key, arch)]`` with a :class:`Result` or the compile error, in
    ``workers`` processes (Triton compiles in one thread per process)."""
    todo = {}
    for spec in specs:
        for arch in archs:
            if arch in spec.archs and (spec.key, arch) not in cache:
                todo[(spec.key, arch)] = (spec, arch)
    if workers <= 1 or len(todo) < 2:
        for key, (spec, arch) in todo.items():
            try:
                cache[key] = compile_for(spec, arch)
            except Exception as exc:  # noqa: BLE001 - a compile error is a finding
                cache[key] = exc
        return
    import concurrent.futures
    import multiprocessing

    jobs = {
        key: (
            spec.kernel.fn.__module__,
            spec.kernel.__name__,
            _fields(spec),
            arch,
        )
        for key, (spec, arch) in todo.items()
    }
    ctx = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        for key, result in zip(jobs, pool.map(_compile_job, jobs.values()), strict=True):
            cache[key] = result


def _fields(spec: Launch) -> tuple:
    return tuple(getattr(spec, f.name) for f in dataclasses.fields(spec))[1:]


def gate(
    specs: Iterable[Launch],
    archs: Sequence[str] = ARCHS,
    cache: dict[tuple, Result | Exception] | None = None,
    workers: int = 1,
) -> list[str]:
    """Compile every distinct launch for every arch; return all problems (empty: the gate
    passes). ``cache`` keeps results across calls (the test shares one)."""
    cache = {} if cache is None else cache
    specs = list(specs)
    compile_all(specs, archs, cache, workers)
    out: list[str] = []
    for spec in specs:
        out += grid_problems(spec) + arange_problems(spec)
        for arch in archs:
            if arch in spec.archs:
                out += problems_of(spec, arch, cache[(spec.key, arch)])
    return list(dict.fromkeys(out))


def _blocky(name: str) -> bool:
    return name.startswith("BLOCK") or name.endswith("_P") or name in ("BM", "BN", "BK", "ROWS")


def representatives(specs: Iterable[Launch]) -> list[Launch]:
    """The launches worth compiling: of launches that differ only in block sizes and warps,
    16-bit float type (bf16 and fp16 share every layout) or ``neutral`` constexprs, the
    largest blocks (the most registers and LDS), among the doc models' shapes and overall.
    The power-of-two and grid checks still see every launch."""
    groups: dict[tuple, list[Launch]] = {}
    for s in specs:
        rest = tuple((k, v) for k, v in s.constexprs if not _blocky(k) and k not in s.neutral)
        sig = tuple((k, v.replace("bf16", "fp16")) for k, v in s.signature)
        groups.setdefault((id(s.kernel), sig, rest, s.options), []).append(s)

    def size(s: Launch) -> tuple[int, int]:
        blocks = [v for k, v in s.constexprs if _blocky(k) and isinstance(v, int)]
        return (math.prod(blocks), s.num_warps)

    out: dict[tuple, Launch] = {}
    for members in groups.values():
        models = [s for s in members if s.model_shape]
        for pick in (max(members, key=size), max(models, key=size) if models else None):
            if pick is not None and (pick.key not in out or pick.model_shape):
                out[pick.key] = pick
    return list(out.values())
