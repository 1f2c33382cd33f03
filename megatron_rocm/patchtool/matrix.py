"""The compatibility matrix: the series checked against every selected upstream ref.

Why a matrix and not a loop over ``check``: maintainers need the *shape* of drift — which
patch first breaks at which tag (in version order), which patches upstream has absorbed
(every hunk already applied: the patch can be dropped), and what CUDA-only code appeared.
The data here is pure values; ``report/`` renders it, ``commands/matrix.py`` wires the CLI.
"""

from __future__ import annotations

import datetime as _dt
import fnmatch
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from megatron_rocm import __version__
from megatron_rocm.errors import SourceError, UsageError
from megatron_rocm.patchtool import diffio, engine, gitcmd, refnames, results, surface
from megatron_rocm.patchtool.hunks import FileDiff
from megatron_rocm.patchtool.results import HunkLabel, PatchResult, RefReport
from megatron_rocm.patchtool.series import Series
from megatron_rocm.patchtool.upstream import RELEASE_TAG

MIN_RELEASE = (0, 12, 0)
# Upstream's branches the default run always watches: main, and dev, where the next release
# is built (its package_info.py may name an older one; the series picks dev's variants by
# content, see series.py).
DEFAULT_BRANCHES = ("main", "dev")
# Branch patterns watched by default besides them: upstream's copies of open pull requests'
# heads (``pull-request/<n>``, made by its CI bot and deleted when the PR closes). A missing
# match is no error here; ``--refs`` replaces this list.
DEFAULT_WATCH = ("pull-request/*",)
SCHEMA = 1
_KIND_RANK = {"release": 0, "tag": 1, "commit": 2, "branch": 3}
SKIP, MERGED, NO_VARIANT, ERROR = results.SKIP, results.MERGED, results.NO_VARIANT, "error"
_QUIET_LABELS = ("clean", "offset", "already-applied", "out-of-scope")


@dataclass(frozen=True)
class RefSpec:
    name: str
    commit: str
    kind: str  # release | tag | branch | commit
    watched: bool = False  # selected by a watch pattern (a PR head): reported, never gating


def list_refs(repo: Path) -> dict[str, RefSpec]:
    """Tags, local branches and remote-tracking branches by short name. A name that is a tag
    and a branch on different commits (upstream's ``core_r0.11.0``) is listed twice under its
    qualified names (``tags/core_r0.11.0``, ``heads/core_r0.11.0``), never as the bare name:
    which one it meant is the user's call (``select_refs`` refuses it by its bare name)."""
    out = gitcmd.git_text(
        "for-each-ref",
        "--format=%(refname)%09%(objectname)%09%(*objectname)",
        "refs/tags",
        "refs/heads",
        "refs/remotes",
        cwd=repo,
    )
    by_name: dict[str, list[tuple[str, RefSpec]]] = {}
    for row in out.splitlines():
        refname, obj, peeled = (row.split("\t") + ["", ""])[:3]
        if refname.startswith("refs/tags/"):
            name = refname.removeprefix("refs/tags/")
            kind = "release" if RELEASE_TAG.match(name) else "tag"
        elif refname.startswith("refs/heads/"):
            name, kind = refname.removeprefix("refs/heads/"), "branch"
        else:
            name, kind = refname.split("/", 3)[-1], "branch"  # refs/remotes/<remote>/<name>
            if name == "HEAD":
                continue
        by_name.setdefault(name, []).append((refname, RefSpec(name, peeled or obj, kind)))
    refs: dict[str, RefSpec] = {}
    for name, found in by_name.items():
        tags = [s for r, s in found if r.startswith("refs/tags/")]
        branches = [(r, s) for r, s in found if not r.startswith("refs/tags/")]
        if tags and branches and any(s.commit != tags[0].commit for _, s in branches):
            qualified = [("refs/tags/" + name, tags[0]), branches[0]]
            for refname, spec in qualified:
                short = refname.removeprefix("refs/")
                refs[short] = RefSpec(short, spec.commit, spec.kind)
            continue
        refs[name] = (tags or [s for _, s in branches])[0]
    return refs


