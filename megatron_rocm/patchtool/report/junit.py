"""JUnit XML: one test suite per ref, one test case per patch, for CI test tabs.

A cell that does not apply is a <failure> carrying the failing hunks; a patch not needed for
a version is <skipped>; a ref that could not be checked at all (not a Megatron-LM tree, a
patched fork's commit) is one <error> test case. The CUDA-surface scan goes into a separate suite as information only
(new findings need a look, they do not fail the build).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from megatron_rocm.patchtool.matrix import ERROR, Matrix, Row, status_of
from megatron_rocm.patchtool.results import accepts, first_failure, hunk_summary


def _suite(parent: ET.Element, name: str, **attrs: object) -> ET.Element:
    return ET.SubElement(parent, "testsuite", name=name, **{k: str(v) for k, v in attrs.items()})


def _error_suite(root: ET.Element, r: Row, timestamp: str) -> None:
    """A ref that was not checked: an <error> (the run's problem), not a patch <failure>."""
    suite = _suite(root, r.name, tests=1, failures=0, errors=1, skipped=0, timestamp=timestamp)
    props = ET.SubElement(suite, "properties")
    for key, value in (("commit", r.report.commit), ("kind", r.spec.kind)):
        ET.SubElement(props, "property", name=key, value=value)
    case = ET.SubElement(suite, "testcase", classname=f"matrix.{r.name}", name="ref", time="0")
    ET.SubElement(case, "error", type=ERROR, message=r.error).text = r.error


def render(m: Matrix) -> str:
    root = ET.Element("testsuites", name="megatron-rocm matrix")
    total = failures = skipped = 0
    for r in m.rows:
        if r.error:
            _error_suite(root, r, m.generated_at)
            total += 1
            continue
        bad = sum(not p.ok for p in r.report.patches)
        skips = sum(status_of(p) in ("skip", "out-of-scope") for p in r.report.patches)
        suite = _suite(
            root,
            r.name,
            tests=len(r.report.patches),
            failures=bad,
            errors=0,
            skipped=skips,
            timestamp=m.generated_at,
        )
        props = ET.SubElement(suite, "properties")
        for key, value in (
            ("commit", r.report.commit),
            ("version", r.report.version),
            ("kind", r.spec.kind),
        ):
            ET.SubElement(props, "property", name=key, value=value)
        for p in r.report.patches:
            case = ET.SubElement(
                suite, "testcase", classname=f"matrix.{r.name}", name=p.patch_id, time="0"
            )
            status = status_of(p)
            if not p.ok:
                fail = ET.SubElement(case, "failure", type=status, message=first_failure(p))
                fail.text = (
                    "\n\n".join(
                        f"{h.path} hunk {h.index} {h.label.value}: {h.detail}\n{h.text}"
                        for h in p.hunks
                        if not accepts(h.label)
                    )
                    or p.error
                )
            elif status in ("skip", "out-of-scope"):
                ET.SubElement(case, "skipped", message=hunk_summary(p) or status)
            ET.SubElement(
                case, "system-out"
            ).text = f"{status} ({p.variant or 'no variant'}): {hunk_summary(p)}"
        total += len(r.report.patches)
        failures += bad
        skipped += skips
    if m.surface is not None:
        suite = _suite(
            root, "cuda-surface", tests=len(m.surface.refs), failures=0, errors=0, skipped=0
        )
        for rs in m.surface.refs:
            case = ET.SubElement(suite, "testcase", classname="cuda-surface", name=rs.ref, time="0")
            c = rs.counts()
            lines = [f"{c['uncovered']} uncovered, {len(rs.new)} new since {rs.previous}"]
            lines += [f"NEW {f.rule} {f.path}:{f.line}: {f.text}" for f in rs.new]
            ET.SubElement(case, "system-out").text = "\n".join(lines)
        total += len(m.surface.refs)
    root.set("tests", str(total))
    root.set("failures", str(failures))
    root.set("skipped", str(skipped))
    root.set("errors", str(len(m.error_rows)))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, "unicode") + "\n"
