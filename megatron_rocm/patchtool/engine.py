"""Check and apply the series against an upstream commit, entirely from git objects.

``plan`` applies every patch in memory (no checkout) and labels each hunk; ``write_commits``
turns a successful plan into one commit per patch using a temporary index. Nothing a user can
see (refs, HEAD, index, working tree) changes here: ``transaction`` owns the order of effects
and moves refs last, so a failure or a kill here leaves only unreachable objects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import Version

from megatron_rocm.errors import SourceError, UsageError
from megatron_rocm.patchtool import diffio, gitcmd
from megatron_rocm.patchtool.hunks import FileDiff, apply_file, decode, encode, split_lines
from megatron_rocm.patchtool.results import (
    HunkLabel,
    HunkResult,
    PatchResult,
    RefReport,
    accepts,
)
from megatron_rocm.patchtool.series import Patch, Series, Variant, parse_version, release_of

PACKAGE_INFO = "megatron/core/package_info.py"
TRAILER = diffio.TRAILER
BASE_TRAILER = "Megatron-ROCm-Base"  # the upstream commit the fork was built on
SCOPE_CONFIG = "megatron-rocm.scope"  # set on repos built from sdists: the paths they hold
_FIELD_RE = {
    k: re.compile(rf"^{k}\s*=\s*['\"]?([0-9A-Za-z]*)['\"]?", re.M)
    for k in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE")
}


@dataclass
class PatchPlan:
    patch: Patch
    variant: Variant | None
    result: PatchResult
    files: dict[str, bytes | None] = field(default_factory=dict)  # path -> content (None: delete)
    modes: dict[str, str] = field(default_factory=dict)


@dataclass
class Plan:
    repo: Path
    commit: str
    report: RefReport
    patches: list[PatchPlan]


def tree_version(cat: gitcmd.CatFile, commit: str) -> Version:
    """The tree's Megatron version from package_info.py (tags may name the next release)."""
    data = cat.read(f"{commit}:{PACKAGE_INFO}")
    if data is None:
        raise SourceError(f"not a Megatron-LM tree: {PACKAGE_INFO} is missing at {commit[:12]}")
    text = decode(data)
    fields = {k: (m.group(1) if (m := rx.search(text)) else "") for k, rx in _FIELD_RE.items()}
    if not (fields["MAJOR"] and fields["MINOR"]):
        raise SourceError(f"cannot read MAJOR/MINOR from {PACKAGE_INFO} at {commit[:12]}")
    core = f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH'] or 0}"
    try:
        return Version(core + fields["PRE_RELEASE"])
    except ValueError:
        return Version(core)


QUALIFIED = ("refs/", "tags/", "heads/", "remotes/")


def find_commit(repo: Path, ref: str, option: str = "--ref") -> str | None:
    """The commit ``ref`` names in ``repo`` (tag, branch, origin's branch or commit id).

    A short name that is both a tag and a branch (upstream has ``core_r0.11.0`` as both, on
    different commits) is refused naming the two: git would silently take the tag. The
    qualified forms ``tags/<name>`` and ``heads/<name>`` (or ``refs/...``) pick one."""
    if not ref.startswith(QUALIFIED):
        refuse_ambiguous(repo, ref, option)
    candidates = [ref, f"refs/tags/{ref}", f"origin/{ref}", f"refs/remotes/origin/{ref}"]
    if ref.startswith("heads/"):  # a clone keeps the source's branches as origin's
        candidates.append(f"refs/remotes/origin/{ref.removeprefix('heads/')}")
    for candidate in candidates:
        commit = gitcmd.rev_parse(repo, candidate)
        if commit:
            return commit
    return None