_QUALIFIERS = ("tags/", "heads/", "remotes/")


def _bare(qualified: str) -> str:
    """``tags/X``, ``heads/X``, ``remotes/<remote>/X`` -> ``X`` (the name ``list_refs``
    qualified because it is a tag and a branch)."""
    return qualified.split("/", 2 if qualified.startswith("remotes/") else 1)[-1]


def _ambiguous(refs: dict[str, RefSpec], name: str) -> list[str]:
    """The qualified names ``list_refs`` split ``name`` into, when it is a tag and a branch."""
    return [q for q in refs if q.startswith(_QUALIFIERS) and _bare(q) == name]


def _release_key(name: str) -> tuple[int, ...]:
    m = RELEASE_TAG.match(name)
    return tuple(int(x) for x in m.groups()) if m else ()


_VERSIONED_NAME = re.compile(r"^(?:core_v|core_r|v)(\d+\.\d+(?:\.\d+)?\S*)$")


def name_version(name: str) -> Version | None:
    """The version a tag or branch name carries (``core_v0.14.0rc0`` -> 0.14.0rc0), if any."""
    m = _VERSIONED_NAME.match(name)
    if not m:
        return None
    try:
        return Version(m.group(1))
    except InvalidVersion:
        return None


def select_refs(
    repo: Path, patterns: list[str] | None, watch: Sequence[str] | None = None
) -> list[RefSpec]:
    """Default: release tags >= core_v0.12.0, ``main`` and ``dev``, plus the refs matching
    ``watch`` (``DEFAULT_WATCH`` when None). ``patterns`` (``--tags``) replace all of that."""
    refs = list_refs(repo)
    if not patterns:
        chosen = [
            r for r in refs.values() if r.kind == "release" and _release_key(r.name) >= MIN_RELEASE
        ]
        chosen += [refs[b] for b in DEFAULT_BRANCHES if b in refs]
        if not chosen:
            raise UsageError(
                f"{repo} has no core_vX.Y.Z tags >= core_v0.12.0 and none of the branches "
                f"{', '.join(DEFAULT_BRANCHES)}; pass --tags"
            )
        names = {r.name for r in chosen}
        for r in _matching(repo, refs, list(DEFAULT_WATCH if watch is None else watch), False):
            if r.name not in names:
                names.add(r.name)
                chosen.append(RefSpec(r.name, r.commit, r.kind, watched=True))
        return chosen
    return _matching(repo, refs, patterns, True, option="--tags")


def _matching(
    repo: Path,
    refs: dict[str, RefSpec],
    patterns: list[str],
    strict: bool,
    option: str = "--refs",
) -> list[RefSpec]:
    """Refs whose names match the glob ``patterns``; an exact name that is no listed ref may
    be any commit git resolves. An exact name that names nothing is an error; so is a glob
    that matches nothing with ``strict`` (a watched glob, say ``pull-request/*`` while no
    pull request is open, may match nothing)."""
    chosen_by_name: dict[str, RefSpec] = {}
    for pat in patterns:
        both = [] if any(c in pat for c in "*?[") else _ambiguous(refs, pat)
        if both:
            raise UsageError(
                f"{option} {pat!r} is ambiguous: both refs/{both[0]} and refs/{both[1]}; "
                f"pick one with {option} {both[0]} or {option} {both[1]}"
            )
        hits = [
            r
            for n, r in refs.items()
            if fnmatch.fnmatchcase(n, pat)
            or (n.startswith(_QUALIFIERS) and fnmatch.fnmatchcase(_bare(n), pat))
        ]
        if not hits and not any(c in pat for c in "*?["):
            commit = gitcmd.rev_parse(repo, pat)
            hits = [RefSpec(pat, commit, "commit")] if commit else []
        if not hits and (strict or not refnames.is_glob(pat)):
            raise UsageError(f"{option} {pat!r} matches no tag or branch in {repo}")
        for r in hits:
            chosen_by_name.setdefault(r.name, r)
    return list(chosen_by_name.values())


