"""Turning one run's results into the per-file JSON and markdown, and two runs (unpatched,
patched) into the before/after table that docs/upstream-tests.md shows.

The selection a pass rate is taken over: every collected test of the selected files, less the
deselected ones (FP8 by name, upstream CI's marker filter) and less the tests that need more
GPUs than the run had (``needs_gpus`` in either run). Skipped and not-run tests stay in it, so
a skip never raises the rate.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Any

from .results import _BAD, OUTCOMES, Result, file_of

SHORT = {"passed": "P", "failed": "F", "error": "E", "skipped": "S"}


def run_document(
    meta: dict[str, Any],
    results: dict[str, Result],
    collect_errors: dict[str, str],
    deselected: dict[str, str],
) -> dict[str, Any]:
    """The JSON a run writes: metadata, per-file counts, every test's outcome."""
    files: dict[str, Counter] = defaultdict(Counter)
    for nodeid, res in results.items():
        files[file_of(nodeid)][res.outcome] += 1
    for collector in collect_errors:  # a module, or a class in one ("file.py::TestX")
        files[file_of(collector)]["error"] += 1
    for nodeid, why in deselected.items():
        files[file_of(nodeid)][f"deselected_{why}"] += 1
    totals: Counter = Counter()
    for counts in files.values():
        totals.update(counts)
    return {
        **meta,
        "files": {f: {k: files[f][k] for k in sorted(files[f])} for f in sorted(files)},
        "totals": {k: totals[k] for k in sorted(totals)},
        "collect_errors": dict(sorted(collect_errors.items())),
        "deselected": dict(sorted(deselected.items())),
        "tests": {k: results[k].to_json() for k in sorted(results)},
    }


def normalize(message: str) -> str:
    """A failure's cause with the incidental parts (addresses, numbers, tmp paths) blanked, so
    the same cause from many tests is one group."""
    text = re.sub(r"0x[0-9a-fA-F]+", "0x…", message)
    text = re.sub(r"/tmp/\S+", "/tmp/…", text)
    text = re.sub(r"(?<![\w.])\d+(?:\.\d+)?(?:e[-+]?\d+)?(?!\w)", "N", text)
    return text[:200]


def causes(tests: dict[str, dict], outcomes: tuple[str, ...]) -> list[tuple[str, int, Counter]]:
    """(cause, count, per-file counts) for the tests with these outcomes, biggest first."""
    groups: dict[str, Counter] = defaultdict(Counter)
    for nodeid, res in tests.items():
        if res["outcome"] in outcomes:
            groups[normalize(res.get("message", "") or "(no message)")][file_of(nodeid)] += 1
    ranked = [(cause, sum(c.values()), c) for cause, c in groups.items()]
    return sorted(ranked, key=lambda g: (-g[1], g[0]))


def _cause_lines(groups: list[tuple[str, int, Counter]]) -> list[str]:
    lines = []
    for cause, count, per_file in groups:
        where = ", ".join(f"{f.split('/')[-1]} ({n})" for f, n in per_file.most_common(4))
        more = f", +{len(per_file) - 4} files" if len(per_file) > 4 else ""
        lines.append(f"- {count} × `{cause}` — {where}{more}")
    return lines


def run_markdown(doc: dict[str, Any]) -> str:
    cols = ("passed", "failed", "error", "skipped", "not_run", "needs_gpus")
    head = f"| file | {' | '.join(cols)} | deselected |"
    rows = [head, "|" + "---|" * (len(cols) + 2)]
    for path, counts in doc["files"].items():
        desel = sum(v for k, v in counts.items() if k.startswith("deselected_"))
        cells = " | ".join(str(counts.get(c, 0)) for c in cols)
        rows.append(f"| {path.removeprefix('tests/unit_tests/')} | {cells} | {desel} |")
    t = doc["totals"]
    desel = sum(v for k, v in t.items() if k.startswith("deselected_"))
    rows.append(f"| **total** | {' | '.join(str(t.get(c, 0)) for c in cols)} | {desel} |")
    what = ", ".join(
        x
        for x in (
            doc.get("describe"),
            f"{doc['patches']} patches" if "patches" in doc else None,
            f"{doc.get('nproc')} GPU(s)",
            doc.get("device"),
        )
        if x
    )
    title = f"## {doc.get('name', 'run')} ({what})"
    complete = "complete" if doc.get("complete") else "INCOMPLETE (budget): see not_run"
    if doc.get("collect_only"):
        complete = "listing only (--collect-only): nothing was run"
    out = [title, "", f"{complete}; wall {doc.get('wall_s', 0):.0f} s", "", *rows, ""]
    bad = causes(doc["tests"], _BAD)
    if bad or doc["collect_errors"]:
        out += ["Failures and errors by cause:", ""]
        out += [f"- collection error in {p}: `{m}`" for p, m in doc["collect_errors"].items()]
        out += _cause_lines(bad) + [""]
    return "\n".join(out)


