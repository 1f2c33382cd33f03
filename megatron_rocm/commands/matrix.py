"""``megatron-rocm matrix``: check the series against every selected upstream ref, report it.

Exit codes: 0 every selected ref applies, 1 at least one breaks, 2 usage (e.g. a --tags
pattern that matches nothing, several formats with --out naming a file), 3 source problems,
also a selected ref that could not be checked at all (not a Megatron-LM tree, a patched
fork's commit) when no ref breaks: the report is written first, with an error row for it.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path

from megatron_rocm.commands import options
from megatron_rocm.errors import (
    EXIT_ENVIRONMENT,
    EXIT_FAILED,
    EXIT_OK,
    SourceError,
    UsageError,
)
from megatron_rocm.output import note, writable, write_file
from megatron_rocm.patchtool import diffio, gitcmd, pypi, refnames, upstream
from megatron_rocm.patchtool.matrix import MIN_RELEASE, Matrix, RefSpec, build_matrix, select_refs
from megatron_rocm.patchtool.report import FORMATS, render, write_reports
from megatron_rocm.patchtool.series import load_series, parse_version


def _pypi_refs(patterns: list[str] | None) -> tuple[Path, list[RefSpec]]:
    """PyPI sdists: one tag per release >= 0.12.0 (no branches exist there)."""
    names = [
        f"core_v{v}" for v in pypi.release_versions() if parse_version(v).release[:3] >= MIN_RELEASE
    ]
    if patterns:
        for pat in patterns:
            if not any(fnmatch.fnmatchcase(n, pat) for n in names):
                raise UsageError(f"--tags {pat!r} matches no megatron-core release on PyPI")
        names = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    repo = pypi.sdist_repo(names)
    refs = select_refs(repo, names)
    return repo, refs


def _single_file(formats: list[str], out: str) -> bool:
    return len(set(formats)) == 1 and not (Path(out).is_dir() or out.endswith(("/", "\\")))


def _check_out(formats: list[str], out: str) -> None:
    """Fail before the work when --out cannot take what will be written there.

    Why here and not in ``writable``: an existing regular file passes that check (it can be
    overwritten), but several formats (or a trailing ``/``) need a folder to hold their
    files, and ``mkdir`` would only say "File exists" after the whole run.
    """
    single = _single_file(formats, out)
    target = Path(out).expanduser()
    if not single and target.exists() and not target.is_dir():
        if len(set(formats)) > 1:
            raise UsageError(f"--out {out} is a file; several --format values need a folder")
        raise UsageError(f"--out {out} ends with '/' (a folder) but {target} is a file")
    writable(out, "--out", folder=not single)


def exit_code(m: Matrix) -> int:
    """1 when a checked ref breaks (the series' problem, what CI acts on); else 3 when a ref
    could not be checked at all (the source's problem: a branch that is not Megatron-LM, a
    fork's own commit), so a run that checked nothing never passes; else 0."""
    if m.broken_rows:
        return EXIT_FAILED
    if m.error_rows:
        return EXIT_ENVIRONMENT
    return EXIT_OK


def _note_errors(m: Matrix) -> None:
    """One line on stderr naming the unchecked refs, so exit 3 never goes unexplained."""
    rows = m.error_rows
    if rows:
        more = f" (+{len(rows) - 1} more; see the report)" if len(rows) > 1 else ""
        note(f"{len(rows)} ref(s) not checked: {rows[0].name}: {rows[0].error}{more}")


def _output(m: Matrix, formats: list[str], out: str | None) -> None:
    formats = list(dict.fromkeys(formats))
    if out is None:
        if len(formats) > 1:
            raise UsageError("several --format values need --out DIR")
        sys.stdout.write(render(m, formats[0]))
        return
    target = Path(out)
    if _single_file(formats, out):
        write_file(target, render(m, formats[0]), "--out")
        paths = [target]
    else:
        try:
            paths = write_reports(m, formats, target)
        except OSError as e:
            raise SourceError(f"cannot write --out {out}: {e.strerror}") from None
    for p in paths:
        print(f"wrote {p}")
    print(m.summary())


def read_watch(patterns: list[str] | None, watch_file: str | None) -> list[str] | None:
    """``--refs`` plus ``--refs-file``'s lines; None (the default list) when neither is given.
    Every pattern is checked like ``--tags`` before any clone."""
    if watch_file is None:
        found = patterns
    else:
        path = refnames.user_path(refnames.check_text(watch_file, "--refs-file"), "--refs-file")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--refs-file {watch_file}: cannot read it ({e})") from None
        lines = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
        found = list(patterns or []) + [ln for ln in lines if ln]
    for pattern in found or []:
        refnames.check_pattern(pattern, "--refs")
    return found


def matrix(
    *,
    source: str | None,
    tag_patterns: list[str] | None,
    formats: list[str],
    watch: list[str] | None = None,
    watch_file: str | None = None,
    out: str | None,
    scan: bool,
    series_dir: str | None,
    version_override: str | None,
) -> int:
    series = load_series(series_dir)  # fail fast on a broken series, before any clone
    diffio.read_all(series)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise UsageError(f"unknown report format {unknown[0]!r} (choose from {', '.join(FORMATS)})")
    if out is None and len(set(formats)) > 1:
        raise UsageError("several --format values need --out DIR")
    for pattern in tag_patterns or []:
        refnames.check_pattern(pattern)
    watch = read_watch(watch, watch_file)
    if out is not None:  # before the work: an unwritable --out must not cost a whole run
        _check_out(formats, out)
    if version_override is not None:
        parse_version(version_override)
    src = upstream.classify(source)
    if src.kind == "pypi":
        repo, refs = _pypi_refs(tag_patterns)
    else:
        repo = upstream.reading_repo(src, None, quiet=out is None)
        refs = select_refs(repo, tag_patterns, watch)
        if (
            scan
            and gitcmd.git_text("config", "--get", "remote.origin.promisor", cwd=repo, check=False)
            == "true"
        ):
            print(
                "note: the source is a blobless clone; the CUDA-surface scan downloads the "
                "blobs it reads (use a full mirror or --no-scan for speed)",
                file=sys.stderr,
            )
    m = build_matrix(
        repo, refs, series, source=src.label, version_override=version_override, scan=scan
    )
    _output(m, formats, out)
    _note_errors(m)
    return exit_code(m)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """This verb's options, on ``main``'s parser."""
    p = sub.add_parser(
        "matrix", help="check the series against releases, main, dev and pull-request refs"
    )
    options.add_source(p)
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
    options.add_series(p)


def run(args: argparse.Namespace) -> int:
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