def status_of(p: PatchResult) -> str:
    """The cell text: ``check``'s word for the patch at that ref (``PatchResult.status``)."""
    return p.status


@dataclass
class Row:
    spec: RefSpec
    report: RefReport
    tree_version: str = ""  # from package_info.py, even when --megatron-version overrides
    # Why the ref was not checked at all (not a Megatron-LM tree, a patched fork's commit);
    # such a row has no patch results and is neither an "apply" nor a "break".
    error: str = ""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def breaks(self) -> bool:
        """Checked, and at least one patch does not apply."""
        return not self.error and not self.report.ok

    def cell(self, patch_id: str) -> PatchResult | None:
        return next((p for p in self.report.patches if p.patch_id == patch_id), None)

    @property
    def sort_key(self) -> tuple:
        """Version order, pre-releases before their release (``core_v0.14.0rc7`` <
        ``core_v0.14.0``): the version in the name, else the tree's own (``main``). Refs that
        were not checked come last: they have no version and no place in the drift order."""
        ver = name_version(self.spec.name)
        if ver is None:
            try:
                ver = Version(self.tree_version or self.report.version)
            except InvalidVersion:
                ver = Version("0")
        return (bool(self.error), ver, _KIND_RANK[self.spec.kind], self.spec.name)


@dataclass
class Matrix:
    source: str
    series: Series
    rows: list[Row]  # in version order
    surface: surface.SurfaceReport | None = None
    timings: dict[str, float] = field(default_factory=dict)
    generated_at: str = ""

    @property
    def patch_ids(self) -> list[str]:
        return [p.id for p in self.series.patches]

    @property
    def ok(self) -> bool:
        """Every selected ref was checked and applies."""
        return not self.broken_rows and not self.error_rows

    @property
    def broken_rows(self) -> list[Row]:
        """Refs the series must apply to (not watched ones) where it does not."""
        return [r for r in self.rows if r.breaks and not r.spec.watched]

    @property
    def error_rows(self) -> list[Row]:
        """Refs that could not be checked: shown with their reason, never counted as breaks
        (a non-Megatron branch is the source's business, not the series')."""
        return [r for r in self.rows if r.error and not r.spec.watched]

    @property
    def watched_trouble(self) -> list[Row]:
        """Watched refs (open pull requests' heads) that break or could not be checked: what
        upstream is about to merge, reported so a variant is ready; no failure of the run."""
        return [r for r in self.rows if r.spec.watched and (r.breaks or r.error)]

    def first_break(self, patch_id: str) -> str | None:
        """The first ref in version order where the patch does not apply (watched refs
        aside: a pull request is not yet upstream)."""
        for r in self.rows:
            if r.spec.watched:
                continue
            c = r.cell(patch_id)
            if c is not None and not c.ok:
                return r.name
        return None

    def droppable(self, patch_id: str) -> list[str]:
        """Refs where upstream has the patch's change: every hunk of its variant is already
        there (``already-applied``: its post-image is in the tree), or the patch says upstream
        merged it and the ref is past the merge (``merged``)."""
        return [
            r.name
            for r in self.rows
            if (c := r.cell(patch_id))
            and (c.status == MERGED or (not c.error and c.label is HunkLabel.ALREADY_APPLIED))
        ]

    def label_counts(self) -> Counter[str]:
        return Counter(status_of(p) for r in self.rows for p in r.report.patches)

    def summary(self) -> str:
        """One line for terminals, CI logs and report headers."""
        n, bad, errors = len(self.rows), self.broken_rows, self.error_rows
        n_ok = n - len(bad) - len(errors) - len(self.watched_trouble)
        parts = [f"{n} refs x {len(self.patch_ids)} patches: {n_ok} apply"]
        if bad:
            parts[0] += f", {len(bad)} break ({_some_names(bad)})"
        if errors:
            parts[0] += f", {len(errors)} {ERROR} ({_some_names(errors)})"
        watched = self.watched_trouble
        if watched:
            parts[0] += f", {len(watched)} watched fail ({_some_names(watched)})"
        if bad:
            firsts = [f"{p}@{fb}" for p in self.patch_ids if (fb := self.first_break(p))]
            parts.append("first breaks: " + ", ".join(firsts))
        counts = self.label_counts()
        drift = [f"{counts[k]} {k}" for k in ("offset", "fuzz", "needs-3-way") if counts.get(k)]
        if drift:
            parts.append("drift: " + ", ".join(drift))
        drop = [f"{p} (from {d[0]})" for p in self.patch_ids if (d := self.droppable(p))]
        if drop:
            parts.append("droppable: " + ", ".join(drop))
        if self.surface and self.surface.refs:
            last = self.surface.refs[-1]
            new = sum(len(r.new) for r in self.surface.refs)
            parts.append(
                f"CUDA surface: {len(last.uncovered)} uncovered at {last.ref}, "
                f"{new} new across tags"
            )
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "tool": f"megatron-rocm {__version__}",
            "generated_at": self.generated_at,
            "source": self.source,
            "series": str(self.series.folder),
            "ok": self.ok,
            "summary": self.summary(),
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "patches": [
                {
                    "id": p.id,
                    "reason": p.reason,
                    "upstream": p.upstream,
                    "first_break": self.first_break(p.id),
                    "droppable_at": self.droppable(p.id),
                }
                for p in self.series.patches
            ],
            "refs": [_row_dict(r) for r in self.rows],
            "surface": _surface_dict(self.surface) if self.surface else None,
        }


