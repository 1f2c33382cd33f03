"""Where upstream comes from: a git URL, a local clone/mirror, or PyPI sdists.

Every source ends up as a local git repository the engine can read with ``cat-file``. Local
sources are only ever read (or cloned from), never modified.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_rocm.cache import cache_dir
from megatron_rocm.errors import SourceError, UsageError
from megatron_rocm.patchtool import engine, gitcmd, lock, pypi, refnames, scratch

DEFAULT_URL = "https://github.com/NVIDIA/Megatron-LM.git"
RELEASE_TAG = re.compile(r"^core_v(\d+)\.(\d+)\.(\d+)$")
SOURCE_HINT = (
    "use --source with a local clone or mirror (--source ~/Megatron-LM), "
    "a reachable git URL, or --source pypi"
)


@dataclass(frozen=True)
class Source:
    kind: str  # "url" | "path" | "pypi"
    location: str

    @property
    def label(self) -> str:
        return "PyPI megatron-core sdists" if self.kind == "pypi" else self.location


def classify(source: str | None) -> Source:
    """What ``--source`` names. Checked before anything is cloned: a value git could read as
    an option (``--upload-pack=...``) or a remote helper (``ext::``) is a usage error."""
    if source is None:
        return Source("url", DEFAULT_URL)
    if source == "pypi":
        return Source("pypi", pypi.DEFAULT_INDEX)
    refnames.check_text(source, "--source")
    if source.startswith("-"):
        raise UsageError(f"--source {source!r} starts with '-'; {SOURCE_HINT}")
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*::", source):
        raise UsageError(f"--source {source!r}: remote helpers (<helper>::) are not supported")
    if "://" in source or re.match(r"^[\w.-]+@[\w.-]+:", source):
        return Source("url", source)
    path = Path(source).expanduser()
    if not path.exists():
        raise SourceError(f"source {source!r} does not exist; {SOURCE_HINT}")
    if not gitcmd.is_git_repo(path):
        raise SourceError(f"source {source!r} is not a git repository; {SOURCE_HINT}")
    return Source("path", str(path.resolve()))


def release_tags(repo: Path) -> list[str]:
    """Release tags ``core_vX.Y.Z`` sorted by version (newest last)."""
    out = gitcmd.git_text("tag", "--list", "core_v*", cwd=repo).split()
    tags = [t for t in out if RELEASE_TAG.match(t)]
    return sorted(tags, key=lambda t: tuple(int(x) for x in RELEASE_TAG.match(t).groups()))  # type: ignore[union-attr]


def _cache_mirror(url: str, quiet: bool) -> Path:
    """A blobless bare mirror of ``url`` in the cache, fetched fresh on every use.

    Runs that share the cache take turns (a waiting lock); a first clone goes to a scratch
    folder renamed into place, so a killed run never leaves half a mirror behind.
    """
    slug = re.sub(r"[^A-Za-z0-9]+", "-", url).strip("-")[-80:]
    repos = cache_dir() / "repos"
    repo = repos / f"{slug}.git"
    try:
        repos.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SourceError(f"cannot create the cache folder {repos}: {e.strerror}") from None
    with lock.hold(repos / f"{slug}.lock", what=f"the cache of {url}", wait=True):
        scratch.sweep(repos, f"{slug}.tmp-")
        try:
            if (repo / "HEAD").exists():
                gitcmd.fetch(repo, "origin", MIRROR_REFSPECS, prune=True, quiet=quiet)
            else:
                with scratch.folder(repos, f"{slug}.tmp-") as tmp:
                    gitcmd.clone(url, tmp / "repo.git", bare=True, blobless=True, quiet=quiet)
                    (tmp / "repo.git").replace(repo)
        except gitcmd.GitError as e:
            raise SourceError(f"cannot clone {url}: {e.reason}; {SOURCE_HINT}") from None
    return repo


MIRROR_REFSPECS = ("+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*")


def reading_repo(source: Source, refs: list[str] | None, quiet: bool = False) -> Path:
    """A local repo holding ``refs`` for in-memory checks (no work tree needed)."""
    if source.kind == "path":
        return Path(source.location)
    if source.kind == "url":
        return _cache_mirror(source.location, quiet)
    if not refs:
        refs = [pypi.release_versions()[-1]]
    return pypi.sdist_repo(refs)


def default_ref(repo: Path, where: str | None = None) -> str:
    tags = release_tags(repo)
    if not tags:
        raise UsageError(f"{where or repo} has no core_vX.Y.Z release tags; pass --ref")
    return tags[-1]


def pypi_ref(ref: str | None, quiet: bool = False) -> str:
    """``core_v<version>`` of ``--ref``; without one, the release ``pip install megatron-core``
    would take here (the newest this Python can install), saying which newer ones it passed."""
    if ref:
        return f"core_v{pypi.version_from_ref(ref)}"
    version, newer = pypi.newest_for_python()
    if newer and not quiet:
        print(
            f"note: megatron-core {', '.join(newer)} need a newer Python than this one; "
            f"taking {version} (pass --ref to choose)",
            file=sys.stderr,
        )
    return f"core_v{version}"


def clone_into(source: Source, dest: Path, ref: str | None, quiet: bool = False) -> Path:
    """Clone ``source`` into ``dest`` (a fresh folder the caller renames into place)."""
    if source.kind == "pypi":
        origin = str(pypi.sdist_repo([pypi_ref(ref, quiet)]))
    else:
        origin = source.location
    if not quiet:
        print(f"cloning {source.label}", flush=True)
    try:
        gitcmd.clone(origin, dest, quiet=quiet)
    except gitcmd.GitError as e:
        raise SourceError(f"cannot clone {source.label}: {e.reason}; {SOURCE_HINT}") from None
    if source.kind == "pypi":
        for scope in pypi.SCOPES:
            gitcmd.git("config", "--add", "megatron-rocm.scope", scope, cwd=dest)
    return dest


def fetch_as_checked(repo: Path, source: Source, ref: str, quiet: bool = False) -> str | None:
    """``ref`` resolved in a local ``source`` the way ``check`` resolves it there (its
    remote-tracking branches too, which a clone of it does not copy), fetched into ``repo``;
    None when the source has no such ref. So what ``check --source DIR`` accepts, ``apply``
    builds."""
    if source.kind != "path":
        return None
    commit = engine.find_commit(Path(source.location), ref)
    if commit is None:
        return None
    try:
        gitcmd.fetch(repo, source.location, [commit], quiet=quiet)
    except gitcmd.GitError as e:
        raise SourceError(f"cannot fetch {ref!r} from {source.label}: {e.reason}") from None
    return gitcmd.rev_parse(repo, "FETCH_HEAD")


def fetch_ref(repo: Path, source: Source, ref: str, quiet: bool = False) -> str:
    """Fetch ``ref`` from ``source`` into an existing clone (FETCH_HEAD only: no ref moves)
    and return its commit. An unknown ref is a usage error, as on a fresh clone."""
    if source.kind == "pypi":
        ref = pypi_ref(ref, quiet)
        origin = str(pypi.sdist_repo([ref]))
    else:
        origin = source.location
    if source.kind == "path" and not ref.startswith(engine.QUALIFIED):
        engine.refuse_ambiguous(Path(origin), ref)  # git fetch would take the tag silently
    try:
        gitcmd.fetch(repo, origin, [ref], quiet=quiet)
    except gitcmd.GitError as e:
        low = e.reason.lower()
        if any(s in low for s in ("couldn't find remote ref", "not our ref", "unadvertised")):
            raise UsageError(
                f"unknown ref {ref!r} in {source.label} (a tag, branch or commit of the source)"
            ) from None
        raise SourceError(f"cannot fetch {ref!r} from {source.label}: {e.reason}") from None
    commit = gitcmd.rev_parse(repo, "FETCH_HEAD")
    if commit is None:
        raise SourceError(f"fetching {ref!r} from {source.label} gave no commit")
    return commit
