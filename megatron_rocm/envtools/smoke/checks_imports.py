"""Import checks: the patched tree's packages, model builders and ``pretrain_gpt`` load here.

The tree goes first on ``sys.path`` (``runner.make_context``), and each check verifies that the
module really came from the tree: a stale ``pip install megatron-core`` shadowing the patched
checkout is the classic way to smoke-test the wrong code.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from pathlib import Path

from megatron_rocm.envtools.smoke.runner import CheckFailed, Context, Skip, register
from megatron_rocm.patchtool import engine


def _skip_if_outside_source(tree: Path, rel: str) -> None:
    """A tree applied from PyPI sdists holds only what the sdist ships (``apply`` records that
    as ``megatron-rocm.scope``; ``megatron/training`` only from 0.17): a missing file there is
    missing by design, so skip, not fail. In a full clone the same absence fails the check."""
    if engine.repo_scope(tree) and not (tree / rel).exists():
        raise Skip(
            f"{rel} is not in this tree: it came from a megatron-core sdist, which ships "
            "megatron/core (and megatron/training from 0.17); apply from a Megatron-LM clone "
            "for the full tree"
        )


def _import_from_tree(ctx: Context, name: str) -> object:
    tree = ctx.needs_tree()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # upstream warns about missing Apex/TE on import
        mod = importlib.import_module(name)
    where = Path(getattr(mod, "__file__", "") or "").resolve()
    if tree.resolve() not in where.parents:
        raise CheckFailed(
            f"{name} was imported from {where}, not from the tree {tree}; "
            "uninstall the other copy or run smoke in a fresh environment"
        )
    return mod


@register("imports.megatron_core")
def megatron_core(ctx: Context) -> str:
    """``import megatron.core`` from the tree, and its version."""
    _import_from_tree(ctx, "megatron.core")
    info = importlib.import_module("megatron.core.package_info")
    return f"megatron.core {getattr(info, '__version__', '?')}"


@register("imports.megatron_training")
def megatron_training(ctx: Context) -> str:
    """``import megatron.training`` (arguments, initialize, training loop)."""
    _skip_if_outside_source(ctx.needs_tree(), "megatron/training")
    _import_from_tree(ctx, "megatron.training")
    return "megatron.training"


@register("imports.models")
def models(ctx: Context) -> str:
    """GPTModel and the local layer spec builder."""
    gpt = _import_from_tree(ctx, "megatron.core.models.gpt")
    specs = _import_from_tree(ctx, "megatron.core.models.gpt.gpt_layer_specs")
    missing = [
        n for n, m in (("GPTModel", gpt), ("get_gpt_layer_local_spec", specs)) if not hasattr(m, n)
    ]
    if missing:
        raise CheckFailed(f"missing: {', '.join(missing)}")
    return "GPTModel, get_gpt_layer_local_spec"


@register("imports.pretrain_gpt")
def pretrain_gpt(ctx: Context) -> str:
    """``pretrain_gpt.py`` of the tree loads (its imports run; training does not start)."""
    tree = ctx.needs_tree()
    _skip_if_outside_source(tree, "pretrain_gpt.py")
    path = tree / "pretrain_gpt.py"
    if not path.is_file():
        raise CheckFailed(f"{path} does not exist; is this a whole Megatron-LM checkout?")
    spec = importlib.util.spec_from_file_location("megatron_rocm_smoke_pretrain_gpt", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(spec.name, None)
    found = [
        n
        for n in ("model_provider", "forward_step", "train_valid_test_datasets_provider")
        if hasattr(mod, n)
    ]
    return f"pretrain_gpt.py ({', '.join(found) or 'no known entry points'})"