def refuse_ambiguous(repo: Path, ref: str, option: str = "--ref") -> None:
    """A usage error when ``ref`` is a tag and a branch (local or origin's) on two commits."""
    rows = gitcmd.git_text(
        "for-each-ref",
        "--format=%(refname)%09%(objectname)%09%(*objectname)",
        "--end-of-options",
        f"refs/tags/{ref}",
        f"refs/heads/{ref}",
        f"refs/remotes/origin/{ref}",
        cwd=repo,
    )
    found: dict[str, str] = {}
    for row in rows.splitlines():
        name, obj, peeled = (row.split("\t") + ["", ""])[:3]
        found[name] = peeled or obj
    tag = found.get(f"refs/tags/{ref}")
    branch = next(
        (n for n in (f"refs/heads/{ref}", f"refs/remotes/origin/{ref}") if n in found), None
    )
    if tag and branch and found[branch] != tag:
        raise UsageError(
            f"{option} {ref!r} is ambiguous: both refs/tags/{ref} ({tag[:12]}) and {branch} "
            f"({found[branch][:12]}); pick one with {option} tags/{ref} or {option} heads/{ref}"
        )


def resolve_commit(repo: Path, ref: str, where: str | None = None) -> str:
    """``find_commit`` or a usage error naming ``where`` (the source as the user gave it:
    never a temporary clone the user cannot see)."""
    commit = find_commit(repo, ref)
    if commit is None:
        raise unknown_ref(ref, where or str(repo))
    return commit


def unknown_ref(ref: str, where: str) -> UsageError:
    return UsageError(f"unknown ref {ref!r} in {where} (a tag, branch or commit of the source)")


def patched_below(repo: Path, commit: str) -> str | None:
    """The newest commit at or below ``commit`` that the series made (its message carries the
    ``Megatron-ROCm-Patch`` trailer), or None for an upstream commit. Applying on top of such
    a commit would patch the tree a second time (``--ref HEAD`` in a fork)."""
    found = gitcmd.git_text(
        "rev-list", "-n1", f"--grep=^{TRAILER}:", "--end-of-options", commit, cwd=repo
    )
    return found or None


def refuse_patched(repo: Path, commit: str, ref: str) -> None:
    """A usage error when ``ref`` names a patched fork's commit rather than upstream's."""
    made = patched_below(repo, commit)
    if made:
        raise UsageError(
            f"--ref {ref!r} is a patched fork's commit (its history has {made[:12]}, a commit of "
            "the series); give the upstream tag, branch or commit it was built on"
        )


def repo_scope(repo: Path) -> list[str]:
    out = gitcmd.git("config", "--get-all", SCOPE_CONFIG, cwd=repo, check=False).decode().split()
    return out


def present_scope(repo: Path, commit: str) -> list[str]:
    """The scope folders that exist at ``commit`` (which ones depends on the release)."""
    return [
        s
        for s in repo_scope(repo)
        if gitcmd.git_ok("cat-file", "-e", "--end-of-options", f"{commit}:{s}", cwd=repo)
    ]


def in_scope(path: str, scope: list[str]) -> bool:
    return not scope or any(path == s or path.startswith(s.rstrip("/") + "/") for s in scope)


def _try_three_way(
    repo: Path, cat: gitcmd.CatFile, fd: FileDiff, current: bytes | None, outcome_results: list
) -> bytes | None:
    """Relabel conflicting hunks needs-3-way when the recorded base merges cleanly."""
    if current is None or not fd.old_blob:
        return None
    base = cat.read(fd.old_blob)
    if base is None:
        return None
    on_base = apply_file(split_lines(decode(base)), fd)
    if on_base.lines is None or not all(r.label is HunkLabel.CLEAN for r in on_base.results):
        return None
    merged = gitcmd.merge_file(repo, current, base, encode("".join(on_base.lines)))
    if merged is None:
        return None
    for r in outcome_results:
        if r.label is HunkLabel.CONFLICT:
            r.label = HunkLabel.NEEDS_3WAY
    return merged


