"""What ``validate_par4.py`` reports: one JSON record per train_small.py run, and the Markdown
scaling table of issue 14 (tokens/s per GPU of each four-GPU layout against the same model on
one GPU). Kept apart from the runner so that the table can be rebuilt from records alone.
"""

from __future__ import annotations

import json
from typing import Any

from scripts.training.train_small import SHAPES
from scripts.training.validate_distopt_resume import failure_reason


def summary_line(lines: list[str]) -> dict | None:
    """train_small.py's last line: its JSON summary (None when it never got there)."""
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                found = json.loads(line)
            except ValueError:
                continue
            if isinstance(found, dict) and "ok" in found:
                return found
    return None


def record(layout: Any, role: str, rc: int, lines: list[str]) -> dict:
    """One run's JSON line: the layout and train_small's verdict and timings."""
    summary = summary_line(lines) or {}
    problems = list(summary.get("problems", []))
    if not summary:  # hung and stopped, or train_small.py itself failed
        problems = [failure_reason(rc, lines) or f"train_small.py exited {rc} without a summary"]
    tokens = summary.get("tokens_per_s_at_median")
    return {
        "run": layout.name,
        "role": role,
        "preset_size": layout.size,
        "megatron_version": summary.get("megatron_version"),
        "nproc": layout.nproc,
        "tp": layout.tp,
        "pp": layout.pp,
        "vpp": layout.vpp,
        "cp": layout.cp,
        "ep": layout.ep,
        "dp": layout.dp,
        "sp": layout.sp,
        "seq_length": layout.seq_length,
        "micro_batch_size": layout.micro,
        "global_batch_size": layout.batch,
        "iterations": summary.get("iterations"),
        "first_loss": summary.get("first_loss"),
        "last_loss": summary.get("last_loss"),
        "ok": bool(summary.get("ok")) and rc == 0,
        "problems": problems,
        "tokens_per_s": tokens,
        "tokens_per_s_per_gpu": round(tokens / layout.nproc, 1) if tokens else None,
        "median_iter_ms": summary.get("median_iter_ms"),
        "mean_iter_ms": summary.get("mean_iter_ms"),
        "log": summary.get("log"),
    }


def gpu_names() -> list[str]:
    """The visible GPUs' names; none without torch or a GPU (torch imported only here)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def _ratio(run: dict, base: dict | None) -> str:
    mine, one = run.get("tokens_per_s_per_gpu"), (base or {}).get("tokens_per_s")
    return f"{mine / one:.2f}x" if mine and one else "-"


def _cell(value: float | None, fmt: str = "{:,.0f}") -> str:
    return fmt.format(value) if value else "-"


def render_table(records: list[dict], verdicts: list[dict], gpu: str, iters: int) -> str:
    """The Markdown scaling table: one row per 4-GPU layout."""
    runs = {r["run"]: r for r in records}
    resumed = {v["resume"]: v for v in verdicts}
    version = next((r["megatron_version"] for r in records if r.get("megatron_version")), None)
    size = next((r["preset_size"] for r in records if r.get("preset_size")), "small")
    shape = SHAPES[("llama", size)]
    lines = [
        f"GPU: {gpu}. Megatron-LM core {version or 'unknown'}, {size} Llama ({shape.num_layers} "
        f"layers, hidden {shape.hidden}), TE spec on the native backend, {iters} iterations; "
        "tokens/s at the median iteration after the first 3.",
        "",
        "| layout | GPUs | tokens/s per GPU | one-GPU tokens/s | per-GPU vs one GPU "
        "| losses first→last | resume verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in (r for r in records if r["role"] == "layout"):
        base = runs.get(f"{run['run']}-1gpu")
        if run["ok"]:
            loss = f"{run['first_loss']:.3f}→{run['last_loss']:.3f}"
        else:
            loss = "FAIL: " + "; ".join(run["problems"][:2]).replace("|", "/")
        verdict = resumed.get(run["run"])
        resume = "-" if verdict is None else verdict["status"]
        if verdict is not None and verdict["status"] != "pass":
            resume += f": {verdict['detail']}".replace("|", "/")
        lines.append(
            f"| {run['run']} | {run['nproc']} | {_cell(run['tokens_per_s_per_gpu'])} "
            f"| {_cell((base or {}).get('tokens_per_s'))} | {_ratio(run, base)} | {loss} "
            f"| {resume} |"
        )
    return "\n".join(lines) + "\n"
