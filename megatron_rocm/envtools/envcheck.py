"""What ``doctor`` looks at: the torch build, the GPUs, the collective library, Triton, and the
environment variables the ROCm Megatron guides tell users to set, plus the mistakes we can spot.

Everything is collected into plain data first (``collect``) and judged second (``problems``), so
tests can simulate a ROCm machine with a fake torch module and a fake filesystem root.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_rocm.envtools import rocm_support
from megatron_rocm.runtime import settings

# Variables the seed guides (AMD's Megatron docs and the adaptation guides) set or ask about,
# plus the ones PyTorch/RCCL read that change what Megatron sees.
WATCHED_VARS = (
    "HIP_VISIBLE_DEVICES",
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "PYTORCH_ROCM_DEVICE",
    "HSA_OVERRIDE_GFX_VERSION",
    "HSA_ENABLE_SDMA",
    "HSA_NO_SCRATCH_RECLAIM",
    "GPU_MAX_HW_QUEUES",
    "GPU_MAX_HEAP_SIZE",
    "GPU_MAX_ALLOC_PERCENT",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "NNODES",
    "NODE_RANK",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "NCCL_IB_HCA",
    "NCCL_IB_DISABLE",
    "NCCL_DEBUG",
    "NCCL_NVLS_ENABLE",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "MIOPEN_FIND_MODE",
    "TRITON_INTERPRET",
    *settings.runtime_names(),  # the runtime's MEGATRON_ROCM_* switches, and their old names
    *settings.DEPRECATED,
)

# Architectures ROCm supports natively: HSA_OVERRIDE_GFX_VERSION on these only hides the real
# ISA from the compiler (wrong kernels, or crashes), it never helps.
SUPPORTED_ARCHS = frozenset(
    {
        "gfx908",
        "gfx90a",
        "gfx940",
        "gfx941",
        "gfx942",
        "gfx950",
        "gfx1030",
        "gfx1100",
        "gfx1101",
        "gfx1200",
        "gfx1201",
    }
)

ROCM_TORCH_HINT = rocm_support.ROCM_TORCH_HINT


@dataclass
class Gpu:
    index: int
    name: str
    arch: str  # gfx942 on ROCm, sm_90 on CUDA
    memory_gib: float


@dataclass
class Problem:
    code: str
    message: str
    fix: str


@dataclass
class Snapshot:
    """Everything doctor reports; ``problems`` is filled by :func:`problems`."""

    torch: str | None = None
    hip: str | None = None
    cuda: str | None = None
    collectives: str | None = None  # "RCCL 2.21.5" / "NCCL 2.27.3"
    triton: str | None = None
    gpus: list[Gpu] = field(default_factory=list)
    rocm_installed: bool = False  # /opt/rocm or /dev/kfd: this machine has the ROCm stack
    interfaces: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _version_string(v: Any) -> str:
    """torch.cuda.nccl.version() is an int on old torch and a tuple on new torch."""
    if isinstance(v, tuple):
        return ".".join(str(x) for x in v)
    if isinstance(v, int) and v > 1000:  # 2708 -> 2.7.8, 21903 -> 2.19.3
        major, rest = divmod(v, 10000 if v >= 10000 else 1000)
        minor, patch = divmod(rest, 100)
        return f"{major}.{minor}.{patch}"
    return str(v)


def _gpus(torch: Any) -> list[Gpu]:
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver reads as "no GPU", which we report
        return []
    gpus = []
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        arch = (getattr(p, "gcnArchName", "") or "").split(":")[0]
        if not arch.startswith("gfx"):
            arch = f"sm_{p.major}{p.minor}"
        gpus.append(Gpu(i, p.name, arch, round(p.total_memory / 2**30, 1)))
    return gpus


def _triton_version() -> str | None:
    try:
        import triton
    except Exception:  # noqa: BLE001 - any failure means Triton is unusable
        return None
    return getattr(triton, "__version__", "unknown")


def collect(
    torch: Any, environ: Mapping[str, str] | None = None, root: Path = Path("/")
) -> Snapshot:
    """Read the machine. ``torch`` may be None (not installed); ``root`` lets tests fake /sys."""
    environ = os.environ if environ is None else environ
    snap = Snapshot()
    snap.env = {k: environ[k] for k in WATCHED_VARS if k in environ}
    snap.rocm_installed = (root / "opt/rocm").exists() or (root / "dev/kfd").exists()
    net = root / "sys/class/net"
    snap.interfaces = sorted(p.name for p in net.iterdir()) if net.is_dir() else []
    if torch is None:
        return snap
    snap.torch = str(torch.__version__)
    snap.hip = getattr(torch.version, "hip", None)
    snap.cuda = getattr(torch.version, "cuda", None)
    snap.gpus = _gpus(torch)
    try:
        lib = "RCCL" if snap.hip else "NCCL"
        snap.collectives = f"{lib} {_version_string(torch.cuda.nccl.version())}"
    except Exception:  # noqa: BLE001 - CPU builds have no NCCL; that is reported as None
        snap.collectives = None
    snap.triton = _triton_version()
    return snap


def _device_list(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


def _check_ifname(var: str, value: str, interfaces: list[str]) -> Problem | None:
    """NCCL/Gloo syntax: comma list of prefixes, '=' for an exact name, '^' to exclude."""
    if not interfaces or value.startswith("^"):
        return None
    exact = value.startswith("=")
    names = [n for n in value.lstrip("=").split(",") if n]
    found = [n for n in names if any(i == n or (not exact and i.startswith(n)) for i in interfaces)]
    if found:
        return None
    return Problem(
        "bad-ifname",
        f"{var}={value} matches no network interface (have: {', '.join(interfaces)})",
        f"set {var} to an interface listed by `ip a` (the one that carries inter-node traffic)",
    )


def _visibility_problems(env: Mapping[str, str]) -> list[Problem]:
    out = []
    hip, cuda = env.get("HIP_VISIBLE_DEVICES"), env.get("CUDA_VISIBLE_DEVICES")
    if hip is not None and cuda is not None and _device_list(hip) != _device_list(cuda):
        out.append(
            Problem(
                "visible-devices-disagree",
                f"HIP_VISIBLE_DEVICES={hip} but CUDA_VISIBLE_DEVICES={cuda}",
                "set only one of them (HIP_VISIBLE_DEVICES on ROCm) or give both the same list",
            )
        )
    rocr = env.get("ROCR_VISIBLE_DEVICES")
    if rocr is not None and hip is not None:
        n = len(_device_list(rocr))
        bad = [d for d in _device_list(hip) if _whole_number(d) and int(d) >= n]
        if bad:
            out.append(
                Problem(
                    "visible-devices-out-of-range",
                    f"HIP_VISIBLE_DEVICES={hip} indexes into the {n} GPU(s) of "
                    f"ROCR_VISIBLE_DEVICES={rocr}; {','.join(bad)} does not exist",
                    "HIP indices count within ROCR_VISIBLE_DEVICES: renumber them from 0, or unset one",
                )
            )
    return out


def _whole_number(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also takes ``'²'``, which ``int`` refuses."""
    return text.isascii() and text.isdigit()


