"""``runtime.switches``: every ``MEGATRON_ROCM_*`` switch checked at argument validation."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from megatron_rocm.runtime import switches  # noqa: E402
from megatron_rocm.runtime.backend.options import reject_te_only_options  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# switch -> (a value it takes, a value it refuses)
VALUES = {
    "MEGATRON_ROCM_KERNELS": ("reference:norm,rope", "reference:nrom"),
    "MEGATRON_ROCM_SDPA": ("off", "no"),
    "MEGATRON_ROCM_SDPA_BACKENDS": ("cudnn,efficient", "cudnn,fast"),
    "MEGATRON_ROCM_CP_KERNEL": ("efficient", "fastest"),
    "MEGATRON_ROCM_CP_A2A_STAGES": ("2", "two"),
    "MEGATRON_ROCM_CP_A2A_TRANSPORT": ("process-group", "rccl"),
    "MEGATRON_ROCM_CP_A2A_HANDOFF": ("forward", "sideways"),
    "MEGATRON_ROCM_CP_A2A_QKV": ("0", "no"),
    "MEGATRON_ROCM_PACKED_ATTENTION": ("flex", "flexy"),
    "MEGATRON_ROCM_GROUPED_GEMM": ("triton", "cutlass"),
    "MEGATRON_ROCM_TRITON_NORMS": ("RMSNorm", "RMSnorm"),
}


@pytest.fixture(autouse=True)
def no_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in [k for k in os.environ if k.startswith(switches.PREFIX)]:
        monkeypatch.delenv(name)


def test_every_switch_has_a_parser_and_values_here() -> None:
    assert set(switches._parsers()) == set(VALUES)


@pytest.mark.parametrize("name", sorted(VALUES))
def test_a_switch_is_read_as_where_it_acts(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    good, bad = VALUES[name]
    monkeypatch.setenv(name, good)
    assert switches.problems() == []
    monkeypatch.setenv(name, bad)
    found = switches.problems()
    assert len(found) == 1 and name in found[0] and repr(bad) in found[0], found


def test_a_name_nothing_reads_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRON_ROCM_CP_A2A_QVK", "0")
    monkeypatch.setenv("MEGATRON_ROCM_CACHE", "/tmp/c")  # the patch tool's
    monkeypatch.setenv("MEGATRON_ROCM_TEST_ANYTHING", "1")  # the test suite's
    [line] = switches.problems()
    assert line.startswith("MEGATRON_ROCM_CP_A2A_QVK is not a megatron-rocm setting")
    assert "MEGATRON_ROCM_CP_A2A_QKV" in line


def test_argument_validation_stops_on_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRON_ROCM_CP_A2A_QKV", "yes")
    monkeypatch.setenv("MEGATRON_ROCM_SDAP", "0")
    with pytest.raises(ValueError) as e:
        reject_te_only_options(SimpleNamespace())
    lines = str(e.value).removeprefix("megatron-rocm: ").splitlines()
    assert len(lines) == 2 and "MEGATRON_ROCM_CP_A2A_QKV='yes'" in lines[0]
    assert lines[1].startswith("MEGATRON_ROCM_SDAP is not a megatron-rocm setting")


def test_every_name_the_code_reads_is_known() -> None:
    """A switch added to the runtime without its parser here would pass unchecked (and be
    called unknown); a variable of the tool's would be refused by a training run."""
    named = set()
    scripts = [p for p in (REPO / "scripts").rglob("*") if p.suffix in (".py", ".sh")]
    for path in [*(REPO / "megatron_rocm").rglob("*.py"), *scripts]:
        if path.name == "switches.py":  # its docstring's misspelt example
            continue
        named |= set(re.findall(r"MEGATRON_ROCM_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    known = set(switches._parsers()) | switches.ELSEWHERE
    assert named and named <= known, named - known


def test_every_switch_is_documented() -> None:
    docs = "".join((REPO / "docs" / f).read_text() for f in ("backend.md", "kernels.md"))
    missing = [name for name in VALUES if f"`{name}" not in docs]
    assert not missing
