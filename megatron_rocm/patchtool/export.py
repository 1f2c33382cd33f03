"""Fork-branch commits -> the series' diff files, normalized so an unchanged fork is zero diff.

A patch's stored diff is kept byte for byte when applying it to the commit's parent gives the
commit's tree (it may have landed at an offset on this tag: rewriting it then would only churn
line numbers). Otherwise the commit's normalized diff replaces it, with the ``git am`` header
of ``diffio``. A commit without a trailer on top of the fork becomes a new patch appended to
the series; ``forkscan`` refuses every commit export could not map back safely.

Nothing is written until every commit has been mapped, its diff read back by the reader
``apply`` uses, and the series as it would be written shown to rebuild the fork (applied to
the fork's base, it makes the same patch at each position with each commit's tree): a refusal
leaves the series as it was. The writes are all or nothing
(``Writes.commit``: a failed rename puts back what had moved, and a run killed half way is
finished or undone by the next command that loads the series) and are not interrupted by Ctrl-C.
"""

from __future__ import annotations

import copy
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from packaging.version import Version

from megatron_rocm.errors import PatchFailed, UsageError
from megatron_rocm.patchtool import diffio, engine, gitcmd, interrupts, series_journal
from megatron_rocm.patchtool.forkscan import (
    ForkCommit,
    fork_commits,
    patch_with_reason,
    refuse_busy_or_dirty,
)
from megatron_rocm.patchtool.hunks import FileDiff, apply_file, decode, encode, split_lines
from megatron_rocm.patchtool.results import accepts
from megatron_rocm.patchtool.series import (
    Patch,
    Series,
    Variant,
    format_patch_toml,
    is_control,
    load_series,
    release_of,
    update_patch_toml,
)

__all__ = ["ExportItem", "ForkCommit", "export_fork", "fork_commits"]


@dataclass
class ExportItem:
    patch_id: str
    action: str  # unchanged | updated | new-variant | new-patch | no-change | missing
    diff: str = ""


@dataclass
class Writes:
    """Files to write once the whole fork is mapped (path -> bytes), folders to create, and
    diff files no variant names any more, to remove once everything else is in place."""

    files: dict[Path, bytes] = field(default_factory=dict)
    folders: list[Path] = field(default_factory=list)
    removals: list[Path] = field(default_factory=list)

    def commit(self, folder: Path) -> None:
        """All or nothing, even against SIGKILL (``series_journal``): staged beside the
        targets, journaled, then renamed, the ``series`` listing last."""
        series_journal.write(folder, self.files, self.folders, self.removals)


