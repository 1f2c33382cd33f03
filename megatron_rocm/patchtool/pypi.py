"""Upstream from PyPI: ``megatron-core`` sdists turned into a local git repo, one tag each.

Why: CI boxes and some users reach only a package index. The sdists hold ``megatron/core``
(and ``megatron/training`` from 0.17); files outside that are reported out of scope. Each
release becomes an orphan commit tagged ``core_v<version>`` in a cached repository, so the
rest of the engine works on sdists exactly as on real clones.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from megatron_rocm.cache import cache_dir
from megatron_rocm.errors import SourceError, UsageError
from megatron_rocm.patchtool import gitcmd, lock, scratch
from megatron_rocm.patchtool.series import parse_version

PROJECT = "megatron-core"
INDEX_ENV = "MEGATRON_ROCM_PYPI_URL"  # JSON API root, default https://pypi.org/pypi
DEFAULT_INDEX = "https://pypi.org/pypi"
SCOPES = ("megatron/core", "megatron/training")
FIXED_DATE = "@1700000000 +0000"


def version_from_ref(ref: str) -> str:
    """``core_v0.14.0`` or ``0.14.0`` -> ``0.14.0``."""
    text = ref.removeprefix("core_v").removeprefix("v")
    return str(parse_version(text))


def _get(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:  # noqa: S310 - https index
            return resp.read()
    except urllib.error.HTTPError as e:
        raise SourceError(f"PyPI answered {e.code} for {url}") from None
    except (urllib.error.URLError, OSError) as e:
        raise SourceError(
            f"cannot reach PyPI ({getattr(e, 'reason', e)}); use --source PATH with a local "
            "clone of Megatron-LM, or set MEGATRON_ROCM_PYPI_URL to a reachable index"
        ) from None


def fetch_sdist(version: str) -> Path:
    """Download (once; cached, sha256-checked) the sdist of ``megatron-core==version``."""
    index = os.environ.get(INDEX_ENV, DEFAULT_INDEX).rstrip("/")
    target_dir = cache_dir() / "sdists"
    cached = sorted(target_dir.glob(f"megatron_core-{version}.tar.gz"))
    if cached:
        return cached[0]
    files = _releases(index).get(version)
    if files is None:
        raise UsageError(f"{PROJECT} has no release {version} on PyPI")
    sdists = [u for u in files if u.get("packagetype") == "sdist"]
    if not sdists:
        raise UsageError(f"{PROJECT} {version} has no sdist on PyPI")
    info = sdists[0]
    # Mirrors and proxies may serve relative file URLs: resolve against the JSON page.
    data = _get(urllib.parse.urljoin(f"{index}/{PROJECT}/json", info["url"]))
    want = info.get("digests", {}).get("sha256")
    if want and hashlib.sha256(data).hexdigest() != want:
        raise SourceError(f"sha256 mismatch for {info['filename']}; download corrupted")
    target_dir.mkdir(parents=True, exist_ok=True)
    path = target_dir / f"megatron_core-{version}.tar.gz"
    tmp = target_dir / f".{path.name}.{os.getpid()}.part"
    tmp.write_bytes(data)
    tmp.replace(path)
    return path


@functools.lru_cache(maxsize=4)
def _releases(index: str) -> dict[str, list[dict]]:
    """The project's release -> files map (one request; per-version pages are not needed)."""
    return json.loads(_get(f"{index}/{PROJECT}/json")).get("releases", {})


def _sdist_files(path: Path) -> dict[str, tuple[str, bytes]]:
    """Regular files of the sdist, path -> (mode, content), top folder stripped."""
    files: dict[str, tuple[str, bytes]] = {}
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                rel = member.name.split("/", 1)[1] if "/" in member.name else ""
                if not rel or rel.startswith("/") or ".." in rel.split("/"):
                    continue
                handle = tar.extractfile(member)
                if handle is None:
                    continue
                mode = "100755" if member.mode & 0o111 else "100644"
                files[rel] = (mode, handle.read())
    except (tarfile.TarError, OSError, EOFError) as e:
        raise SourceError(
            f"{path} is not a readable sdist ({e}); delete it to re-download"
        ) from None
    return files


