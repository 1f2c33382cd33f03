"""Where upstream comes from: a git URL, a local clone/mirror, or PyPI sdists.

Every source ends up as a local git repository the engine can read with ``cat-file``. Local
sources are only ever read (or cloned from), never modified.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import git

from megatron_rocm.errors import SourceError, UsageError
from megatron_rocm.patchtool import gitcmd, pypi
from megatron_rocm.progress import CloneProgress

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
    if source is None:
        return Source("url", DEFAULT_URL)
    if source == "pypi":
        return Source("pypi", pypi.DEFAULT_INDEX)
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
    """A blobless bare mirror of ``url`` in the cache, fetched fresh on every use."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", url).strip("-")[-80:]
    repo = pypi.cache_dir() / "repos" / f"{slug}.git"
    progress = CloneProgress(quiet)
    try:
        if (repo / "HEAD").exists():
            git.Repo(repo).remote("origin").fetch(
                ["+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*"],
                progress=progress,
                prune=True,
            )
        else:
            repo.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=repo.name + ".", dir=repo.parent))
            try:
                git.Repo.clone_from(
                    url,
                    tmp,
                    progress=progress,
                    multi_options=["--bare", "--filter=blob:none"],
                    env=gitcmd.sanitized_env(),
                )
                tmp.replace(repo)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except git.GitCommandError as e:
        raise SourceError(
            f"cannot clone {url}: {_git_reason(e, progress)}; {SOURCE_HINT}"
        ) from None
    return repo


def _git_reason(e: git.GitCommandError, progress: CloneProgress | None = None) -> str:
    """git's own last 'fatal:' line (a progress handler swallows stderr, so look there too)."""
    text = str(e.stderr or "") + "\n" + "\n".join(progress.error_lines if progress else [])
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    fatal = [ln for ln in lines if "fatal" in ln or "error" in ln]
    text = (fatal or lines or [str(e.status)])[-1]
    return text.removeprefix("stderr: ").strip("'")


def reading_repo(source: Source, refs: list[str] | None, quiet: bool = False) -> Path:
    """A local repo holding ``refs`` for in-memory checks (no work tree needed)."""
    if source.kind == "path":
        return Path(source.location)
    if source.kind == "url":
        return _cache_mirror(source.location, quiet)
    if not refs:
        refs = [pypi.release_versions()[-1]]
    return pypi.sdist_repo(refs)


def default_ref(repo: Path) -> str:
    tags = release_tags(repo)
    if not tags:
        raise UsageError(f"{repo} has no core_vX.Y.Z release tags; pass --ref")
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
    progress = CloneProgress(quiet)
    try:
        git.Repo.clone_from(
            origin,
            dest,
            progress=progress,
            no_checkout=True,
            env=gitcmd.sanitized_env(),
        )
    except git.GitCommandError as e:
        raise SourceError(
            f"cannot clone {source.label}: {_git_reason(e, progress)}; {SOURCE_HINT}"
        ) from None
    if source.kind == "pypi":
        for scope in pypi.SCOPES:
            gitcmd.git("config", "--add", "megatron-rocm.scope", scope, cwd=dest)
    return dest
