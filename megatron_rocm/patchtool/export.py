"""Fork-branch commits -> the series' diff files, normalized so an unchanged fork is zero diff.

A patch's stored diff is kept byte for byte when applying it to the commit's parent gives the
commit's tree (it may have landed at an offset on this tag: rewriting it then would only churn
line numbers). Otherwise the commit's normalized diff replaces it. A commit without a trailer
on top of the fork becomes a new patch appended to the series.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from megatron_rocm.errors import UsageError
from megatron_rocm.patchtool import engine, gitcmd
from megatron_rocm.patchtool.hunks import apply_file, decode, encode, parse_diff, split_lines
from megatron_rocm.patchtool.series import Patch, Series, Variant, format_patch_toml, release_of

_TRAILER_RE = re.compile(rf"^{engine.TRAILER}:\s*(\S+)\s*$", re.M)


@dataclass
class ForkCommit:
    commit: str
    parent: str
    patch_id: str | None  # None: a user commit without trailer (a new patch)
    subject: str


@dataclass
class ExportItem:
    patch_id: str
    action: str  # unchanged | updated | new-variant | new-patch | no-change | missing
    diff: str = ""


def fork_commits(repo: Path) -> tuple[str, list[ForkCommit]]:
    """Walk HEAD's first parents: user commits on top, then trailer commits, then the base."""
    out = gitcmd.git("log", "--first-parent", "-z", "--format=%H %P%n%B", "HEAD", cwd=repo)
    commits: list[ForkCommit] = []
    seen_trailer = False
    for record in decode(out).split("\0"):
        if not record.strip():
            continue
        head, _, body = record.partition("\n")
        ids = head.split()
        m = _TRAILER_RE.search(body)
        if m is None and seen_trailer:
            return ids[0], list(reversed(commits))
        if len(ids) < 2:
            break
        if len(ids) > 2:
            raise UsageError(
                f"merge commit {ids[0][:12]} in the fork; export needs a linear branch"
            )
        seen_trailer = seen_trailer or m is not None
        commits.append(
            ForkCommit(
                ids[0],
                ids[1],
                m.group(1) if m else None,
                body.strip().splitlines()[0] if body.strip() else "",
            )
        )
    raise UsageError(
        f"{repo} is not a megatron-rocm fork: no commit on HEAD carries a "
        f"'{engine.TRAILER}:' trailer (run `megatron-rocm apply` first)"
    )


def _slug(subject: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")[:40] or "patch"


def _unchanged(
    cat: gitcmd.CatFile,
    patch: Patch,
    variant: Variant,
    c: ForkCommit,
    touched: list[str],
    scope: list[str],
) -> bool:
    """Does the stored diff, applied to the parent, give exactly this commit's files?

    On a partial tree (an sdist: ``scope`` set) files outside the scope are left out.
    """
    fds = parse_diff(patch.diff_path(variant).read_text(encoding="utf-8", errors="surrogateescape"))
    fds = [
        fd
        for fd in fds
        if fd.is_new
        or engine.in_scope(fd.path, scope)
        or cat.read(f"{c.parent}:{fd.path}") is not None
    ]
    if sorted(fd.path for fd in fds) != sorted(touched):
        return False
    for fd in fds:
        before = cat.read(f"{c.parent}:{fd.path}")
        outcome = apply_file(None if before is None else split_lines(decode(before)), fd)
        if not all(r.label.applies for r in outcome.results):
            return False
        after = None if outcome.lines is None else encode("".join(outcome.lines))
        if after != cat.read(f"{c.commit}:{fd.path}"):
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


def export_fork(
    repo: Path, series: Series, version_override: str | None, new_variant: bool
) -> tuple[Version, list[ExportItem]]:
    base, commits = fork_commits(repo)
    scope = [
        s
        for s in engine.repo_scope(repo)
        if gitcmd.git_ok("cat-file", "-e", f"{base}:{s}", cwd=repo)
    ]
    items: list[ExportItem] = []
    with gitcmd.CatFile(repo) as cat:
        version = Version(version_override) if version_override else engine.tree_version(cat, base)
        seen: set[str] = set()
        for c in commits:
            if c.patch_id in seen:
                raise UsageError(f"patch {c.patch_id} has more than one commit; squash them")
            touched = gitcmd.git_text(
                "diff", "--name-only", "--no-renames", c.parent, c.commit, cwd=repo
            ).splitlines()
            text = gitcmd.diff(repo, c.parent, c.commit)
            if c.patch_id is None:
                items.append(_new_patch(series, c, version, text))
                continue
            seen.add(c.patch_id)
            patch = series.get(c.patch_id)
            variant = patch.variant_for(version)
            if variant is not None and not variant.skip and not new_variant:
                if _unchanged(cat, patch, variant, c, touched, scope):
                    items.append(ExportItem(patch.id, "unchanged", variant.diff))
                    continue
                if scope:
                    raise UsageError(
                        f"patch {patch.id} changed, but this fork holds only {', '.join(scope)} "
                        "(a PyPI sdist); export from a full clone so no file is dropped"
                    )
                patch.diff_path(variant).write_bytes(text)
                items.append(ExportItem(patch.id, "updated", variant.diff))
                continue
            variant = _add_variant(patch, version, split=True)
            patch.diff_path(variant).write_bytes(text)
            (patch.folder / "patch.toml").write_text(format_patch_toml(patch), encoding="utf-8")
            items.append(ExportItem(patch.id, "new-variant", variant.diff))
        unseen = [p for p in series.patches if p.id not in seen]
        if unseen:
            # A patch with no commit is fine when it changes nothing on this base (out of a
            # partial source's scope, or already upstream); otherwise the fork dropped it.
            base_plan = engine.plan(repo, cat, base, series, str(version))
            changes = {pp.patch.id: bool(pp.files) for pp in base_plan.patches}
            for patch in unseen:
                v = patch.variant_for(version)
                if v is not None and not v.skip:
                    action = "missing" if changes.get(patch.id) else "no-change"
                    items.append(ExportItem(patch.id, action, v.diff))
    return version, items


def _new_patch(series: Series, c: ForkCommit, version: Version, text: bytes) -> ExportItem:
    pid = _slug(c.subject)
    if any(p.id == pid for p in series.patches) or (series.folder / pid).exists():
        raise UsageError(f"new commit {c.commit[:12]} would become patch {pid!r}, which exists")
    folder = series.folder / pid
    folder.mkdir(parents=True)
    patch = Patch(pid, c.subject, "not-submitted", folder)
    variant = _add_variant(patch, version, split=False)
    patch.diff_path(variant).write_bytes(text)
    (folder / "patch.toml").write_text(format_patch_toml(patch), encoding="utf-8")
    listing = series.folder / "series"
    content = listing.read_text(encoding="utf-8")
    listing.write_text(
        content + ("" if content.endswith("\n") else "\n") + pid + "\n", encoding="utf-8"
    )
    series.patches.append(patch)
    return ExportItem(pid, "new-patch", variant.diff)
