"""The first-run report (``smoke --full --report DIR``): ``report.json`` and ``report.md`` a user
can attach to an issue: versions, GPUs and archs, every check with its status and figure.

A check that did not run here (no GPU, one GPU) is listed as skipped with its reason, never as
passed; the summary line counts passes, failures and skips separately.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

from megatron_rocm.envtools.smoke.runner import FAIL, PASS, SKIP, Report

# Dense bf16 peak TFLOP/s per GPU (vendor datasheets, no sparsity); matched on the device name.
PEAK_TFLOPS = {
    "MI355X": 2500.0,
    "MI325X": 1307.0,
    "MI300X": 1307.0,
    "MI250X": 383.0,
    "H200": 989.0,
    "H100": 989.0,
}


def peak_tflops(device_name: str) -> float | None:
    """The peak of the first table entry whose key is in ``device_name`` (None: unknown GPU)."""
    upper = device_name.upper()
    return next((v for k, v in PEAK_TFLOPS.items() if k in upper), None)


def environment() -> dict[str, Any]:
    """Versions and GPUs, as much as this Python can say (no GPU: an empty list)."""
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "hip": getattr(torch.version, "hip", None),
        "cuda": torch.version.cuda,
        "gpus": [],
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - absent or broken: reported as such
        env["triton"] = None
    try:
        from importlib.metadata import version

        env["megatron_rocm"] = version("megatron-rocm")
    except Exception:  # noqa: BLE001 - a source checkout is not installed
        env["megatron_rocm"] = "source checkout"
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            arch = (getattr(p, "gcnArchName", "") or "").split(":")[0] or f"sm_{p.major}{p.minor}"
            env["gpus"].append({"index": i, "name": p.name, "arch": arch})
    return env


def to_json(report: Report, env: dict[str, Any], figures: dict[str, Any]) -> str:
    return json.dumps({"environment": env, **report.to_dict(), "figures": figures}, indent=2) + "\n"


def to_markdown(report: Report, env: dict[str, Any]) -> str:
    counts = {s: sum(c.status == s for c in report.checks) for s in (PASS, FAIL, SKIP)}
    gpus = env.get("gpus") or []
    gpu_text = ", ".join(f"{g['name']} ({g['arch']})" for g in gpus) or "none visible"
    stack = f"ROCm {env['hip']}" if env.get("hip") else f"CUDA {env.get('cuda')}"
    lines = [
        "# megatron-rocm first-run report",
        "",
        f"- device: {report.device}",
        f"- GPUs: {gpu_text}",
        f"- torch {env.get('torch')} ({stack}), Triton {env.get('triton')}, "
        f"Python {env.get('python')}, megatron-rocm {env.get('megatron_rocm')}",
        f"- result: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped "
        "(skipped checks did not run here; they are not passes)",
        "",
        "| check | status | seconds | figure / reason |",
        "|---|---|---|---|",
    ]
    for c in report.checks:
        detail = c.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {c.name} | {c.status.upper()} | {c.seconds:.2f} | {detail} |")
    return "\n".join(lines) + "\n"


def write(directory: str | Path, report: Report, env: dict[str, Any], figures: dict) -> None:
    """``DIR/report.json`` and ``DIR/report.md``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(to_json(report, env, figures), encoding="utf-8")
    (out / "report.md").write_text(to_markdown(report, env), encoding="utf-8")