def _some_names(rows: list[Row], limit: int = 4) -> str:
    """``a, b, c, d +2``: the summary must stay one readable line for thousands of refs."""
    names = [r.name for r in rows]
    return ", ".join(names[:limit]) + (f" +{len(names) - limit}" if len(names) > limit else "")


def _row_dict(r: Row) -> dict:
    d = r.report.to_dict()
    d["ref"], d["kind"], d["error"] = r.name, r.spec.kind, r.error
    d["watched"] = r.spec.watched
    if r.error:
        d["ok"] = False  # not checked is not "applies"; no patches, so never a broken cell
    for p, pd in zip(r.report.patches, d["patches"]):
        pd["status"] = status_of(p)
        for hd in pd["hunks"]:  # hunk text only where someone must read it: keeps JSON small
            if hd["label"] in _QUIET_LABELS:
                hd.pop("text", None)
    return d


def _surface_dict(s: surface.SurfaceReport) -> dict:
    def f(x: surface.Finding) -> dict:
        return {
            "rule": x.rule,
            "path": x.path,
            "line": x.line,
            "text": x.text,
            "symbol": x.symbol,
            "status": x.status,
            "patch": x.patch,
        }

    return {
        "rules": [{"id": r.id, "title": r.title} for r in surface.RULES],
        "refs": [
            {
                "ref": r.ref,
                "previous": r.previous,
                "counts": r.counts(),
                "gone": r.gone,
                "new": [f(x) for x in r.new],
                "uncovered": [f(x) for x in r.uncovered],
            }
            for r in s.refs
        ],
    }


def coverage_for(
    series: Series, report: RefReport, cache: dict[tuple[str, str], list[FileDiff]]
) -> dict[str, list[tuple[str, str]]]:
    """path -> [(patch id, hunk text)] for the variants this ref uses."""
    cov: dict[str, list[tuple[str, str]]] = {}
    for p in report.patches:
        if not p.variant or p.variant == SKIP:
            continue
        key = (p.patch_id, p.variant)
        if key not in cache:
            cache[key] = diffio.load(series.get(p.patch_id).folder / p.variant, p.patch_id)
        for fd in cache[key]:
            cov.setdefault(fd.path, []).extend((p.patch_id, h.text) for h in fd.hunks)
    return cov