# --- before / after ------------------------------------------------------------------------


def _expand(doc: dict[str, Any], other: dict[str, Any]) -> dict[str, dict]:
    """A run's tests, where a file that did not import stands for the tests the other run
    collected from it (each an error with the import's message): both sides count alike."""
    tests = dict(doc["tests"])
    for collector, msg in doc["collect_errors"].items():
        for nodeid in other["tests"]:
            inside = nodeid == collector or nodeid.startswith(collector + "::")
            if inside and nodeid not in tests:
                tests[nodeid] = {"outcome": "error", "message": f"collection: {msg}"}
    return tests


def compare(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    b, a = _expand(before, after), _expand(after, before)
    outside = {
        k
        for k in set(a) | set(b)
        if "needs_gpus" in (a.get(k, {}).get("outcome"), b.get(k, {}).get("outcome"))
    }
    selection = sorted((set(a) | set(b)) - outside)
    missing = {"outcome": "not_run"}
    per_file: dict[str, dict[str, Counter]] = defaultdict(
        lambda: {"before": Counter(), "after": Counter()}
    )
    for nodeid in selection:
        per_file[file_of(nodeid)]["before"][b.get(nodeid, missing)["outcome"]] += 1
        per_file[file_of(nodeid)]["after"][a.get(nodeid, missing)["outcome"]] += 1
    totals = {s: sum((f[s] for f in per_file.values()), Counter()) for s in ("before", "after")}
    n = len(selection)
    return {
        "before": {k: before.get(k) for k in ("name", "describe", "patches", "complete")},
        "after": {k: after.get(k) for k in ("name", "describe", "patches", "complete")},
        "selection": n,
        "needs_more_gpus": len(outside),
        "pass_rate_before": round(totals["before"]["passed"] / n, 4) if n else None,
        "pass_rate_after": round(totals["after"]["passed"] / n, 4) if n else None,
        "files": {f: {s: dict(c) for s, c in v.items()} for f, v in sorted(per_file.items())},
        "totals": {s: dict(c) for s, c in totals.items()},
        "remaining": [
            {"cause": c, "count": k, "files": dict(f)}
            for c, k, f in causes({t: a[t] for t in selection if t in a}, _BAD + ("not_run",))
        ],
        "skips": [
            {"cause": c, "count": k}
            for c, k, _ in causes({t: a[t] for t in selection if t in a}, ("skipped",))
        ],
    }


def _cell(c: dict[str, int]) -> str:
    text = " / ".join(str(c.get(o, 0)) for o in SHORT)
    return text + (f" (+{c['not_run']} not run)" if c.get("not_run") else "")


def compare_markdown(cmp: dict[str, Any], nproc: int | None = None) -> str:
    gpus = f"> {nproc} GPUs" if nproc else "more GPUs than the run had"
    rows = [
        "| file | tests | before P / F / E / S | after P / F / E / S | Δ passed |",
        "|---|---|---|---|---|",
    ]
    for path, side in cmp["files"].items():
        n = sum(side["after"].values())
        delta = side["after"].get("passed", 0) - side["before"].get("passed", 0)
        rows.append(
            f"| {path.removeprefix('tests/unit_tests/')} | {n} | {_cell(side['before'])} | {_cell(side['after'])} | {delta:+d} |"
        )
    t = cmp["totals"]
    delta = t["after"].get("passed", 0) - t["before"].get("passed", 0)
    rows.append(
        f"| **total** | {cmp['selection']} | {_cell(t['before'])} | {_cell(t['after'])} | {delta:+d} |"
    )

    def rate(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    b, a = cmp["before"], cmp["after"]
    out = [
        f"Before: {b['name']} ({b['describe']}, {b['patches']} patches); after: {a['name']} "
        f"({a['describe']}, {a['patches']} patches).",
        "",
        f"Pass rate over the selection ({cmp['selection']} tests): before {rate(cmp['pass_rate_before'])}, "
        f"after **{rate(cmp['pass_rate_after'])}**. Not in the selection: {cmp['needs_more_gpus']} tests "
        f"that need {gpus}.",
        "",
    ]
    if not (b.get("complete") and a.get("complete")):
        out += [
            "**A run is incomplete** (wall-clock budget): its unrun tests count as not passed.",
            "",
        ]
    out += rows + ["", "Remaining failures after, by cause:", ""]
    out += _cause_lines(
        [(r["cause"], r["count"], Counter(r["files"])) for r in cmp["remaining"]]
    ) or ["- none"]
    if cmp["skips"]:
        out += ["", "Skipped after, by reason:", ""]
        out += [f"- {s['count']} × `{s['cause']}`" for s in cmp["skips"]]
    return "\n".join(out) + "\n"


__all__ = ["OUTCOMES", "run_document", "run_markdown", "compare", "compare_markdown", "normalize"]
