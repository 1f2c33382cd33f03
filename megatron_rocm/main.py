"""The one argparse entry point: parses, then dispatches to ``commands/<verb>.py``.

Only this module sees the ``argparse.Namespace``; every verb is a typed function that takes
keyword arguments and returns an exit code, so verbs are trivial to call from tests.
``main`` returns the exit code (it never raises ``SystemExit``), prints argparse's errors as
one line, and guards stdout against a closed pipe.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import NoReturn

from megatron_rocm import __version__
from megatron_rocm.error_handler import error_handler, interrupted_code, interrupted_line, say
from megatron_rocm.errors import EXIT_USAGE, Interrupted
from megatron_rocm.output import pipe_safe_stdout, print_json
from megatron_rocm.patchtool import interrupts

EXIT_CODES = (
    "Exit codes: 0 ok, 1 patches do not apply or checks failed, 2 usage or bad input, "
    "3 source or environment, 4 internal error (traceback in the log it names), 5 busy "
    "(another megatron-rocm run holds the lock, or another git process the index), 130/143 "
    "interrupted (SIGINT/SIGTERM)."
)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2), like every other error of the CLI."""

    last_error = ""  # the line the latest refusal printed (for --json's error document)
    prints_json = False  # has a --json flag that puts a document on stdout (``_add_json``)
    verbs: dict[str, _Parser] = {}  # the top parser's verbs (``build_parser``)

    def error(self, message: str) -> NoReturn:
        flat = message.replace("\n", " ")
        verb = self.prog.removeprefix("megatron-rocm").strip()  # the top parser: no verb
        _Parser.last_error = f"error: {verb + ': ' if verb else ''}{flat} (see --help)"
        self.exit(EXIT_USAGE, f"megatron-rocm: {_Parser.last_error}\n")


DEFAULT_SOURCE_HELP = (
    "where upstream comes from: a git URL (default: https://github.com/NVIDIA/Megatron-LM.git), "
    "a local clone or mirror path, or 'pypi' for a megatron-core sdist"
)


def _add_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", default=None, help=DEFAULT_SOURCE_HELP)


def _add_series(parser: argparse.ArgumentParser, version: bool = True) -> None:
    parser.add_argument(
        "--series",
        default=None,
        metavar="DIR",
        help="patch series folder (default: $MEGATRON_ROCM_SERIES or the bundled patches/)",
    )
    if not version:  # a verb that reads no tree has no version to override
        return
    parser.add_argument(
        "--megatron-version",
        default=None,
        metavar="X.Y.Z",
        help="override the version read from megatron/core/package_info.py",
    )


def _add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.prints_json = True