def _slug(subject: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")[:40] or "patch"


def _unchanged(
    cat: gitcmd.CatFile,
    patch: Patch,
    variant: Variant,
    c: ForkCommit,
    touched: dict[str, tuple[str, str]],
    scope: list[str],
) -> bool:
    """Does the stored diff, applied to the parent, give exactly this commit's files, modes
    included (a ``chmod`` amended into a patch's commit is a change)?

    On a partial tree (an sdist: ``scope`` set) files outside the scope are left out.
    """
    fds = [
        fd
        for fd in diffio.load(patch.diff_path(variant), patch.id)
        if fd.is_new
        or engine.in_scope(fd.path, scope)
        or cat.read(f"{c.parent}:{fd.path}") is not None
    ]
    by_path: dict[str, list[FileDiff]] = {}
    for fd in fds:  # a type change (file <-> symlink) is a deletion and a creation of one path
        by_path.setdefault(fd.path, []).append(fd)
    if sorted(by_path) != sorted(touched):
        return False
    for path, diffs in by_path.items():
        old_mode, new_mode = touched[path]
        data, mode = cat.read(f"{c.parent}:{path}"), old_mode
        for fd in diffs:  # in order, each on what the one before left, as apply does
            outcome = apply_file(None if data is None else split_lines(decode(data)), fd)
            if not all(accepts(r.label) for r in outcome.results):
                return False
            data = None if outcome.lines is None else encode("".join(outcome.lines))
            mode = (fd.new_mode or "100644") if fd.is_new else mode
        if data is not None and new_mode != mode:
            return False
        if data != cat.read(f"{c.commit}:{path}"):
            return False
    return True


def _variant_name(patch: Patch, version: Version) -> str:
    base = f"v{version.major}.{version.minor}"
    name, n = f"{base}.diff", 1
    while (patch.folder / name).exists() or any(v.diff == name for v in patch.variants):
        n += 1
        name = f"{base}-{n}.diff"
    return name


def _add_variant(patch: Patch, version: Version, split: bool) -> Variant:
    """A new variant starting at ``version``, ending where the next one starts."""
    since = release_of(version)
    later = [v.since for v in patch.variants if v.since > since]
    until = min(later) if later else None
    current = patch.variant_for(version)
    if current is not None and split:
        idx = patch.variants.index(current)
        if current.since == since:
            patch.variants.pop(idx)
            until = current.until
        else:
            patch.variants[idx] = Variant(current.diff, current.since, since, current.skip)
    new = Variant(_variant_name(patch, version), since, until)
    patch.variants.append(new)
    patch.variants.sort(key=lambda v: v.since)
    return new


def _touched(repo: Path, c: ForkCommit) -> dict[str, tuple[str, str]]:
    """The files ``c`` changes, each with its mode before and after (``000000``: absent)."""
    out = gitcmd.git(
        "diff",
        "--raw",
        "-z",
        "--no-renames",
        "--no-abbrev",
        "--end-of-options",
        c.parent,
        c.commit,
        cwd=repo,
    )
    fields = out.decode("utf-8", errors="surrogateescape").split("\0")
    touched: dict[str, tuple[str, str]] = {}
    for status, path in zip(fields[0::2], fields[1::2]):
        old_mode, new_mode = status.lstrip(":").split()[:2]
        touched[path] = (old_mode, new_mode)
    return touched


def export_fork(
    repo: Path, series: Series, version_override: str | None, new_variant: bool
) -> tuple[Version, list[ExportItem]]:
    refuse_busy_or_dirty(repo)
    base, commits = fork_commits(repo, series)
    scope = engine.present_scope(repo, base)
    items: list[ExportItem] = []
    writes = Writes()
    # the series as it is on disk: new variants below change the Patch objects in memory
    # before their diffs are written, and the base plan further down must not read those
    original = Series(series.folder, [copy.deepcopy(p) for p in series.patches])
    with gitcmd.CatFile(repo) as cat:
        version = Version(version_override) if version_override else engine.tree_version(cat, base)

        def upstream_file(path: str) -> bytes | None:  # what a variant's `when` probes read
            return cat.read(f"{base}:{path}")

        seen: set[str] = set()
        for c in commits:
            if c.patch_id in seen:
                raise UsageError(f"patch {c.patch_id} has more than one commit; squash them")
            text = gitcmd.diff(repo, c.parent, c.commit)
            _check_readable(c, text)
            if c.patch_id is None:
                items.append(_trailerless(series, c, version, text, writes))
                seen.add(items[-1].patch_id)
                continue
            seen.add(c.patch_id)
            patch = series.get(c.patch_id)
            variant = patch.variant_for(version, upstream_file)  # probed ones too (dev)
            if variant is not None and not variant.skip:
                if _unchanged(cat, patch, variant, c, _touched(repo, c), scope):
                    items.append(ExportItem(patch.id, "unchanged", variant.diff))
                    continue
            if scope:
                raise UsageError(
                    f"patch {patch.id} changed, but this fork holds only {', '.join(scope)} "
                    "(a PyPI sdist); export from a full clone so no file is dropped"
                )
            if variant is not None and not variant.skip and not new_variant:
                writes.files[patch.diff_path(variant)] = diffio.render(patch.id, patch.reason, text)
                items.append(ExportItem(patch.id, "updated", variant.diff))
                continue
            named = {v.diff for v in patch.variants if v.diff}
            variant = _add_variant(patch, version, split=True)
            writes.removals += [  # a variant the new one replaced whole: its diff is unused
                patch.folder / d for d in named - {v.diff for v in patch.variants if v.diff}
            ]
            writes.files[patch.diff_path(variant)] = diffio.render(patch.id, patch.reason, text)
            toml = patch.folder / "patch.toml"  # the developer's comments stay
            writes.files[toml] = update_patch_toml(toml.read_text("utf-8"), patch).encode()
            items.append(ExportItem(patch.id, "new-variant", variant.diff))
        unseen = [p for p in original.patches if p.id not in seen]
        if unseen:
            # A patch with no commit is fine when it changes nothing on this base (out of a
            # partial source's scope, or already upstream); otherwise the fork dropped it.
            base_plan = engine.plan(repo, cat, base, original, str(version))
            changes = {pp.patch.id: bool(pp.files) for pp in base_plan.patches}
            for patch in unseen:
                v = patch.variant_for(version, upstream_file)
                if v is not None and not v.skip:
                    action = "missing" if changes.get(patch.id) else "no-change"
                    items.append(ExportItem(patch.id, action, v.diff))
    _prove_round_trip(repo, series.folder, base, commits, items, writes, str(version))
    interrupts.step("export-mapped")  # everything read, nothing written yet
    with interrupts.Guard() as guard, guard.deferred():
        writes.commit(series.folder)
    return version, items


def _materialize(folder: Path, writes: Writes, into: Path) -> Path:
    """The series as this export would leave it, in a scratch copy (``into``)."""
    copy_ = into / folder.name
    shutil.copytree(folder, copy_, symlinks=True)
    for path in writes.removals:
        (copy_ / path.relative_to(folder)).unlink(missing_ok=True)
    for path, data in writes.files.items():
        target = copy_ / path.relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return copy_


def _prove_round_trip(
    repo: Path,
    folder: Path,
    base: str,
    commits: list[ForkCommit],
    items: list[ExportItem],
    writes: Writes,
    version: str,
) -> None:
    """Refuse (exit 1, nothing written) unless the series this export would write, applied
    to the fork's base as ``apply`` does, makes the fork's commits again: the same patch at
    each position and each commit's tree. A per-patch check alone misses a history whose
    commits were reordered (``rebase -i``): each diff may still apply to its own parent while
    the series, in its order, no longer gives the fork's tree."""
    missing = {i.patch_id for i in items if i.action == "missing"}  # warned about, kept
    ids = [i.patch_id for i in items[: len(commits)]]  # one item per commit, in fork order
    with tempfile.TemporaryDirectory(prefix="megatron-rocm-export-") as scratch:
        after = load_series(_materialize(folder, writes, Path(scratch)))
        after.patches = [p for p in after.patches if p.id not in missing]
        with gitcmd.CatFile(repo) as cat:
            plan = engine.plan(repo, cat, base, after, version)
    by_id = dict(zip(ids, commits, strict=True))
    for result in plan.report.patches:
        if not result.accepted(False):
            why = f"would not apply ({result.error})" if result.error else "would not apply"
            _diverges(by_id.get(result.patch_id), f"patch {result.patch_id} {why}")
    made = [(pp.patch.id, sha) for pp, sha in engine.write_commits(plan)]  # unreachable
    trees = gitcmd.git_text(
        "rev-parse", *[f"{x}^{{tree}}" for x in [c.commit for c in commits] + [m for _, m in made]],
        cwd=repo,
    ).split() if commits or made else []  # fmt: skip
    fork_trees, made_trees = trees[: len(commits)], trees[len(commits) :]
    for n, (c, pid) in enumerate(zip(commits, ids, strict=True)):
        if n >= len(made):
            _diverges(c, f"the series makes no commit for patch {pid}")
        if made[n][0] != pid:
            _diverges(
                c,
                f"the series applies {made[n][0]} where the fork has {pid} (the commits are in "
                "another order than the series file: reorder one to match the other)",
            )
        if made_trees[n] != fork_trees[n]:
            _diverges(c, f"the series' {pid} does not give this commit's tree")
    if len(made) > len(commits):
        _diverges(
            None, f"the series' {made[len(commits)][0]} changes the tree after the last commit"
        )


def _diverges(c: ForkCommit | None, why: str) -> NoReturn:
    where = f"at commit {c.commit[:12]} ({c.subject!r})" if c is not None else "(no commit)"
    raise PatchFailed(
        f"the series export would write does not rebuild this fork {where}: {why}; nothing "
        "was written"
    )


def _check_readable(c: ForkCommit, text: bytes) -> None:
    """Export writes only what apply can read back: a commit whose diff the series' reader
    refuses (binary, a mode change, an odd path) or that changes nothing is refused here, so
    its edit is not written half or the series broken for every later apply."""
    what = f"commit {c.commit[:12]} ({c.subject!r})"
    if not text.strip():
        raise UsageError(f"{what} changes nothing; drop it (git rebase -i), then export")
    try:
        diffio.parse_text(decode(text), origin=what)
    except UsageError as e:
        hint = (
            "; a text file shows as binary when an attribute says so (.gitattributes, "
            ".git/info/attributes)"
            if "binary" in str(e)
            else ""
        )
        raise UsageError(f"{e}{hint}; the series holds text diffs only") from None


def _trailerless(
    series: Series, c: ForkCommit, version: Version, text: bytes, writes: Writes
) -> ExportItem:
    """A commit without a trailer on top of the fork. Whose subject is a patch's reason, it
    is that patch exported before (its stored diff is this commit's: nothing to do) or that
    patch's commit which lost its trailer in an amend (refused: written as a new patch it
    would be a second copy, and the patch left behind); otherwise a new patch."""
    named = patch_with_reason(series, c.subject)
    if named is None:
        return _new_patch(series, c, version, text, writes)
    if _exported_before(named, version, diffio.render(named.id, named.reason, text)):
        return ExportItem(named.id, "unchanged", named.variant_for(version).diff)
    raise UsageError(
        f"commit {c.commit[:12]} ({c.subject!r}) has no '{engine.TRAILER}:' trailer, but its "
        f"subject is patch {named.id}'s reason; put the trailer '{engine.TRAILER}: {named.id}' "
        "back (git commit --amend) to update that patch, or give the commit another subject "
        "to make it a new patch"
    )


def _new_patch(
    series: Series, c: ForkCommit, version: Version, text: bytes, writes: Writes
) -> ExportItem:
    _check_reason(c)
    pid = _slug(c.subject)
    rendered = diffio.render(pid, c.subject, text)
    if any(p.id == pid for p in series.patches) or (series.folder / pid).exists():
        raise UsageError(
            f"new commit {c.commit[:12]} would become patch {pid!r}, which exists; to update "
            f"that patch, add the trailer '{engine.TRAILER}: {pid}' to the commit (git commit "
            "--amend), or give the commit another subject"
        )
    folder = series.folder / pid
    patch = Patch(pid, c.subject, "not-submitted", folder)
    variant = _add_variant(patch, version, split=False)
    writes.folders.append(folder)
    writes.files[patch.diff_path(variant)] = rendered
    writes.files[folder / "patch.toml"] = format_patch_toml(patch).encode()
    listing = series.folder / "series"
    content = writes.files.get(listing, listing.read_bytes()).decode("utf-8")
    writes.files[listing] = (
        content + ("" if content.endswith("\n") else "\n") + pid + "\n"
    ).encode("utf-8")
    series.patches.append(patch)
    return ExportItem(pid, "new-patch", variant.diff)


def _check_reason(c: ForkCommit) -> None:
    """A new patch's reason is its commit's subject: it is written into patch.toml and, as the
    diff's mail header, into every commit apply makes. One that is empty, holds a control
    character or is not UTF-8 text (git stores a message's bytes as given) is refused."""
    what = f"new commit {c.commit[:12]}"
    if not c.subject.strip():
        problem = "has no subject"
    elif any(0xD800 <= ord(ch) <= 0xDFFF for ch in c.subject):
        problem = "has a subject that is not UTF-8 text"
    elif any(is_control(ch) for ch in c.subject):
        problem = f"has a control character in its subject ({c.subject!r})"
    else:
        return
    raise UsageError(
        f"{what} {problem}; its subject becomes the new patch's reason: reword it (git commit "
        "--amend), then export"
    )


def _exported_before(patch: Patch, version: Version, rendered: bytes) -> bool:
    """Whether an earlier export already made ``patch`` from this very commit (its diff for
    ``version`` is what this export would write): a second export then changes nothing."""
    variant = patch.variant_for(version)
    if variant is None or variant.skip:
        return False
    try:
        return patch.diff_path(variant).read_bytes() == rendered
    except OSError:
        return False