def plan(
    repo: Path,
    cat: gitcmd.CatFile,
    ref: str,
    series: Series,
    version_override: str | None = None,
    three_way: bool = False,
) -> Plan:
    """Apply the whole series to ``ref`` in memory; never raises for hunks that fail."""
    commit = resolve_commit(repo, ref)
    version = parse_version(version_override) if version_override else tree_version(cat, commit)
    # A partial source (sdist) holds only some folders, and which ones depends on the release.
    scope = present_scope(repo, commit)
    report = RefReport(ref=ref, commit=commit, version=str(version))
    overlay: dict[str, bytes | None] = {}
    modes: dict[str, str] = {}
    plans: list[PatchPlan] = []

    def current(path: str) -> bytes | None:
        return overlay[path] if path in overlay else cat.read(f"{commit}:{path}")

    def upstream_file(path: str) -> bytes | None:  # what a variant's `when` probes read
        return cat.read(f"{commit}:{path}")

    for patch in series.patches:
        variant = patch.variant_for(version, upstream_file)
        result = PatchResult(patch.id, variant.diff if variant else None)
        pp = PatchPlan(patch, variant, result)
        plans.append(pp)
        report.patches.append(result)
        if variant is None:
            result.error = f"no variant of {patch.id} covers version {release_of(version)}"
            continue
        if variant.skip:
            result.variant = "skip"
            result.merged = merged_at(patch, variant)
            continue
        for fd in diffio.load(patch.diff_path(variant), patch.id):
            data = current(fd.path)
            if data is None and not fd.is_new and not in_scope(fd.path, scope):
                gone = f"{fd.path} is not part of this source"
                result.hunks += [
                    HunkResult(fd.path, i, HunkLabel.OUT_OF_SCOPE, h.old_start, None, gone, h.text)
                    for i, h in enumerate(fd.hunks, 1)
                ]
                continue
            outcome = apply_file(None if data is None else split_lines(decode(data)), fd)
            new: bytes | None = None if outcome.lines is None else encode("".join(outcome.lines))
            if any(r.label is HunkLabel.CONFLICT for r in outcome.results):
                merged = _try_three_way(repo, cat, fd, data, outcome.results)
                if merged is not None and three_way:
                    new = merged
            result.hunks += outcome.results
            if all(accepts(r.label, three_way) for r in outcome.results) and new != data:
                pp.files[fd.path] = new
                overlay[fd.path] = new
                if fd.is_new:
                    modes[fd.path] = fd.new_mode or "100644"
        pp.modes = {p: modes[p] for p in pp.files if p in modes}
    return Plan(repo, commit, report, plans)


def merged_at(patch: Patch, variant: Variant) -> bool:
    """Whether ``variant`` is the skip that follows upstream's merge of ``patch``: the patch
    says ``merged`` and no diff variant starts after this range does."""
    return (
        variant.skip
        and patch.upstream.split()[0] == "merged"
        and all(v.skip or v.since < variant.since for v in patch.variants)
    )


def _commit_env(repo: Path, base: str) -> dict[str, str]:
    """Fixed identity and dates (the base commit's): the same plan gives the same commit ids."""
    stamp = gitcmd.git_text("show", "-s", "--format=%ct", "--end-of-options", base, cwd=repo)
    date = f"@{stamp} +0000"
    return {**gitcmd.IDENTITY, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}


def commit_message(patch: Patch, base: str) -> str:
    """The reason as subject (one line, as ``git am`` of the diff file makes it), then the
    trailers: which patch, and on which upstream commit the fork was built (export's anchor)."""
    subject = " ".join(patch.reason.split())
    return f"{subject}\n\n{TRAILER}: {patch.id}\n{BASE_TRAILER}: {base}\n"


def write_commits(p: Plan) -> list[tuple[PatchPlan, str]]:
    """Create one commit per changed patch on top of the plan's base; return (patch, commit)."""
    repo, parent = p.repo, p.commit
    env = _commit_env(repo, p.commit)
    made: list[tuple[PatchPlan, str]] = []
    for pp in p.patches:
        if not pp.files:
            continue
        changes = {
            path: None if data is None else (pp.modes.get(path) or _mode(repo, parent, path), data)
            for path, data in pp.files.items()
        }
        tree = gitcmd.write_tree(repo, changes, base=parent)
        parent = gitcmd.git_text(
            "commit-tree",  # ids we computed: nothing here comes from the user
            tree,
            "-p",
            parent,
            cwd=repo,
            env=env,
            input=encode(commit_message(pp.patch, p.commit)),
        )
        made.append((pp, parent))
    return made


def _mode(repo: Path, commit: str, path: str) -> str:
    out = gitcmd.git_text("ls-tree", "--end-of-options", commit, "--", path, cwd=repo)
    return out.split()[0] if out else "100644"