def _int_problems(env: Mapping[str, str]) -> list[Problem]:
    out = []
    port = env.get("MASTER_PORT")
    if port is not None and not (_whole_number(port) and 0 < int(port) < 65536):
        out.append(
            Problem(
                "bad-master-port",
                f"MASTER_PORT={port!r} is not a port number (1-65535)",
                "export MASTER_PORT=6000 (any free port, the same on every node)",
            )
        )
    for var in ("WORLD_SIZE", "NNODES", "NODE_RANK", "GPU_MAX_HW_QUEUES"):
        if var in env and not _whole_number(env[var].strip()):
            out.append(
                Problem(
                    f"bad-{var.lower()}",
                    f"{var}={env[var]!r} is not an integer",
                    f"set {var} to a whole number or unset it",
                )
            )
    return out


def _torch_problems(snap: Snapshot) -> list[Problem]:
    out = []
    if snap.rocm_installed and snap.hip is None:
        out.append(
            Problem(
                "cuda-torch-on-rocm",
                f"this machine has ROCm (/opt/rocm or /dev/kfd) but torch {snap.torch} is not a "
                "ROCm build (torch.version.hip is None)",
                f"install the ROCm build of PyTorch: {ROCM_TORCH_HINT}",
            )
        )
    for line in rocm_support.problems(snap.torch, snap.hip, snap.triton):
        out.append(Problem("older-than-supported", line, "see docs/rocm.md"))
    if not snap.gpus:
        fix = (
            (
                "check HIP_VISIBLE_DEVICES/ROCR_VISIBLE_DEVICES, `rocm-smi`, and that you are in "
                "the 'video' and 'render' groups (or the container got --device=/dev/kfd "
                "--device=/dev/dri)"
            )
            if snap.hip or snap.rocm_installed
            else ("check CUDA_VISIBLE_DEVICES and `nvidia-smi`; a CPU-only torch sees no GPU")
        )
        out.append(Problem("no-gpu", "torch sees no GPU (torch.cuda.device_count() == 0)", fix))
    elif snap.triton is None:
        out.append(
            Problem(
                "no-triton",
                "Triton is not importable: every megatron_rocm kernel runs its slow "
                "torch reference",
                "install the Triton that matches torch (pytorch-triton-rocm on ROCm)",
            )
        )
    override = snap.env.get("HSA_OVERRIDE_GFX_VERSION")
    native = [g.arch for g in snap.gpus if g.arch in SUPPORTED_ARCHS]
    if override and snap.gpus and len(native) == len(snap.gpus):
        out.append(
            Problem(
                "needless-gfx-override",
                f"HSA_OVERRIDE_GFX_VERSION={override} is set but the GPUs ({', '.join(sorted(set(native)))}) "
                "are supported natively",
                "unset HSA_OVERRIDE_GFX_VERSION: it makes ROCm compile for the wrong ISA",
            )
        )
    return out


def problems(snap: Snapshot) -> list[Problem]:
    """Judge a snapshot; torch missing is the caller's business (a distinct exit code)."""
    found: list[Problem] = []
    if snap.torch is not None:
        found += _torch_problems(snap)
    found += _visibility_problems(snap.env)
    found += _int_problems(snap.env)
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if var in snap.env:
            p = _check_ifname(var, snap.env[var], snap.interfaces)
            if p:
                found.append(p)
    return found