def sdist_repo(refs: list[str]) -> Path:
    """A cached bare repo with tag ``core_v<version>`` for each requested release.

    Runs sharing the cache take turns (a waiting lock); a new repo is made in a scratch
    folder and renamed into place, so a killed run never leaves a half-made one.
    """
    root = cache_dir()
    repo = root / "pypi-megatron-core.git"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SourceError(f"cannot create the cache folder {root}: {e.strerror}") from None
    with lock.hold(root / "pypi-megatron-core.lock", what="the PyPI sdist cache", wait=True):
        scratch.sweep(root, "pypi-megatron-core.tmp-")
        if not (repo / "HEAD").exists():
            with scratch.folder(root, "pypi-megatron-core.tmp-") as tmp:
                gitcmd.git("init", "-q", "--bare", "--", str(tmp / "repo.git"), cwd=tmp)
                for scope in SCOPES:
                    gitcmd.git(
                        "config", "--add", "megatron-rocm.scope", scope, cwd=tmp / "repo.git"
                    )
                (tmp / "repo.git").replace(repo)
        scratch.sweep(repo, scratch.GIT_PREFIX)
        for ref in refs:
            version = version_from_ref(ref)
            tag = f"core_v{version}"
            if gitcmd.rev_parse(repo, f"refs/tags/{tag}"):
                continue
            _import(repo, fetch_sdist(version), tag)
    return repo


def _import(repo: Path, sdist: Path, tag: str) -> None:
    tree = gitcmd.write_tree(repo, _sdist_files(sdist))
    commit_env = {
        **gitcmd.IDENTITY,
        "GIT_AUTHOR_DATE": FIXED_DATE,
        "GIT_COMMITTER_DATE": FIXED_DATE,
    }
    commit = gitcmd.git_text(
        "commit-tree",
        tree,
        cwd=repo,
        env=commit_env,
        input=f"{PROJECT} {tag} (sdist from PyPI)\n".encode(),
    )
    gitcmd.git("update-ref", "--end-of-options", f"refs/tags/{tag}", commit, cwd=repo)


def _final_releases() -> dict[str, list[dict]]:
    """Final releases that have an sdist, newest last, with their files."""
    index = os.environ.get(INDEX_ENV, DEFAULT_INDEX).rstrip("/")
    out = {}
    for ver, files in _releases(index).items():
        v = parse_version(ver)
        if v.is_prerelease or v.is_devrelease:
            continue
        if any(f.get("packagetype") == "sdist" for f in files):
            out[v] = files
    return {str(v): out[v] for v in sorted(out)}


def release_versions() -> list[str]:
    """Every final release of megatron-core on PyPI that has an sdist (newest last)."""
    return list(_final_releases())


def _admits(files: list[dict], python: str) -> bool:
    """Whether the sdist's ``requires_python`` (PyPI metadata) allows this interpreter."""
    spec = next((f.get("requires_python") for f in files if f.get("packagetype") == "sdist"), None)
    try:
        return not spec or python in SpecifierSet(spec)
    except InvalidSpecifier:
        return True  # as pip: an unreadable constraint does not exclude the release


def newest_for_python(python: str | None = None) -> tuple[str, list[str]]:
    """The release pip would pick for this interpreter, and the newer ones it excludes.

    ``apply --source pypi`` without ``--ref`` makes a tree to install here: megatron-core
    0.17+ needs Python 3.12, so on 3.11 the newest release would only fail at ``install``.
    """
    python = python or platform.python_version()
    releases = _final_releases()
    newer: list[str] = []
    for version in reversed(releases):
        if _admits(releases[version], python):
            return version, newer
        newer.insert(0, version)
    raise SourceError(f"no {PROJECT} release on PyPI supports Python {python}")


__all__ = [
    "fetch_sdist",
    "newest_for_python",
    "release_versions",
    "sdist_repo",
    "version_from_ref",
]
