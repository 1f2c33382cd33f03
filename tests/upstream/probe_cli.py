"""The command line every single-process upstream probe shares: ``--tree`` and ``--out``, and
the probe's result (or the error it raised, with its trace) written to ``--out`` as JSON, so
the test reports a probe's failure instead of a missing file."""

from __future__ import annotations

import argparse
import json
import traceback
from collections.abc import Callable
from pathlib import Path


def main(run: Callable[[argparse.Namespace], dict]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    try:
        result = run(args)
    except Exception as exc:  # the test reports it with the trace
        result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    Path(args.out).write_text(json.dumps(result))
    return 0
