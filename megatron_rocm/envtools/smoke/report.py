"""Smoke reports: JSON ``{device, torch, checks: [{name, status, seconds, detail}]}`` and JUnit.

JUnit maps pass/fail/skip to an empty ``testcase``, a ``failure`` child and a ``skipped`` child,
which is what CI systems (GitLab, Jenkins, GitHub test reporters) render.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

from megatron_rocm.envtools.smoke.runner import FAIL, SKIP, Report


def device_description() -> str:
    """'AMD Instinct MI300X (gfx942) x8, ROCm 6.4' / 'NVIDIA H100 (sm_90) x1, CUDA 13.0' / 'cpu'."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "cpu"
    p = torch.cuda.get_device_properties(0)
    arch = (getattr(p, "gcnArchName", "") or "").split(":")[0] or f"sm_{p.major}{p.minor}"
    hip = getattr(torch.version, "hip", None)
    stack = f"ROCm {hip}" if hip else f"CUDA {torch.version.cuda}"
    return f"{p.name} ({arch}) x{torch.cuda.device_count()}, {stack}"


def to_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2) + "\n"


def to_junit(report: Report) -> str:
    failures = sum(c.status == FAIL for c in report.checks)
    skipped = sum(c.status == SKIP for c in report.checks)
    total = sum(c.seconds for c in report.checks)
    suite = ET.Element(
        "testsuite",
        {
            "name": "megatron-rocm-smoke",
            "tests": str(len(report.checks)),
            "failures": str(failures),
            "errors": "0",
            "skipped": str(skipped),
            "time": f"{total:.3f}",
        },
    )
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", {"name": "device", "value": report.device})
    ET.SubElement(props, "property", {"name": "torch", "value": report.torch})
    for c in report.checks:
        group, _, _ = c.name.partition(".")
        case = ET.SubElement(
            suite,
            "testcase",
            {
                "classname": f"smoke.{group}",
                "name": c.name,
                "time": f"{c.seconds:.3f}",
            },
        )
        if c.status == FAIL:
            ET.SubElement(case, "failure", {"message": c.detail[:500]}).text = c.detail
        elif c.status == SKIP:
            ET.SubElement(case, "skipped", {"message": c.detail})
        elif c.detail:
            ET.SubElement(case, "system-out").text = c.detail
    ET.indent(suite)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suite, "unicode") + "\n"


def write(report: Report, json_file: str | None, junit_file: str | None) -> None:
    for path, text in ((json_file, to_json), (junit_file, to_junit)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text(report), encoding="utf-8")
