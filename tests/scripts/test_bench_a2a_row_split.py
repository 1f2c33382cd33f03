"""scripts/bench/a2a_row_split.py on the CPU: the row splits must equal one whole causal call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.torch, pytest.mark.full]
from megatron_rocm.runtime.backend.cp import block_attention as blocks  # noqa: E402
from megatron_rocm.runtime.backend.cp.layout import zigzag_chunk_ids  # noqa: E402
from scripts.bench import a2a_row_split as bench  # noqa: E402


class BottomRightMath(blocks.MathKernel):
    """The math kernel with the causal diagonal at the bottom right, as flash puts it."""

    name = "math_bottom_right"

    @staticmethod
    def _scores(q, k, causal, scale):  # noqa: ANN001, ANN205
        scores = blocks.MathKernel._scores(q, k, False, scale)
        if causal:
            sq, sk = scores.shape[-2:]
            hidden = torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1)
            scores = scores.masked_fill(hidden, float("-inf"))
        return scores


def _records(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "split.jsonl"
    assert bench.main(["--cpu", "--json", str(out), *args]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def _assert_equal_to_whole(record: dict) -> None:
    errors = record["max_abs_err"]
    assert set(errors) == {"out", "dq", "dk", "dv"}
    assert all(err < 1e-5 for err in errors.values()), record


def test_a_top_left_kernel_runs_the_merged_split_only(tmp_path: Path) -> None:
    records = _records(tmp_path)
    assert [(r["kernel"], r["case"], r["causal_alignment"]) for r in records] == [
        ("math", "whole", "top_left"),
        ("math", "merge", "top_left"),
    ]
    _assert_equal_to_whole(records[1])


def test_a_bottom_right_kernel_also_runs_one_call_per_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(bench.KERNELS, BottomRightMath.name, BottomRightMath())
    records = _records(tmp_path, "--kernels", BottomRightMath.name)
    assert [(r["case"], r["causal_alignment"]) for r in records] == [
        ("whole", "bottom_right"),
        ("merge", "bottom_right"),
        ("bottom_right", "bottom_right"),
    ]
    for record in records[1:]:
        _assert_equal_to_whole(record)


def test_each_row_group_is_one_ranks_rows_in_megatrons_zigzag() -> None:
    owner = {c: rank for rank in range(2) for c in zigzag_chunk_ids(2, rank)}
    assert sorted(owner) == list(range(bench.CHUNKS))
    tiled = [c for start, end in bench.ROW_GROUPS for c in range(start, end)]
    assert tiled == list(range(bench.CHUNKS))
    owners = [{owner[c] for c in range(start, end)} for start, end in bench.ROW_GROUPS]
    assert all(len(ranks) == 1 for ranks in owners)
    # neighbouring groups belong to different ranks: no fewer groups would keep them apart
    assert all(a != b for a, b in zip(owners, owners[1:]))


def test_an_unknown_kernel_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--cpu", "--kernels", "nope"])
    assert exit_info.value.code == 2
    assert "unknown kernel(s) nope" in capsys.readouterr().err
