"""``megatron-rocm list``: the series, each patch's variants and their version ranges."""

from __future__ import annotations

from megatron_rocm.errors import EXIT_OK
from megatron_rocm.output import print_json
from megatron_rocm.patchtool.series import load_series


def list_series(*, series_dir: str | None, as_json: bool) -> int:
    series = load_series(series_dir)
    if as_json:
        print_json(
            {
                "series": str(series.folder),
                "patches": [
                    {
                        "id": p.id,
                        "reason": p.reason,
                        "upstream": p.upstream,
                        "variants": [
                            {
                                "diff": v.diff or None,
                                "since": str(v.since),
                                "until": str(v.until) if v.until else None,
                                "skip": v.skip,
                                "when": [{"path": w.path, "contains": w.contains} for w in v.when],
                            }
                            for v in p.variants
                        ],
                    }
                    for p in series.patches
                ],
            }
        )
        return EXIT_OK
    print(f"series: {series.folder} ({len(series.patches)} patches)")
    for n, p in enumerate(series.patches, 1):
        print(f"{n:2}. {p.id}  [{p.upstream}]  {p.reason}")
        for v in p.variants:
            what = "skip (not needed)" if v.skip else v.diff
            print(f"      {v.range_text:<22} {what}")
    return EXIT_OK
