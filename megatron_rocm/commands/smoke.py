"""``megatron-rocm smoke [DIR]``: does the patched tree import, compute and train here?

Exit 0 only when no check failed; skips (no GPU, one GPU) are listed with their reason.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_rocm.envtools.installer import ROCM_TORCH, check_python, megatron_tree
from megatron_rocm.errors import EXIT_FAILED, EXIT_OK, SourceError, UsageError
from megatron_rocm.output import note, writable
from megatron_rocm.patchtool.refnames import check_text
from megatron_rocm.runtime.platform import import_torch

NEEDS_TREE = ("imports", "training", "parallel", "collectives.tensor_parallel")
OPT_IN = ("throughput",)  # groups only --full (or --only) runs


def _tree_for(checks: list, tree_dir: str) -> Path | None:
    """A tree is required when a selected check needs one; otherwise used only if valid.

    A tree this Python cannot run (its ``requires-python``, as ``install`` checks it) or whose
    ``pyproject.toml`` cannot be read is refused with one line when required, and left out with
    a note otherwise; a folder that is no Megatron-LM tree at all is left out quietly.
    """
    if any(c.name == p or c.name.startswith(p + ".") for c in checks for p in NEEDS_TREE):
        try:
            tree = megatron_tree(tree_dir)
        except UsageError as e:
            raise UsageError(f"{e}; to check the kernels alone use --only kernels") from e
        check_python(tree)
        return tree
    try:
        tree = megatron_tree(tree_dir)
    except UsageError:
        return None
    try:
        check_python(tree)
    except (UsageError, SourceError) as e:
        note(f"not using the tree: {e}")
        return None
    return tree


def _same_file(a: str, b: str) -> bool:
    """Whether two report paths name one file (``same.out`` and ``./same.out`` do; so do a
    link and its target)."""
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, RuntimeError):  # a loop: writable() says so in its own line
        return False


def smoke(
    tree_dir: str = ".",
    json_file: str | None = None,
    junit_file: str | None = None,
    only: list[str] | None = None,
    steps: int = 30,
    full: bool = False,
    report_dir: str | None = None,
) -> int:
    """``full``: every check, the throughput probe too (else it runs only when ``only`` names
    it); ``report_dir``: write the first-run report (report.json, report.md) there."""
    if full and only:
        raise UsageError("--full runs every check; give --full or --only, not both")
    if steps < 4:
        raise UsageError(
            f"--steps must be at least 4 (got {steps}): loss is compared between "
            "the first and the last two steps"
        )
    if json_file and junit_file and _same_file(json_file, junit_file):
        raise UsageError(
            f"--json and --junit name the same file ({junit_file}); the second report would "
            "overwrite the first: give each its own path"
        )
    for option, path in (("--json", json_file), ("--junit", junit_file)):
        if path is not None:  # before the run: an unwritable report must not cost the run
            writable(path, option)
    if report_dir is not None:
        check_text(report_dir, "--report")
        if Path(report_dir).exists() and not Path(report_dir).is_dir():
            raise UsageError(f"--report {report_dir}: not a folder")
    check_text(tree_dir, "DIR")  # "" would quietly mean the current folder
    if not Path(tree_dir).is_dir():  # bad input is said before what this machine lacks
        megatron_tree(tree_dir)  # raises: not a Megatron-LM tree
    torch, failure = import_torch()
    if failure is not None:
        raise SourceError(f"torch is installed but does not import ({failure})")
    if torch is None:
        raise SourceError(f"torch is not installed; install the ROCm build: {ROCM_TORCH}")
    from megatron_rocm.envtools.smoke import catalog, report, runner

    checks = runner.select(catalog.load_checks(), only)
    if not full and not only:
        checks = [c for c in checks if c.group not in OPT_IN]
    ctx = runner.make_context(_tree_for(checks, tree_dir), steps)
    device = report.device_description()
    print(
        f"smoke: {len(checks)} checks on {device}, torch {torch.__version__}"
        + (f", tree {ctx.tree}" if ctx.tree else ", no tree")
        + (f", FAULT INJECTION {ctx.fault}" if ctx.fault else "")
    )
    result = runner.Report(device=device, torch=str(torch.__version__))
    result.checks = runner.run_checks(ctx, checks)
    try:
        report.write(result, json_file, junit_file)
        if report_dir is not None:
            from megatron_rocm.envtools.smoke import first_run

            figures = ctx.cache.get("figures", {})
            first_run.write(report_dir, result, first_run.environment(), figures)
            print(f"smoke: report in {Path(report_dir) / 'report.md'} and report.json")
    except OSError as e:
        raise SourceError(f"cannot write the smoke report: {e.strerror}: {e.filename}") from None
    counts = {
        s: sum(c.status == s for c in result.checks)
        for s in (runner.PASS, runner.FAIL, runner.SKIP)
    }
    print(f"smoke: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped")
    return EXIT_FAILED if result.failed else EXIT_OK


def add_parser(sub: argparse._SubParsersAction) -> None:
    """This verb's options, on ``main``'s parser."""
    p = sub.add_parser("smoke", help="run the GPU smoke suite on a patched tree")
    p.add_argument("dir", nargs="?", default=".", help="patched tree (default: .)")
    p.add_argument("--json", dest="json_file", default=None, metavar="FILE", help="JSON report")
    p.add_argument("--junit", dest="junit_file", default=None, metavar="FILE", help="JUnit XML")
    p.add_argument(
        "--only",
        nargs="+",
        action="extend",
        default=None,
        metavar="CHECK",
        help="run only these (repeatable)",
    )
    p.add_argument("--steps", type=int, default=30, help="training steps per model (default 30)")
    p.add_argument(
        "--full",
        action="store_true",
        help="every check, with the throughput probe (the first-run report's suite)",
    )
    p.add_argument(
        "--report",
        dest="report_dir",
        default=None,
        metavar="DIR",
        help="write report.json and report.md (versions, GPUs, every check) into DIR",
    )


def run(args: argparse.Namespace) -> int:
    return smoke(
        tree_dir=args.dir,
        json_file=args.json_file,
        junit_file=args.junit_file,
        only=args.only,
        steps=args.steps,
        full=args.full,
        report_dir=args.report_dir,
    )
