"""Upstream's ``--ckpt-drop-redundant-extra-state`` (main) keeps the native linears' delayed
scaling histories: its own rule, ``_fp8_extra_state_is_persistent``, read from the mirror's
``main`` and run on the values ``backend.fp8_checkpoint`` writes (its source file needs Python
3.12 and the training stack to import, so only that function and its markers are taken).
"""

from __future__ import annotations

import ast
import subprocess
from types import SimpleNamespace

import pytest
from cache_paths import MIRROR

pytestmark = [pytest.mark.upstream, pytest.mark.torch, pytest.mark.full]
torch = pytest.importorskip("torch")

from megatron_rocm.runtime.backend import fp8 as backend_fp8  # noqa: E402
from megatron_rocm.runtime.backend import fp8_checkpoint  # noqa: E402
from megatron_rocm.runtime.kernels import fp8  # noqa: E402

RULE, MARKERS = "_fp8_extra_state_is_persistent", "_FP8_PERSISTENT_EXTRA_STATE_MARKERS"


def _upstream_rule():  # noqa: ANN202
    """Upstream main's rule, compiled from the mirror's source of it."""
    if not (MIRROR / "HEAD").exists():
        pytest.skip("needs a Megatron-LM git mirror (MEGATRON_ROCM_TEST_MIRROR)")
    source = subprocess.run(
        ["git", "-C", str(MIRROR), "show", "main:megatron/training/checkpointing.py"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    wanted = [
        node
        for node in ast.parse(source).body
        if (isinstance(node, ast.FunctionDef) and node.name == RULE)
        or (
            isinstance(node, ast.Assign)
            and any(getattr(t, "id", "") == MARKERS for t in node.targets)
        )
    ]
    assert len(wanted) == 2, f"upstream main has no {RULE} and {MARKERS} any more: look again"
    names: dict = {"torch": torch}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "checkpointing.py", "exec"), names)  # noqa: S102
    return names[RULE]


def _linear(delayed: bool, started: bool) -> SimpleNamespace:
    histories = backend_fp8.DelayedScaling(
        *(fp8.AmaxHistory(16, most_recent=False) for _ in range(3))
    )
    recipe = backend_fp8.Fp8Recipe(
        formats=fp8.formats("hybrid", arch="cpu"), delayed=histories if delayed else None
    )
    if delayed and started:
        recipe.history("input").start(torch.ones(4, 16))
    return SimpleNamespace(fp8_recipe=recipe, weight=torch.empty(0))


def test_upstream_keeps_the_histories_and_drops_the_values_without_fp8_state() -> None:
    persistent = _upstream_rule()
    no_fp8 = torch.empty(0, dtype=torch.uint8)
    for started in (False, True):  # a fresh model's request and a trained one's save
        assert persistent(fp8_checkpoint.extra_state(_linear(True, started), no_fp8)) is True
    assert persistent(fp8_checkpoint.extra_state(_linear(False, True), no_fp8)) is False
    assert persistent(fp8_checkpoint.extra_state(_linear(False, True), None)) is False
