"""Markdown report: for job summaries and PR comments (GitHub renders <details>)."""

from __future__ import annotations

from megatron_rocm.patchtool import surface
from megatron_rocm.patchtool.matrix import ERROR, Matrix, Row, status_of
from megatron_rocm.patchtool.report import (
    STATUS,
    attention_groups,
    attention_hunks,
    ref_list,
    short_variant,
    slug,
    status_info,
    verdict,
)

MAX_FINDINGS = 200  # per list: a report must stay readable when a rule goes wild


def _cell(m: Matrix, ref: str, patch_id: str) -> str:
    row = next(r for r in m.rows if r.name == ref)
    p = row.cell(patch_id)
    if p is None:
        return ""
    status = status_of(p)
    kind, symbol, _ = status_info(status)
    text = f"{symbol} {status}"
    if kind in ("fuzz", "threeway", "fail"):
        text = f"{symbol} [{status}](#{slug(ref, patch_id)})"
    variant = short_variant(p.variant) if p.variant not in (None, "skip") else ""
    return f"{text} {variant}".strip()


def _row(m: Matrix, r: Row, ids: list[str]) -> str:
    name = r.name if r.report.ok else f"**{r.name}**"
    cells = " | ".join(_cell(m, r.name, i) for i in ids)
    return f"| {name} | {r.report.version} | {cells} |"


def _error_row(r: Row, n_patches: int) -> str:
    """A ref that was not checked: its reason in the first patch column, the rest empty."""
    _, symbol, _ = status_info(ERROR)
    rest = " |" * (n_patches - 1)
    return f"| **{r.name}** | — | {symbol} {ERROR}: {_esc(r.error)} |{rest}"


def _esc(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(m: Matrix) -> str:
    ids = m.patch_ids
    out = [
        "# megatron-rocm compatibility matrix",
        "",
        f"**{'✅' if m.ok else '❌'} {verdict(m)}** — {_esc(m.summary())}",
        "",
        f"Source `{m.source}` · series `{m.series.folder}` · generated {m.generated_at} · "
        + ", ".join(f"{k} {v:.2f}" for k, v in m.timings.items()),
        "",
        "Legend: " + " · ".join(f"{sym} {st}" for st, (_, sym, _) in STATUS.items()),
        "",
        "| ref | version | " + " | ".join(ids) + " |",
        "|---|---|" + "---|" * len(ids),
    ]
    for r in m.rows:
        out.append(_error_row(r, len(ids)) if r.error else _row(m, r, ids))
    out += [
        "",
        "## Patches",
        "",
        "| patch | upstream | first break | droppable at | reason |",
        "|---|---|---|---|---|",
    ]
    for p in m.series.patches:
        fb = m.first_break(p.id) or "—"
        drop = ", ".join(m.droppable(p.id)) or "—"
        out.append(f"| {p.id} | {p.upstream} | {fb} | {drop} | {_esc(p.reason)} |")
    groups = attention_groups(m)
    if groups:
        out += ["", "## Cells to look at", ""]
        for rows, p in groups:
            out += [
                "".join(f'<a id="{slug(r.name, p.patch_id)}"></a>' for r in rows),
                "",
                f"### {p.patch_id} ({p.variant or 'no variant'}): {status_of(p)} at "
                + ref_list([r.name for r in rows]),
                "",
            ]
            if p.error:
                out += [f"- {p.error}", ""]
            for h in attention_hunks(p):
                where = f"line {h.found_at}" if h.found_at else "nowhere"
                detail = f" — {_esc(h.detail)}" if h.detail else ""
                out += [
                    f"- `{h.path}` hunk {h.index} (recorded @{h.old_start}, found {where}): "
                    f"**{h.label.value}**{detail}",
                    "",
                    "<details><summary>hunk</summary>",
                    "",
                    "```diff",
                    h.text.rstrip("\n"),
                    "```",
                    "",
                    "</details>",
                    "",
                ]
    if m.surface is not None:
        out += _surface(m.surface)
    return "\n".join(out).rstrip() + "\n"


def _finding(f: surface.Finding) -> str:
    return f"- `{f.path}:{f.line}` {f.rule}: `{f.text[:140]}`"


def _surface(s: surface.SurfaceReport) -> list[str]:
    out = [
        "",
        "## New CUDA surface",
        "",
        "NVIDIA-only imports, tools and options in upstream; *uncovered* = no patch for that "
        "version names it and it is not an optional (try/except) import.",
        "",
        "| ref | covered | in patched file | guarded | uncovered | new | gone |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in s.refs:
        c = r.counts()
        new = f"**{len(r.new)}**" if r.new else "0"
        out.append(
            f"| {r.ref} | {c['covered']} | {c['in-patched-file']} | {c['guarded']} | "
            f"{c['uncovered']} | {new} | {r.gone} |"
        )
    for r in s.refs:
        if r.new:
            out += ["", f"### New at {r.ref} (since {r.previous}): {len(r.new)}", ""]
            out += [_finding(f) for f in r.new[:MAX_FINDINGS]]
    if s.refs:
        last = s.refs[-1]
        out += [
            "",
            f"<details><summary>All {len(last.uncovered)} uncovered findings at "
            f"{last.ref}</summary>",
            "",
        ]
        out += [_finding(f) for f in last.uncovered[:MAX_FINDINGS]]
        out += ["", "</details>"]
    return out
