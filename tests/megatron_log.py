"""Megatron's training log, as the tests of the scripts that read it write it
(``scripts/training``: train_small, compare_losses, example_summary, validate_par4): one
iteration line in ``training.py``'s field order, and a log file of such lines."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def iteration_line(
    i: int,
    total: int,
    loss: str | float,
    *,
    ms: float = 100.0,
    tflops: float | None = None,
    nan: int | None = None,
    batch: int = 16,
) -> str:
    """Iteration ``i`` of ``total``: ``ms`` a step, the loss as given (a float is written as
    Megatron writes it, ``{:.6E}``), the throughput and the NaN count where given."""
    loss_text = f"{loss:.6E}" if isinstance(loss, float) else loss
    fields = [
        f" [2026-11-29 00:00:00] iteration {i:>8}/{total:>8}",
        f"consumed samples: {batch * i}",
        f"elapsed time per iteration (ms): {ms}",
    ]
    if tflops is not None:
        fields.append(f"throughput per GPU (TFLOP/s/GPU): {tflops}")
    fields += [f"global batch size: {batch:>5}", f"lm loss: {loss_text}", "loss scale: 1.0"]
    if nan is not None:
        fields += ["number of skipped iterations:   0", f"number of nan iterations: {nan:3}"]
    return " | ".join(fields) + " |"


def write_log(path: Path, lines: Iterable[str], preamble: Iterable[str] = ("start-up",)) -> Path:
    """``path`` holding ``preamble`` then ``lines``, one a line; returns ``path``."""
    path.write_text("\n".join([*preamble, *lines]) + "\n")
    return path
