"""Every file of ours that the README, docs/, scripts/, CI and the series name exists.

Files move (``scripts/bench/``, ``runtime/backend/cp/``, ...); a path left behind in a doc or a
driver script fails only when someone follows it. This reads each path of ``scripts/`` or
``megatron_rocm/`` mentioned in those files, and each ``-m scripts.x`` / ``-m megatron_rocm.x``
module, and checks it is there. (Paths under ``tests/`` are left out: upstream's test paths
have the same shape.)
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["README.md", "docs", "scripts", ".github", ".ci", "patches"]
PATH = re.compile(r"(?<![\w./-])((?:scripts|megatron_rocm)/[\w./-]*\w\.(?:py|sh))")
MODULE = re.compile(r"-m ((?:scripts|megatron_rocm)(?:\.\w+)+)(?![.\w<])")


def _texts() -> list[Path]:
    out = []
    for name in SOURCES:
        top = ROOT / name
        files = [top] if top.is_file() else sorted(top.rglob("*"))
        out += [p for p in files if p.is_file() and p.suffix in {".md", ".sh", ".py", ".yml", ""}]
    return out


def _exists(path: str) -> bool:
    return (ROOT / path).exists() or (ROOT / "megatron_rocm/runtime" / path).exists()


def dangling(text: str) -> set[str]:
    bad = {p for p in PATH.findall(text) if not _exists(p)}
    for module in MODULE.findall(text):
        stem = module.replace(".", "/")
        if not (_exists(stem + ".py") or _exists(stem + "/__main__.py")):
            bad.add("-m " + module)
    return bad


def test_no_reference_to_a_moved_or_missing_file():
    found = {
        f"{p.relative_to(ROOT)}: {ref}" for p in _texts() for ref in dangling(p.read_text("utf-8"))
    }
    assert not found, "\n".join(sorted(found))


def test_the_check_sees_an_old_script_path():
    assert dangling("run `python scripts/bench_norm.py` or `python -m scripts.bench_rope`") == {
        "scripts/bench_norm.py",
        "-m scripts.bench_rope",
    }
    assert dangling("`python -m scripts.bench.norm`, `scripts/bench/rope.py`") == set()
