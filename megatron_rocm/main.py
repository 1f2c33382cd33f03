"""The one argparse entry point: the top parser, then dispatch to ``commands/<verb>.py``.

Each verb's module declares its own options (``add_parser``) and maps the parsed namespace onto
its typed function (``run``), which takes keyword arguments and returns an exit code, so verbs
are trivial to call from tests.
``main`` returns the exit code (it never raises ``SystemExit``), prints argparse's errors as
one line, and guards stdout against a closed pipe.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys
from collections.abc import Sequence
from types import FrameType, ModuleType
from typing import NoReturn

from megatron_rocm import __version__
from megatron_rocm.error_handler import error_handler, interrupted_code, interrupted_line, say
from megatron_rocm.errors import EXIT_USAGE, Interrupted, clip
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
    prints_json = False  # has a --json flag printing a document on stdout (options.add_json)
    verbs: dict[str, _Parser] = {}  # the top parser's verbs (``build_parser``)

    def error(self, message: str) -> NoReturn:
        flat = clip(message.replace("\n", " "))
        verb = self.prog.removeprefix("megatron-rocm").strip()  # the top parser: no verb
        _Parser.last_error = f"error: {verb + ': ' if verb else ''}{flat} (see --help)"
        self.exit(EXIT_USAGE, f"megatron-rocm: {_Parser.last_error}\n")


# verb -> its module in commands/, which owns the verb's parser (``add_parser``) and maps the
# parsed arguments onto its typed function (``run``); the order is --help's
VERBS = {
    "apply": "apply",
    "check": "check",
    "export": "export",
    "list": "list_series",
    "matrix": "matrix",
    "install": "install",
    "smoke": "smoke",
    "doctor": "doctor",
}


def _command(verb: str) -> ModuleType:
    return importlib.import_module(f"megatron_rocm.commands.{VERBS[verb]}")


def build_parser() -> _Parser:
    parser = _Parser(
        prog="megatron-rocm",
        description="Port upstream Megatron-LM to AMD GPUs (ROCm) with a versioned patch series.",
        epilog=EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    parser.verbs = sub.choices

    for verb in VERBS:  # no command module imports torch at import time
        _command(verb).add_parser(sub)
    return parser


def _dispatch(args: argparse.Namespace) -> int:
    return _command(args.command).run(args)


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
