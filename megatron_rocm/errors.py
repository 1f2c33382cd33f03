"""The one error family the CLI turns into a single line and a documented exit code.

Exit codes: 0 ok · 1 patches do not apply / checks failed · 2 usage · 3 source or environment.
Anything that is not a ``FatalError`` is a bug: one line plus the path of a log with the traceback.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_ENVIRONMENT = 3
EXIT_INTERRUPTED = 130


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