def patched_commits(repo: Path, commits: Sequence[str]) -> dict[str, str]:
    """commit -> the series commit in its history, for each commit a patched fork made.

    Why: such a tree already carries the series, so every patch would read as
    ``already-applied`` ("droppable"), which is wrong. One ``rev-list`` over all refs first:
    upstream has no such commit, so the usual run walks the history once, not once per ref;
    only when that finds one is each ref asked (``engine.patched_below``).
    """
    unique = list(dict.fromkeys(commits))
    if not unique:
        return {}
    any_patched = gitcmd.git_text(
        "rev-list",
        "-n1",
        f"--grep=^{engine.TRAILER}:",
        "--stdin",  # thousands of refs stay off the command line; ids from for-each-ref
        cwd=repo,
        input="".join(f"{c}\n" for c in unique).encode(),
    )
    if not any_patched:
        return {}
    return {c: made for c in unique if (made := engine.patched_below(repo, c))}


def _error_row(spec: RefSpec, message: str) -> Row:
    """A row for a ref that could not be checked: the run goes on, the report says why."""
    return Row(spec, RefReport(ref=spec.name, commit=spec.commit, version=""), error=message)


def _check_ref(
    repo: Path,
    cat: gitcmd.CatFile,
    spec: RefSpec,
    series: Series,
    version_override: str | None,
    patched_by: str | None,
) -> Row:
    """One ref's row; a patched fork's commit or a tree that is not Megatron-LM becomes an
    error row instead of ending the run (``--tags '*'`` meets both)."""
    if patched_by:
        return _error_row(
            spec,
            f"a patched fork's commit, not upstream (its history has {patched_by[:12]}, "
            "a commit of the series)",
        )
    try:
        report = engine.plan(repo, cat, spec.commit, series, version_override).report
    except SourceError as e:  # engine.tree_version: no or unreadable package_info.py
        return _error_row(spec, str(e))
    report.ref = spec.name
    tree = report.version
    if version_override:
        try:
            tree = str(engine.tree_version(cat, spec.commit))
        except SourceError:
            pass
    return Row(spec, report, tree)


def build_matrix(
    repo: Path,
    specs: list[RefSpec],
    series: Series,
    *,
    source: str,
    version_override: str | None = None,
    scan: bool = True,
) -> Matrix:
    """Check every ref (in memory) and, when ``scan``, run the CUDA-surface scan alongside."""
    t0 = time.perf_counter()
    job = surface.GrepJob(repo, [s.commit for s in specs if not s.watched]) if scan else None
    patched = patched_commits(repo, [s.commit for s in specs])
    with gitcmd.CatFile(repo) as cat:
        rows = [
            _check_ref(repo, cat, spec, series, version_override, patched.get(spec.commit))
            for spec in specs
        ]
    rows.sort(key=lambda r: r.sort_key)
    t1 = time.perf_counter()
    m = Matrix(
        source=source,
        series=series,
        rows=rows,
        generated_at=_dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )
    m.timings["check_s"] = t1 - t0
    if job is not None:
        # error rows are not upstream Megatron trees: their findings would only mislead;
        # watched refs (pull requests) are not upstream yet: "new at" must name a tag or branch
        checked = [r for r in rows if not r.error and not r.spec.watched]
        cache: dict[tuple[str, str], list[FileDiff]] = {}
        cov = {r.name: coverage_for(series, r.report, cache) for r in checked}
        m.surface = surface.scan(repo, [(r.name, r.spec.commit) for r in checked], cov, job)
        m.timings["scan_s"] = time.perf_counter() - t1
    m.timings["total_s"] = time.perf_counter() - t0
    return m


def broken_cells(data: dict) -> set[tuple[str, str]]:
    """(ref, patch) pairs that do not apply, from a matrix JSON document."""
    return {
        (r["ref"], p["patch_id"])
        for r in data.get("refs", [])
        if not r.get("watched", False)  # a pull request's head never gates
        for p in r.get("patches", [])
        if not p.get("ok", False)
    }


def new_breaks(current: dict, previous: dict | None) -> list[tuple[str, str]]:
    """Breaks absent from the previous run (without one, every break is new)."""
    before = broken_cells(previous) if previous else set()
    order = {r["ref"]: i for i, r in enumerate(current.get("refs", []))}
    return sorted(broken_cells(current) - before, key=lambda c: (order.get(c[0], 0), c[1]))
