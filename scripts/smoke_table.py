#!/usr/bin/env python3
"""Turn ``megatron-rocm smoke --json`` reports of several trees into one Markdown table.

    python scripts/smoke_table.py core_v0.12.0=smoke-0.12.json core_v0.16.0=smoke-0.16.json \
        core_v0.19.0=smoke-0.19.json main=smoke-main.json [--only training parallel]

Rows are checks (``--only`` prefixes; default: training and parallel), columns the labelled
reports. A cell is ``pass``, ``FAIL [n]`` or ``skip [n]``; note [n] below the table gives the
check's one-line detail (identical details share a note). The devices and torch builds of the
reports head the table, so a table always names the GPUs it was measured on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load(spec: str) -> tuple[str, dict]:
    label, sep, path = spec.partition("=")
    if not sep or not label or not path:
        raise ValueError(f"expected LABEL=REPORT.json, got {spec!r}")
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or "checks" not in data:
        raise ValueError(f"{path} is not a smoke JSON report (no 'checks')")
    return label, data


def table(reports: list[tuple[str, dict]], only: list[str]) -> str:
    def wanted(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in only)

    rows: list[str] = []
    for _, data in reports:
        rows += [c["name"] for c in data["checks"] if wanted(c["name"]) and c["name"] not in rows]
    notes: dict[str, int] = {}
    lines = [
        "| check | " + " | ".join(label for label, _ in reports) + " |",
        "|---|" + "---|" * len(reports),
    ]
    for name in rows:
        cells = []
        for _, data in reports:
            check = next((c for c in data["checks"] if c["name"] == name), None)
            if check is None:
                cells.append("-")
            elif check["status"] == "pass":
                cells.append("pass")
            else:
                n = notes.setdefault(check["detail"], len(notes) + 1)
                cells.append(f"{'FAIL' if check['status'] == 'fail' else 'skip'} [{n}]")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    head = [f"- {label}: {data['device']}, torch {data['torch']}" for label, data in reports]
    foot = [f"[{n}] {detail}" for detail, n in notes.items()]
    return "\n".join([*head, "", *lines, "", *foot]).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", metavar="LABEL=REPORT.json")
    p.add_argument("--only", nargs="+", default=["training", "parallel"])
    opts = p.parse_args(argv)
    try:
        reports = [load(spec) for spec in opts.reports]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(table(reports, opts.only))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
