"""Which layer may import which, and no import loops, read statically from the package source.

The layers: the patch tool (``patchtool/``) is a library the CLI (``main``, ``commands/``,
``output``, ``error_handler``) drives, so it never imports the CLI; the runtime (``runtime/``)
runs inside a patched Megatron and imports neither the patch tool, the environment tools nor the
CLI. Imports anywhere count (a function-level import is a dependency too), except under
``if TYPE_CHECKING:`` and in an ``if __name__ == "__main__":`` block (running a file as a
script is the CLI's business).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_rocm"
CLI = (
    "megatron_rocm.main",
    "megatron_rocm.commands",
    "megatron_rocm.output",
    "megatron_rocm.error_handler",
    "megatron_rocm.console",
    "megatron_rocm.__main__",
)


def _name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {_name(p, package.parent): p for p in sorted(package.rglob("*.py"))}


def _skipped(node: ast.If) -> bool:
    test = ast.unparse(node.test)
    return test in ("TYPE_CHECKING", "typing.TYPE_CHECKING") or "__name__ ==" in test


def _imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The megatron_rocm modules ``module`` imports (a package's ``__init__`` is its name)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _skipped(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in found if m in known and m != module}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    mods = _modules(package)
    return {m: _imported(m, p, set(mods)) for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


GRAPH = import_graph()


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        ("megatron_rocm.patchtool", CLI),
        (
            "megatron_rocm.runtime",
            CLI + ("megatron_rocm.patchtool", "megatron_rocm.envtools"),
        ),
    ],
)
def test_layer_imports_point_one_way(layer, forbidden):
    bad = sorted(
        f"{m} imports {t}"
        for m, targets in GRAPH.items()
        if _under(m, (layer,))
        for t in targets
        if _under(t, forbidden)
    )
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    assert cycles(GRAPH) == []


def test_the_cycle_finder_sees_a_loop_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "megatron_rocm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from megatron_rocm.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron_rocm.sub import a\n"
    )
    graph = import_graph(pkg)
    assert cycles(graph) == [["megatron_rocm.sub.a", "megatron_rocm.sub.b"]]
    assert graph["megatron_rocm.c"] == set()
