"""Hermetic test environment: no user git config, fixed identity and dates, private HOME.

Downloads (PyPI sdists) are cached outside the temporary HOME so repeated runs and CI reuse
them: $MEGATRON_ROCM_TEST_CACHE or ~/.cache/megatron-rocm-tests.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import cache_paths  # noqa: F401 - imported before HOME is replaced, so it sees the real one
import pytest
import tiers
from toyrepo import make_series, make_upstream, seal


@pytest.hookimpl(trylast=True)  # after -m has deselected the other tier
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Plain ``pytest`` (the quick tier) must touch every area of ``tiers.AREAS``."""
    if tiers.is_whole_quick_run(config):
        gaps = tiers.missing_areas(items)
        if gaps:
            raise pytest.UsageError(f"the quick tier collects no test of: {', '.join(gaps)}")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """A Triton test on a CPU-only machine reports what the interpreter's child run said of it."""
    if pyfuncitem.get_closest_marker("triton_interpreted") is None:
        return None  # (the import below needs torch: only Triton tests pay for it)
    from triton_interpreter import outcome_from_child

    return outcome_from_child(pyfuncitem)


@pytest.fixture(autouse=True)
def hermetic(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    seal(monkeypatch, tmp_path_factory.mktemp("home"))


@pytest.fixture
def owner_permissions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The file modes an unprivileged owner meets, also where the tests run as root (CI does).

    Root ignores mode bits, so there ``os.open``, ``os.mkdir`` and ``os.access`` refuse (EACCES)
    what the owner bits of the path, or of the folder a new entry goes in, forbid; elsewhere the
    kernel already does. Python's own ``open`` and child processes (git) are not covered."""
    if os.geteuid() != 0:
        return

    def owner_may(path: object, bits: int) -> bool:
        try:
            return os.stat(path).st_mode & bits == bits  # type: ignore[arg-type]
        except OSError:
            return True  # the real call reports it

    def refuse(path: object) -> PermissionError:
        return PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))  # type: ignore[arg-type]

    real_open, real_mkdir, real_access = os.open, os.mkdir, os.access
    write_in = stat.S_IWUSR | stat.S_IXUSR

    def fake_open(path, flags, mode=0o777, *, dir_fd=None):  # noqa: ANN001, ANN202
        if dir_fd is None and not isinstance(path, int):
            target = Path(os.fsdecode(path))
            if target.exists():
                if flags & (os.O_WRONLY | os.O_RDWR) and not owner_may(target, stat.S_IWUSR):
                    raise refuse(path)
            elif flags & os.O_CREAT and not owner_may(target.parent, write_in):
                raise refuse(path)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def fake_mkdir(path, mode=0o777, *, dir_fd=None):  # noqa: ANN001, ANN202
        if dir_fd is None and not owner_may(Path(os.fsdecode(path)).parent, write_in):
            raise refuse(path)
        return real_mkdir(path, mode, dir_fd=dir_fd)

    def fake_access(path, mode, **kwargs):  # noqa: ANN001, ANN003, ANN202
        bits = (
            (stat.S_IRUSR if mode & os.R_OK else 0)
            | (stat.S_IWUSR if mode & os.W_OK else 0)
            | (stat.S_IXUSR if mode & os.X_OK else 0)
        )
        return real_access(path, mode, **kwargs) and owner_may(path, bits)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    monkeypatch.setattr(os, "access", fake_access)


@pytest.fixture
def toy(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(scratch folder, upstream repo with core_v0.1.0..0.6.0 tags, patches/ folder)."""
    upstream = make_upstream(tmp_path)
    return tmp_path, upstream, make_series(tmp_path, upstream)


@pytest.fixture
def matrix_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per time ``matrix`` started its work (``build_matrix``, stubbed): tests of
    refusals that must come before the work read it empty."""
    called: list[int] = []
    monkeypatch.setattr(
        "megatron_rocm.commands.matrix.build_matrix", lambda *a, **k: called.append(1)
    )
    return called
