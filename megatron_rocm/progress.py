"""What a person at the terminal sees while a run works, on stderr (JSON on stdout stays parseable).

Progress bars are redrawn in place on a terminal, a few plain lines otherwise; notes are one line.
Neutral ground: the patch tool and the CLI both use it.
"""

from __future__ import annotations

import sys
import time

import git


def note(text: str) -> None:
    """A remark for the person at the terminal (stderr, so JSON on stdout stays parseable)."""
    print(f"note: {text}", file=sys.stderr, flush=True)


class Bar:
    """A minimal text progress bar that stays quiet when stderr is not a terminal."""

    def __init__(self, label: str, total: float | None = None, quiet: bool = False) -> None:
        self.label = label
        self.total = total
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def update(self, done: float, total: float | None = None, note: str = "") -> None:
        if self.quiet:
            return
        total = total or self.total
        now = time.monotonic()
        final = bool(total) and done >= total
        if not self.tty and not final and now - self._last < 5.0:
            return
        self._last = now
        if total:
            frac = min(done / total, 1.0)
            filled = int(frac * 30)
            text = f"{self.label} [{'#' * filled}{'.' * (30 - filled)}] {frac:4.0%} {note}"
        else:
            text = f"{self.label} {int(done)} {note}"
        if self.tty:
            sys.stderr.write("\r\033[K" + text)
            if final:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def done(self, note: str = "done") -> None:
        if self.quiet:
            return
        if self.tty:
            sys.stderr.write("\r\033[K")
        sys.stderr.write(f"{self.label} {note}\n")
        sys.stderr.flush()


class CloneProgress(git.RemoteProgress):
    """GitPython clone/fetch progress -> one Bar per git stage."""

    STAGES = {
        git.RemoteProgress.COUNTING: "counting objects",
        git.RemoteProgress.COMPRESSING: "compressing",
        git.RemoteProgress.RECEIVING: "receiving objects",
        git.RemoteProgress.RESOLVING: "resolving deltas",
        git.RemoteProgress.CHECKING_OUT: "checking out",
    }

    def __init__(self, quiet: bool = False) -> None:
        super().__init__()
        self.quiet = quiet
        self._bars: dict[int, Bar] = {}

    def update(self, op_code: int, cur_count, max_count=None, message: str = "") -> None:  # noqa: ANN001
        stage = op_code & self.OP_MASK
        name = self.STAGES.get(stage)
        if name is None:
            return
        bar = self._bars.setdefault(stage, Bar(f"  {name}", quiet=self.quiet))
        bar.update(float(cur_count or 0), float(max_count) if max_count else None, message or "")