def build_parser() -> _Parser:
    parser = _Parser(
        prog="megatron-rocm",
        description="Port upstream Megatron-LM to AMD GPUs (ROCm) with a versioned patch series.",
        epilog=EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    parser.verbs = sub.choices

    p = sub.add_parser("apply", help="clone upstream and build a patched fork branch")
    _add_source(p)
    p.add_argument(
        "--ref",
        default=None,
        help="tag, branch or commit (default: newest release; with --source pypi, the newest "
        "this Python can install, as pip would pick)",
    )
    p.add_argument("--dest", default=None, help="checkout folder (default: ./Megatron-LM)")
    p.add_argument("--branch", default=None, help="fork branch name (default: rocm/<ref>)")
    p.add_argument(
        "--3way", dest="three_way", action="store_true", help="allow hunks that need a 3-way merge"
    )
    _add_series(p)
    _add_json(p)

    p = sub.add_parser("check", help="check the series against refs without a checkout")
    _add_source(p)
    p.add_argument("--ref", nargs="+", default=None, help="refs to check (default: newest release)")
    _add_series(p)
    _add_json(p)

    p = sub.add_parser("export", help="turn a patched fork's commits back into diff files")
    p.add_argument("--repo", default=".", help="the patched fork (default: current folder)")
    p.add_argument(
        "--new-variant",
        action="store_true",
        help="for each patch that changed, start a new variant at this tree's version instead "
        "of updating the matching one (unchanged patches keep theirs)",
    )
    _add_series(p)
    _add_json(p)

    p = sub.add_parser("list", help="show the series, its variants and version ranges")
    _add_series(p, version=False)
    _add_json(p)

    p = sub.add_parser("matrix", help="check the series against every upstream tag")
    _add_source(p)
    p.add_argument(
        "--tags",
        nargs="+",
        default=None,
        metavar="PATTERN",
        help="glob patterns of tags/branches, replacing the default set (release tags >= "
        "core_v0.12.0, main, dev and the --refs refs); tags/NAME or heads/NAME picks one of a "
        "name that is both",
    )
    p.add_argument(
        "--refs",
        nargs="*",
        default=None,
        metavar="PATTERN",
        help="branch/PR refs to watch besides the default set (default: 'pull-request/*', "
        "upstream's copies of open pull requests; give none to watch none); their breaks "
        "are reported, never counted as the series' failure",
    )
    p.add_argument(
        "--refs-file",
        default=None,
        metavar="FILE",
        help="more --refs patterns, one per line ('#' comments)",
    )
    p.add_argument(
        "--format",
        choices=["md", "html", "json", "junit"],
        action="append",
        default=None,
        help="report format; repeat for several (default: md)",
    )
    p.add_argument("--out", default=None, help="report file, or folder when several formats")
    p.add_argument("--no-scan", action="store_true", help="skip the new-CUDA-surface scan")
    _add_series(p)

    p = sub.add_parser("install", help="pip-install a patched tree (never touches torch)")
    p.add_argument("dir", nargs="?", default=".", help="patched tree (default: .)")
    p.add_argument("--no-editable", action="store_true", help="a regular, not editable, install")
    p.add_argument("--dry-run", action="store_true", help="print the steps, change nothing")
    _add_json(p)

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

    p = sub.add_parser("doctor", help="report the ROCm/CUDA environment and flag problems")
    _add_json(p)
    return parser


def _dispatch(args: argparse.Namespace) -> int:
    # Imports are local so that `megatron-rocm apply` never imports torch-using modules.
    if args.command == "apply":
        from megatron_rocm.commands.apply import apply

        return apply(
            source=args.source,
            ref=args.ref,
            dest=args.dest,
            branch=args.branch,
            three_way=args.three_way,
            series_dir=args.series,
            version_override=args.megatron_version,
            as_json=args.json,
        )
    if args.command == "check":
        from megatron_rocm.commands.check import check

        return check(
            source=args.source,
            refs=args.ref,
            series_dir=args.series,
            version_override=args.megatron_version,
            as_json=args.json,
        )
    if args.command == "export":
        from megatron_rocm.commands.export import export

        return export(
            repo_dir=args.repo,
            new_variant=args.new_variant,
            series_dir=args.series,
            version_override=args.megatron_version,
            as_json=args.json,
        )
    if args.command == "list":
        from megatron_rocm.commands.list_series import list_series

        return list_series(series_dir=args.series, as_json=args.json)
    if args.command == "matrix":
        from megatron_rocm.commands.matrix import matrix

        return matrix(
            source=args.source,
            tag_patterns=args.tags,
            watch=args.refs,
            watch_file=args.refs_file,
            formats=args.format or ["md"],
            out=args.out,
            scan=not args.no_scan,
            series_dir=args.series,
            version_override=args.megatron_version,
        )
    if args.command == "install":
        from megatron_rocm.commands.install import install

        return install(
            tree_dir=args.dir,
            editable=not args.no_editable,
            dry_run=args.dry_run,
            as_json=args.json,
        )
    if args.command == "smoke":
        from megatron_rocm.commands.smoke import smoke

        return smoke(
            tree_dir=args.dir,
            json_file=args.json_file,
            junit_file=args.junit_file,
            only=args.only,
            steps=args.steps,
            full=args.full,
            report_dir=args.report_dir,
        )
    if args.command == "doctor":
        from megatron_rocm.commands.doctor import doctor

        return doctor(as_json=args.json)
    raise AssertionError(f"unhandled command {args.command}")


def _wants_json(parser: _Parser, argv: Sequence[str]) -> bool:
    """Whether a command line that argparse refused asked for a JSON document on stdout: its
    verb's ``--json`` flag (``smoke --json FILE`` names a report file instead), or ``matrix``
    with only ``--format json`` and no ``--out``, as ``_prints_json`` decides for a parsed one.
    The words are read as argparse would take them, both ``--opt value`` and ``--opt=value``."""
    verb = next((a for a in argv if not a.startswith("-")), "")
    if verb == "matrix":
        formats = _option_values(argv, "--format")
        return formats == ["json"] and not _option_values(argv, "--out")
    sub = parser.verbs.get(verb)
    return (
        sub is not None
        and sub.prints_json
        and any(w == "--json" or w.startswith("--json=") for w in argv)  # --json=1 is refused
    )


def _option_values(argv: Sequence[str], option: str) -> list[str]:
    """Every value given to ``option`` in ``argv`` (``--opt value`` or ``--opt=value``)."""
    values = []
    for index, word in enumerate(argv):
        if word == option and index + 1 < len(argv):
            values.append(argv[index + 1])
        elif word.startswith(option + "="):
            values.append(word.split("=", 1)[1])
    return values


def _prints_json(args: argparse.Namespace) -> bool:
    """Whether stdout is to carry one JSON document, so that an error must be one too: the
    verb's ``--json``, or ``matrix --format json`` with no ``--out`` (the report on stdout)."""
    if args.command == "matrix":
        return args.format == ["json"] and args.out is None
    return getattr(args, "json", False) is True


def _raise_interrupted(signum: int, _frame: FrameType | None) -> None:
    raise Interrupted(signum)


def _stops_like_ctrl_c() -> contextlib.AbstractContextManager[None]:
    """SIGTERM and SIGHUP end every verb as Ctrl-C does: ``Interrupted`` (a
    ``KeyboardInterrupt``) runs the same cleanup, says one line and exits ``128 + signum``;
    left at their default, they killed check, matrix or export with no word and their scratch
    behind. One that is ignored (``nohup``) stays ignored; apply's transaction installs its
    own while it runs."""
    return interrupts.handling(
        (signal.SIGTERM, signal.SIGHUP), _raise_interrupted, lambda h: h == signal.SIG_DFL
    )


def main(argv: Sequence[str] | None = None) -> int:
    with pipe_safe_stdout():
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help, --version, or a usage error already printed
            code = e.code if isinstance(e.code, int) else EXIT_USAGE
            words = list(sys.argv[1:] if argv is None else argv)
            if code == EXIT_USAGE and _wants_json(parser, words):
                print_json({"ok": False, "error": _Parser.last_error, "exit_code": code})
            return code
        if args.command is None:
            print("megatron-rocm: error: no command given (see --help)", file=sys.stderr)
            return EXIT_USAGE
        try:
            with (
                _stops_like_ctrl_c(),
                error_handler(as_json=_prints_json(args)) as result,
            ):
                result.code = _dispatch(args)
        except KeyboardInterrupt as e:  # a signal that landed while the handler was finishing
            say(interrupted_line(e))
            return interrupted_code(e)
        return result.code


def _tolerant_output() -> None:
    """A path of bytes that are not UTF-8 (Python holds them as surrogates) is printed escaped
    rather than ending the command with an internal error, where the locale makes the
    console's encoding strict (``en_US.UTF-8``; ``C.UTF-8`` already escapes)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None and stream.errors == "strict":
            with contextlib.suppress(ValueError, OSError):
                reconfigure(errors="backslashreplace")


def cli() -> int:
    """The console command: ``main``, then no traceback from a Ctrl-C that lands once it is
    done. The exit code is decided by then, so a late SIGINT is ignored for the exit itself
    (SIGTERM and SIGHUP end the process without a traceback anyway); one that lands in
    ``main``'s own last lines is said in one line, as any interrupt is."""
    _tolerant_output()
    try:
        code = main()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except KeyboardInterrupt as e:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        say(interrupted_line(e))
        code = interrupted_code(e)
    return code


if __name__ == "__main__":
    raise SystemExit(cli())
