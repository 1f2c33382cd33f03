"""All human-readable summaries of check/apply results, and JSON printing."""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any

from megatron_rocm.patchtool.results import HunkLabel, PatchResult, RefReport


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def hunk_summary(p: PatchResult) -> str:
    if p.error:
        return p.error
    if p.variant == "skip":
        return "not needed for this version"
    counts = Counter(h.label.value for h in p.hunks)
    order = [lb.value for lb in HunkLabel]
    return ", ".join(f"{counts[k]} {k}" for k in order if counts.get(k))


def first_failure(p: PatchResult) -> str:
    """One line naming the patch, the file, the hunk and the upstream lines that moved."""
    if p.error:
        return f"patch {p.patch_id}: {p.error}"
    for h in p.hunks:
        if not (h.label.applies or h.label is HunkLabel.ALREADY_APPLIED):
            return (
                f"patch {p.patch_id} ({p.variant}): {h.path} hunk {h.index} "
                f"{h.label.value}: {h.detail}"
            )
    return f"patch {p.patch_id}: ok"


def print_ref_report(r: RefReport, verbose: bool = False) -> None:
    status = "ok" if r.ok else "FAILS"
    print(f"{r.ref} ({r.commit[:12]}, megatron-core {r.version}): {status}")
    width = max((len(p.patch_id) for p in r.patches), default=10)
    for p in r.patches:
        label = p.label.value if p.variant != "skip" else "skip"
        print(f"  {p.patch_id:<{width}}  {label:<15} {p.variant or '-':<16} {hunk_summary(p)}")
        if verbose or not p.ok:
            for h in p.hunks:
                if h.label is not HunkLabel.CLEAN:
                    where = f"line {h.found_at}" if h.found_at else "nowhere"
                    extra = f": {h.detail}" if h.detail else ""
                    print(
                        f"      {h.path} hunk {h.index} (@{h.old_start}) "
                        f"{h.label.value} at {where}{extra}"
                    )
