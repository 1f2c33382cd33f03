"""Value types for check/apply results, shared by the engine, the CLI and the matrix reports."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field


class HunkLabel(enum.StrEnum):
    """How one hunk lands on a tree. Ordered from best to worst by ``severity``."""

    CLEAN = "clean"  # context and removed lines match at the recorded line
    OFFSET = "offset"  # match exactly, at another line
    FUZZ = "fuzz"  # match only after dropping outer context lines
    ALREADY_APPLIED = "already-applied"  # the post-image is already there
    NEEDS_3WAY = "needs-3-way"  # no direct match; a 3-way merge with the recorded base works
    CONFLICT = "conflict"  # no way to place it
    FILE_GONE = "file-gone"  # the file the hunk edits does not exist
    OUT_OF_SCOPE = "out-of-scope"  # the source (e.g. a PyPI sdist) does not hold this file

    @property
    def applies(self) -> bool:
        """Does the hunk land as a change (clean, offset or fuzz; out-of-scope counts: the
        source lacks the file, so there is nothing to change)? Acceptance is ``accepts``."""
        return self in (HunkLabel.CLEAN, HunkLabel.OFFSET, HunkLabel.FUZZ, HunkLabel.OUT_OF_SCOPE)

    @property
    def severity(self) -> int:
        return list(HunkLabel).index(self)


def accepts(label: HunkLabel, three_way: bool = False) -> bool:
    """The one acceptance rule: may ``apply`` go ahead with a hunk labelled ``label``?

    Clean, offset, fuzz and out-of-scope hunks apply; already-applied ones need nothing;
    needs-3-way only with ``--3way``. Conflict and file-gone never. ``check``, ``matrix``,
    ``apply`` and ``export`` all decide through this function.
    """
    return (
        label.applies
        or label is HunkLabel.ALREADY_APPLIED
        or (three_way and label is HunkLabel.NEEDS_3WAY)
    )


@dataclass
class HunkResult:
    path: str
    index: int  # 1-based hunk number within the file
    label: HunkLabel
    old_start: int  # line recorded in the diff
    found_at: int | None = None  # line where it matched (None: nowhere)
    detail: str = ""  # for failures: the upstream lines that no longer match
    text: str = ""  # the hunk itself, for reports


# The words a patch's cell can hold besides a hunk label: one vocabulary for check and matrix.
SKIP = "skip"  # a variant says the change is not needed at this version
MERGED = "merged"  # skipped because upstream took the change (a merged patch's last range)
NO_VARIANT = "no-variant"  # no variant covers the tree's version


@dataclass
class PatchResult:
    patch_id: str
    variant: str | None  # diff file used; None when no variant covers the version
    hunks: list[HunkResult] = field(default_factory=list)
    error: str = ""  # e.g. "no variant for 0.11.0"
    merged: bool = False  # a skip variant of a patch upstream merged, from its merge on

    @property
    def status(self) -> str:
        """What ``check`` and ``matrix`` both print for this patch at this ref: ``skip`` or
        ``merged`` for a skip variant, ``no-variant``, else the worst hunk label."""
        if self.variant == SKIP:
            return MERGED if self.merged else SKIP
        if self.error and self.variant is None:
            return NO_VARIANT
        return self.label.value

    @property
    def label(self) -> HunkLabel:
        """The worst hunk label (an error without hunks counts as a conflict)."""
        if self.error:
            return HunkLabel.CONFLICT
        relevant = [h.label for h in self.hunks if h.label is not HunkLabel.OUT_OF_SCOPE]
        if not relevant:
            return HunkLabel.OUT_OF_SCOPE if self.hunks else HunkLabel.CLEAN
        if all(lbl is HunkLabel.ALREADY_APPLIED for lbl in relevant):
            return HunkLabel.ALREADY_APPLIED
        return max(
            (lb for lb in relevant if lb is not HunkLabel.ALREADY_APPLIED),
            key=lambda lb: lb.severity,
            default=HunkLabel.CLEAN,
        )

    def accepted(self, three_way: bool = False) -> bool:
        return not self.error and all(accepts(h.label, three_way) for h in self.hunks)

    @property
    def ok(self) -> bool:
        return self.accepted()


@dataclass
class RefReport:
    ref: str
    commit: str
    version: str
    patches: list[PatchResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.patches)

    def to_dict(self) -> dict:
        d = asdict(self)
        for p, pd in zip(self.patches, d["patches"]):
            pd["label"] = p.label.value
            pd["status"] = p.status
            pd["ok"] = p.ok
            for hd in pd["hunks"]:
                hd["label"] = HunkLabel(hd["label"]).value
        d["ok"] = self.ok
        return d
