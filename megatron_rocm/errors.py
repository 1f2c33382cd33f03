"""The one error family the CLI turns into a single line and a documented exit code.

Exit codes (docs/cli.md, ``megatron-rocm --help``), each with one meaning:

- 0 ok
- 1 patches do not apply / checks failed
- 2 usage or bad input (bad option values, ref or branch names, a malformed series, a dirty
  fork), always reported before anything is cloned or changed
- 3 source or environment (unreachable source, missing git, unwritable paths, wrong Python, a
  failed install step)
- 4 internal error (a bug: one line here, the traceback in the log it names)
- 5 busy: another megatron-rocm process holds the lock on that destination or series folder;
  nothing changed
- 130 / 143 interrupted by SIGINT / SIGTERM (128 + the signal number)
"""

from __future__ import annotations

import re
import signal

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_ENVIRONMENT = 3
EXIT_INTERNAL = 4
EXIT_BUSY = 5
EXIT_INTERRUPTED = 128 + signal.SIGINT

SHOWN_CHARS = 80  # how much of an overlong value a message shows
_OVERLONG = re.compile(rf"\S{{{2 * SHOWN_CHARS + 1},}}")


def clip(line: str) -> str:
    """``line`` with every overlong word (a 5,000-character ``--ref``, a pasted blob) cut to
    its first ``SHOWN_CHARS`` characters and "…": every error line passes through here, so a
    user's value never floods the terminal. Paths and URLs of ordinary length stay whole."""

    def cut(m: re.Match[str]) -> str:
        word = m.group()
        end = word[-1] if word[-1] in "'\")]:;,." else ""
        return f"{word[:SHOWN_CHARS]}…{end}"

    return _OVERLONG.sub(cut, line)


class FatalError(Exception):
    """An expected failure: the message is shown as one line, the process exits with ``code``."""

    code = EXIT_FAILED


class PatchFailed(FatalError):
    """A patch does not apply (conflict, missing file, ...)."""

    code = EXIT_FAILED


class UsageError(FatalError):
    """Bad arguments or bad input files (malformed series, overlapping ranges, corrupt diff)."""

    code = EXIT_USAGE


class SourceError(FatalError):
    """The upstream source or the environment is unusable (unreachable, not a repo, no git...)."""

    code = EXIT_ENVIRONMENT


class Busy(FatalError):
    """Another megatron-rocm process holds the lock, or another git process the index: retry
    once it is done (nothing changed)."""

    code = EXIT_BUSY


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP: exit ``128 + signum``; the message says what state remains.

    A ``KeyboardInterrupt`` so that code which already cleans up on Ctrl-C also cleans up on
    SIGTERM, and so that ``except Exception`` never swallows it.
    """

    def __init__(self, signum: int = signal.SIGINT, message: str = "interrupted") -> None:
        super().__init__(message)
        self.signum = signum
        self.message = message

    @property
    def code(self) -> int:
        return 128 + int(self.signum)
