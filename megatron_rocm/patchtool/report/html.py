"""Self-contained HTML report: one page a person reads at a glance (no scripts, no assets).

Layout, top to bottom: a verdict banner with the summary line; the ref x patch grid coloured
by status (failing cells link to their hunks); the per-patch table (first break, droppable);
the failing hunks in <details>; the new-CUDA-surface scan.
"""

from __future__ import annotations

from collections import defaultdict
from html import escape

from megatron_rocm.patchtool import surface
from megatron_rocm.patchtool.matrix import ERROR, Matrix, Row, status_of
from megatron_rocm.patchtool.report import (
    ATTENTION_KINDS,
    STATUS,
    attention_groups,
    attention_hunks,
    ref_list,
    short_variant,
    slug,
    status_info,
    verdict,
)
from megatron_rocm.patchtool.results import PatchResult

MAX_FINDINGS = 300

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#1d232a}
h1{font-size:22px;margin:0 0 12px}
h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}
.banner{padding:12px 16px;border-radius:8px;font-size:15px;margin-bottom:8px}
.banner.ok{background:#dff3e4;border:1px solid #4ca86a}
.banner.bad{background:#fde2e1;border:1px solid #d1453b}
.banner b{font-size:17px;margin-right:8px}
.badge{display:inline-block;color:#fff;font-weight:700;border-radius:4px;padding:1px 8px;
  margin-right:10px;font-size:14px}.banner.ok .badge{background:#2f8a4c}
.banner.bad .badge{background:#c0362c}
.meta{color:#57606a;font-size:12px;margin-bottom:14px}
.legend span{display:inline-block;margin:0 6px 6px 0;padding:2px 8px;border-radius:4px;
  font-size:12px;border:1px solid rgba(0,0,0,.08)}
table{border-collapse:collapse;margin:6px 0}
th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa;font-weight:600}
table.grid th.patch{max-width:130px;white-space:normal;font-size:12px}
table.grid td.cell{min-width:86px;font-size:13px;white-space:nowrap}
table.grid td.cell small,table.grid th small{color:#57606a;font-weight:400;margin-left:4px}
table.grid th.ref{white-space:nowrap;position:sticky;left:0}
table.grid tr.broken th.ref{box-shadow:inset 4px 0 #d1453b}
td.cell a{color:inherit;font-weight:700}
a.pill{text-decoration:none;color:inherit}
.ok{background:#dff3e4}.drift{background:#eef7d4}.fuzz{background:#fff3bf}
.upstream{background:#dbe9ff}.skip{background:#f0f1f3;color:#6e7781}
.threeway{background:#ffe1c2}.fail{background:#fdd4d2}
.pill{display:inline-block;padding:0 6px;border-radius:10px;font-size:12px}
.num-bad{color:#b42318;font-weight:700}
details{margin:6px 0 10px;border:1px solid #d0d7de;border-radius:6px;padding:4px 10px}
details[open]{padding-bottom:8px}
summary{cursor:pointer;font-weight:600}
pre{background:#f6f8fa;padding:8px;overflow-x:auto;font-size:12px;line-height:1.35;margin:6px 0}
pre span{display:block;white-space:pre}
pre .add{color:#116329;background:#e6ffec}pre .del{color:#82071e;background:#ffebe9}
pre .hdr{color:#0550ae}
code{font-size:12px}
ul.findings{margin:4px 0;padding-left:18px}ul.findings li{margin:2px 0}
.rule{display:inline-block;min-width:150px;color:#57606a;font-size:12px}
"""


def _e(text: object) -> str:
    return escape(str(text), quote=True)


def _cell(row: Row, p: PatchResult | None) -> str:
    if p is None:
        return '<td class="cell skip">—</td>'
    status = status_of(p)
    kind, _, meaning = status_info(status)
    variant = short_variant(p.variant) if p.variant not in (None, "skip") else ""
    label = _e(status)
    if kind in ATTENTION_KINDS:
        label = f'<a href="#{_e(slug(row.name, p.patch_id))}">{label}</a>'
    small = f"<small>{_e(variant)}</small>" if variant else ""
    return f'<td class="cell {kind}" title="{_e(p.patch_id)}: {_e(meaning)}">{label}{small}</td>'


def _cells(m: Matrix, row: Row) -> list[str]:
    """The patch columns of a row; a ref that was not checked gets one cell saying why."""
    if not row.error:
        return [_cell(row, row.cell(i)) for i in m.patch_ids]
    kind, _, _ = status_info(ERROR)
    return [
        f'<td class="cell {kind}" colspan="{max(1, len(m.patch_ids))}">'
        f"<b>{ERROR}</b>: {_e(row.error)}</td>"
    ]


def _grid(m: Matrix) -> list[str]:
    out = ['<table class="grid"><thead><tr><th>ref <small>version</small></th>']
    out += [f'<th class="patch">{_e(i)}</th>' for i in m.patch_ids]
    out.append("</tr></thead><tbody>")
    for r in m.rows:
        cls = "" if r.report.ok and not r.error else ' class="broken"'
        out.append(
            f'<tr{cls}><th class="ref" title="{_e(r.report.commit)}">{_e(r.name)} '
            f"<small>{_e(r.report.version or '—')}</small></th>"
        )
        out += _cells(m, r)
        out.append("</tr>")
    out.append("</tbody></table>")
    return out


def _patches(m: Matrix) -> list[str]:
    out = [
        "<table><thead><tr><th>patch</th><th>upstream</th><th>first break</th>"
        "<th>droppable at</th><th>reason</th></tr></thead><tbody>"
    ]
    for p in m.series.patches:
        fb = m.first_break(p.id)
        drop = m.droppable(p.id)
        fb_html = f'<a class="pill fail" href="#{_e(slug(fb, p.id))}">{_e(fb)}</a>' if fb else "—"
        drop_html = (
            (
                f'<span class="pill upstream">{_e(drop[0])}</span>'
                + (f" +{len(drop) - 1} more" if len(drop) > 1 else "")
            )
            if drop
            else "—"
        )
        out.append(
            f"<tr><td><b>{_e(p.id)}</b></td><td>{_e(p.upstream)}</td><td>{fb_html}</td>"
            f"<td>{drop_html}</td><td>{_e(p.reason)}</td></tr>"
        )
    out.append("</tbody></table>")
    return out


def _diff(text: str) -> str:
    """One block per line (coloured +/-/@@), so no blank lines appear between them."""
    rows = []
    for line in text.rstrip("\n").split("\n"):
        cls = {"+": "add", "-": "del", "@": "hdr"}.get(line[:1], "ctx")
        rows.append(f'<span class="{cls}">{_e(line) or " "}</span>')
    return "<pre>" + "".join(rows) + "</pre>"


def _attention(m: Matrix) -> list[str]:
    groups = attention_groups(m)
    if not groups:
        return []
    out = [
        "<h2>Cells to look at</h2>",
        "<p>Grouped where a patch fails the same way at several refs; the hunk text is the "
        "variant's, the detail is from the first ref listed.</p>",
    ]
    for rows, p in groups:
        status = status_of(p)
        kind = status_info(status)[0]
        names = [r.name for r in rows]
        refs = f'<span title="{_e(", ".join(names))}">{_e(ref_list(names))}</span>'
        anchors = "".join(f'<span id="{_e(slug(r.name, p.patch_id))}"></span>' for r in rows[1:])
        out.append(
            f'<details open id="{_e(slug(rows[0].name, p.patch_id))}"><summary>'
            f'<span class="pill {kind}">{_e(status)}</span> <b>{_e(p.patch_id)}</b> '
            f"<small>({_e(p.variant or 'no variant')})</small> at {refs}</summary>"
            f"{anchors}"
        )
        if p.error:
            out.append(f"<p>{_e(p.error)}</p>")
        for h in attention_hunks(p):
            where = f"line {h.found_at}" if h.found_at else "nowhere"
            detail = f" — {_e(h.detail)}" if h.detail else ""
            out.append(
                f"<p><code>{_e(h.path)}</code> hunk {h.index} (recorded @{h.old_start}, "
                f"found {where}): <b>{_e(h.label.value)}</b>{detail}</p>"
            )
            out.append(_diff(h.text))
        out.append("</details>")
    return out


def _findings(items: list[surface.Finding]) -> str:
    lis = [
        f'<li><span class="rule">{_e(f.rule)}</span><code>{_e(f.path)}:{f.line}</code> '
        f"<code>{_e(f.text[:160])}</code></li>"
        for f in items[:MAX_FINDINGS]
    ]
    more = f"<li>… {len(items) - MAX_FINDINGS} more</li>" if len(items) > MAX_FINDINGS else ""
    return '<ul class="findings">' + "".join(lis) + more + "</ul>"


def _surface(s: surface.SurfaceReport) -> list[str]:
    titles = {r.id: r.title for r in surface.RULES}
    out = [
        "<h2>New CUDA surface</h2>",
        "<p>NVIDIA-only imports, tools and options found in upstream. <b>uncovered</b>: no "
        "patch for that version names it and it is not an optional (try/except) import. "
        "<b>new</b>: uncovered and absent at the previous ref.</p>",
        "<table><thead><tr><th>ref</th><th>covered</th><th>in patched file</th>"
        "<th>guarded</th><th>uncovered</th><th>new</th><th>gone</th></tr></thead><tbody>",
    ]
    for r in s.refs:
        c = r.counts()
        new = (
            f'<a class="num-bad" href="#{_e(slug("surface", r.ref))}">{len(r.new)}</a>'
            if r.new
            else "0"
        )
        out.append(
            f"<tr><th>{_e(r.ref)}</th><td>{c['covered']}</td>"
            f"<td>{c['in-patched-file']}</td><td>{c['guarded']}</td>"
            f"<td>{c['uncovered']}</td><td>{new}</td><td>{r.gone}</td></tr>"
        )
    out.append("</tbody></table>")
    for r in s.refs:
        if r.new:
            out.append(
                f'<details open id="{_e(slug("surface", r.ref))}"><summary>'
                f"{len(r.new)} new at {_e(r.ref)} <small>(since {_e(r.previous)})</small>"
                f"</summary>{_findings(r.new)}</details>"
            )
    if s.refs:
        last = s.refs[-1]
        by_rule: dict[str, list[surface.Finding]] = defaultdict(list)
        for f in last.uncovered:
            by_rule[f.rule].append(f)
        out.append(f"<h3>All {len(last.uncovered)} uncovered findings at {_e(last.ref)}</h3>")
        for rule, items in sorted(by_rule.items(), key=lambda kv: -len(kv[1])):
            out.append(
                f"<details><summary>{_e(rule)} ({len(items)}) <small>"
                f"{_e(titles.get(rule, ''))}</small></summary>{_findings(items)}</details>"
            )
    return out


def render(m: Matrix) -> str:
    timings = ", ".join(f"{k} {v:.2f}" for k, v in m.timings.items())
    legend = "".join(
        f'<span class="{kind}"><b>{_e(st)}</b> {_e(meaning)}</span>'
        for st, (kind, _, meaning) in STATUS.items()
    )
    body = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>megatron-rocm compatibility matrix</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>megatron-rocm compatibility matrix</h1>",
        f'<div class="banner {"ok" if m.ok else "bad"}"><span class="badge">'
        f"{'PASS' if m.ok else 'FAIL'}</span><b>{_e(verdict(m))}</b><br>{_e(m.summary())}</div>",
        f'<div class="meta">source <code>{_e(m.source)}</code> · series '
        f"<code>{_e(m.series.folder)}</code> · generated {_e(m.generated_at)} · {_e(timings)}"
        "</div>",
        f'<div class="legend">{legend}</div>',
        *_grid(m),
        "<h2>Patches</h2>",
        *_patches(m),
        *_attention(m),
        *(_surface(m.surface) if m.surface is not None else []),
        "</body></html>",
    ]
    return "\n".join(body) + "\n"
