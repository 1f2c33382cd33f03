"""``megatron-rocm install [DIR]``: pip-install a patched tree; the installed torch stays as is.

See ``megatron_rocm.envtools.installer`` for the guards (constraints pinning torch, --no-deps, NVIDIA-only
dependencies refused, rollback on failure). The tree's tracked ``*.egg-info`` files that the
build rewrites are put back afterwards (``envtools.build_byproducts``), so ``export`` still
sees a clean tree. ``--dry-run`` prints the plan and changes nothing.
"""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from megatron_rocm.cache import cache_dir
from megatron_rocm.commands import options
from megatron_rocm.envtools import build_byproducts, installer
from megatron_rocm.errors import EXIT_OK
from megatron_rocm.output import print_json
from megatron_rocm.patchtool import refnames


def _workdir() -> Path:
    """Per-run folder for the constraints file and the pip lists before/after (an audit trail)."""
    return cache_dir() / "install" / time.strftime("%Y%m%d-%H%M%S")


def _show_plan(p: installer.Plan) -> None:
    pins = ", ".join(f"{n}=={v}" for n, v in p.pins.items())
    print(f"tree:        {p.tree}")
    print(f"constraints: {pins}  ({p.constraints})")
    for k, step in enumerate(p.steps, 1):
        print(f"[{k}/{len(p.steps)}] {step.title}")
        if step.argv:
            print("      $ " + shlex.join(step.argv))


def install(
    tree_dir: str = ".", editable: bool = True, dry_run: bool = False, as_json: bool = False
) -> int:
    # "" would resolve to the current folder and install whatever is there: refuse it, as
    # `apply --dest ""` is refused.
    p = installer.plan(refnames.check_text(tree_dir, "DIR"), editable, _workdir())
    if dry_run:
        if as_json:
            print_json({**p.to_dict(), "dry_run": True})
        else:
            _show_plan(p)
            print("dry run: nothing changed")
        return EXIT_OK
    clean = build_byproducts.clean_tracked_metadata(p.tree)
    try:
        done, built = installer.execute(p, log=(lambda _line: None) if as_json else print)
    finally:  # a failed build may have rewritten them too
        restored = build_byproducts.put_back(p.tree, clean)
    if as_json:
        print_json(
            {
                **p.to_dict(),
                "dry_run": False,
                "done": done,
                "built": [str(b) for b in built],
                "restored": restored,
            }
        )
    else:
        if restored:
            print(f"put back {len(restored)} tracked egg-info file(s) the build rewrote")
        print(
            f"installed {p.tree} ({'editable' if editable else 'regular'}); "
            f"torch {p.torch} untouched; next: megatron-rocm smoke {p.tree}"
        )
    return EXIT_OK


def add_parser(sub: argparse._SubParsersAction) -> None:
    """This verb's options, on ``main``'s parser."""
    p = sub.add_parser("install", help="pip-install a patched tree (never touches torch)")
    p.add_argument("dir", nargs="?", default=".", help="patched tree (default: .)")
    p.add_argument("--no-editable", action="store_true", help="a regular, not editable, install")
    p.add_argument("--dry-run", action="store_true", help="print the steps, change nothing")
    options.add_json(p)


def run(args: argparse.Namespace) -> int:
    return install(
        tree_dir=args.dir,
        editable=not args.no_editable,
        dry_run=args.dry_run,
        as_json=args.json,
    )
