"""``runtime.settings``: every ``MEGATRON_ROCM_*`` switch declared once, one grammar per type,
read only through the registry, checked at argument validation, documented from it."""

from __future__ import annotations

import ast
import logging
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rocm.runtime import settings

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO / "megatron_rocm" / "runtime"
BEGIN, END = "<!-- BEGIN settings table", "<!-- END settings table -->"
# switch -> (a value it takes, a value it refuses), written here for the kinds `derived` cannot
# guess (and where a hand-picked value tests more); a bool, choice or list switch needs no line
EXPLICIT = {
    "MEGATRON_ROCM_KERNELS": ("reference:norm,rope", "reference:nrom"),
    "MEGATRON_ROCM_LOCAL_SDPA": ("off", "nope"),
    "MEGATRON_ROCM_SDPA_BACKENDS": ("cudnn,efficient", "cudnn,fast"),
    "MEGATRON_ROCM_CP_KERNEL": ("efficient", "fastest"),
    "MEGATRON_ROCM_CP_A2A_STAGES": ("2", "two"),
    "MEGATRON_ROCM_CP_A2A_TRANSPORT": ("process-group", "rccl"),
    "MEGATRON_ROCM_CP_A2A_HANDOFF": ("forward", "sideways"),
    "MEGATRON_ROCM_CP_A2A_QKV": ("0", "2"),
    "MEGATRON_ROCM_PACKED_ATTENTION": ("flex", "flexy"),
    "MEGATRON_ROCM_GROUPED_GEMM": ("triton", "cutlass"),
    "MEGATRON_ROCM_TRITON_NORMS": ("RMSNorm", "RMSNorm,GroupNorm"),
}


def derived(s: settings.Setting) -> tuple[str, str] | None:
    """A value a bool, choice or list switch takes (not its default) and one it refuses."""
    if s.kind == "bool":
        return ("off" if s.default else "on"), "maybe"
    if s.kind in ("choice", "list"):
        good = next((c for c in s.choices if c != s.default and (c,) != s.default), None)
        return None if good is None else (good, "no-such-value")
    return None


VALUES = {
    **{s.name: v for s in settings.SETTINGS.values() if s.runtime and (v := derived(s))},
    **EXPLICIT,
}
BOOLS = [s.name for s in settings.SETTINGS.values() if s.kind == "bool"]


@pytest.fixture(autouse=True)
def no_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in [k for k in os.environ if k.startswith(settings.PREFIX)]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(settings, "_warned", set())


def test_every_runtime_switch_is_declared_and_has_values_here() -> None:
    """A switch of another kind (count, kernels, handoff, path, text) needs a line in EXPLICIT."""
    assert set(settings.runtime_names()) == set(VALUES)


def test_derived_values_cover_bools_choices_and_lists() -> None:
    flag = settings.Setting("MEGATRON_ROCM_X", "bool", True, doc="", area="")
    pick = settings.Setting(
        "MEGATRON_ROCM_Y", "choice", "auto", doc="", area="", choices=("auto", "b")
    )
    assert derived(flag) == ("off", "maybe") and derived(pick) == ("b", "no-such-value")
    assert derived(settings.Setting("MEGATRON_ROCM_Z", "count", 1, doc="", area="")) is None


@pytest.mark.parametrize("name", sorted(VALUES))
def test_each_switch_parses_and_refuses(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    good, bad = VALUES[name]
    assert settings.get(name) == settings.SETTINGS[name].default  # unset
    monkeypatch.setenv(name, "  ")  # blank: unset
    assert settings.get(name) == settings.SETTINGS[name].default
    monkeypatch.setenv(name, good)
    assert settings.problems() == []
    assert settings.get(name) != settings.SETTINGS[name].default
    monkeypatch.setenv(name, bad)
    found = settings.problems()
    assert len(found) == 1 and name in found[0] and repr(bad) in found[0], found
    with pytest.raises(ValueError, match=re.escape(f"{name}={bad!r}")):
        settings.get(name)


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("MEGATRON_ROCM_KERNELS", "auto", frozenset()),
        (
            "MEGATRON_ROCM_KERNELS",
            "reference",
            frozenset(settings.choices("MEGATRON_ROCM_KERNELS")),
        ),
        ("MEGATRON_ROCM_KERNELS", "reference: norm, Rope", frozenset({"norm", "rope"})),
        ("MEGATRON_ROCM_SDPA_BACKENDS", "Flash, math", ("flash", "math")),
        ("MEGATRON_ROCM_CP_KERNEL", "CPU_FLASH", "cpu_flash"),
        ("MEGATRON_ROCM_CP_A2A_STAGES", " 4 ", 4),
        ("MEGATRON_ROCM_CP_A2A_TRANSPORT", "copy-engine", "copy-engine"),
        ("MEGATRON_ROCM_CP_A2A_HANDOFF", "on", frozenset({"forward", "backward"})),
        ("MEGATRON_ROCM_CP_A2A_HANDOFF", "No", frozenset()),
        ("MEGATRON_ROCM_CP_A2A_HANDOFF", "backward", frozenset({"backward"})),
        ("MEGATRON_ROCM_PACKED_ATTENTION", "sdpa_loop", "sdpa_loop"),
        ("MEGATRON_ROCM_GROUPED_GEMM", "Loop", "loop"),
        ("MEGATRON_ROCM_TRITON_NORMS", "rmsnorm,LayerNorm", ("RMSNorm", "LayerNorm")),
    ],
)
def test_each_parser_gives_its_typed_value(
    name: str, text: str, value: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, text)
    assert settings.get(name) == value


@pytest.mark.parametrize("name", BOOLS)
@pytest.mark.parametrize(
    ("text", "value"),
    [(w, True) for w in ("1", "true", "on", "yes", "TRUE", "On", "Yes")]
    + [(w, False) for w in ("0", "false", "off", "no", "FALSE", "Off", "NO")],
)
def test_one_boolean_grammar_accepts(
    name: str, text: str, value: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, text)
    assert settings.get(name) is value


@pytest.mark.parametrize("name", BOOLS)
@pytest.mark.parametrize("text", ["2", "y", "n", "enable", "truee", "-1", "0 0"])
def test_one_boolean_grammar_refuses(name: str, text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError) as e:
        settings.get(name)
    assert str(e.value) == (
        f"{name}={text!r} is not a boolean; use 1/true/on/yes or 0/false/off/no"
    )


def test_the_local_spec_switch_keeps_its_old_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from megatron_rocm.runtime.kernels.local_sdpa import sdpa_enabled

    caplog.set_level(logging.WARNING, logger=settings.logger.name)
    monkeypatch.setenv("MEGATRON_ROCM_SDPA", "0")
    assert sdpa_enabled() is False and sdpa_enabled() is False
    assert settings.problems() == []  # not an unknown name
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "megatron-rocm: MEGATRON_ROCM_SDPA is deprecated; set MEGATRON_ROCM_LOCAL_SDPA instead"
    ]
    monkeypatch.setenv("MEGATRON_ROCM_LOCAL_SDPA", "off")  # both, the same: fine
    assert sdpa_enabled() is False
    monkeypatch.setenv("MEGATRON_ROCM_LOCAL_SDPA", "1")  # both, different: an error
    with pytest.raises(ValueError, match="MEGATRON_ROCM_LOCAL_SDPA='1' and its deprecated"):
        sdpa_enabled()
    [line] = settings.problems()
    assert "MEGATRON_ROCM_SDPA='0'" in line
    monkeypatch.setenv("MEGATRON_ROCM_SDPA", "maybe")  # the old name under the same grammar
    monkeypatch.delenv("MEGATRON_ROCM_LOCAL_SDPA")
    [line] = settings.problems()
    assert "'maybe' is not a boolean" in line


def test_a_name_nothing_reads_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRON_ROCM_CP_A2A_QVK", "0")
    monkeypatch.setenv("MEGATRON_ROCM_CACHE", "/tmp/c")  # the patch tool's
    monkeypatch.setenv("MEGATRON_ROCM_SMOKE_FAULT", "nonsense")  # the smoke suite's: not ours
    monkeypatch.setenv("MEGATRON_ROCM_TEST_ANYTHING", "1")  # the test suite's
    [line] = settings.problems()
    assert line.startswith("MEGATRON_ROCM_CP_A2A_QVK is not a megatron-rocm setting")
    assert "MEGATRON_ROCM_CP_A2A_QKV" in line and "MEGATRON_ROCM_CACHE" not in line


def test_argument_validation_stops_on_them(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from megatron_rocm.runtime.backend.options import reject_te_only_options

    monkeypatch.setenv("MEGATRON_ROCM_CP_A2A_QKV", "maybe")
    monkeypatch.setenv("MEGATRON_ROCM_SDAP", "0")
    with pytest.raises(ValueError) as e:
        reject_te_only_options(SimpleNamespace())
    lines = str(e.value).removeprefix("megatron-rocm: ").splitlines()
    assert len(lines) == 2 and "MEGATRON_ROCM_CP_A2A_QKV='maybe'" in lines[0]
    assert lines[1].startswith("MEGATRON_ROCM_SDAP is not a megatron-rocm setting")


# --------------------------------------------------------------- read through the registry


def _env_key(call: ast.AST) -> ast.AST | None:
    """The key a node reads from the environment: ``os.environ.get(k)``, ``os.getenv(k)``,
    ``os.environ[k]``, ``k in os.environ``; None for anything else."""

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.args:
        f = call.func
        if (f.attr in ("get", "pop", "setdefault") and is_environ(f.value)) or f.attr == "getenv":
            return call.args[0]
    if isinstance(call, ast.Subscript) and is_environ(call.value):
        return call.slice
    if isinstance(call, ast.Compare) and any(is_environ(c) for c in call.comparators):
        return call.left
    return None


def direct_reads(path: Path) -> list[str]:
    """Each environment read in ``path`` whose key is a ``MEGATRON_ROCM_*`` name, or a name
    this cannot tell (anything but a string literal or a module constant of one)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    constants = {
        t.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for t in node.targets
        if isinstance(t, ast.Name) and isinstance(node.value.value, str)
    }
    found = []
    for node in ast.walk(tree):
        key = _env_key(node)
        if key is None:
            continue
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            text = key.value
        elif isinstance(key, ast.Name) and key.id in constants:
            text = constants[key.id]
        else:
            text = settings.PREFIX + "<unknown>"
        if text.startswith(settings.PREFIX):
            found.append(f"{path.name}:{node.lineno}: {text}")
    return found


def test_the_runtime_reads_switches_only_through_the_registry() -> None:
    found = [
        line
        for path in sorted(RUNTIME.rglob("*.py"))
        if path.name != "settings.py"
        for line in direct_reads(path)
    ]
    assert found == []


def test_the_read_check_sees_a_direct_read(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        'import os\nNAME = "MEGATRON_ROCM_X"\nos.environ.get(NAME)\n'
        'os.getenv("MEGATRON_ROCM_Y")\n"MEGATRON_ROCM_Z" in os.environ\n'
        'os.environ["PATH"]\nos.environ[f"MEGATRON_ROCM_{1}"]\n'
    )
    assert sorted(line.split(": ")[1] for line in direct_reads(probe)) == [
        "MEGATRON_ROCM_<unknown>",
        "MEGATRON_ROCM_X",
        "MEGATRON_ROCM_Y",
        "MEGATRON_ROCM_Z",
    ]


# values only the registry's grammar takes (the modules' old parsers refused them), so the
# module's answer shows it read the switch through the registry
THROUGH_THE_REGISTRY = [
    ("kernels.launch", "reference_forced", ("norm",), "MEGATRON_ROCM_KERNELS", "reference:NORM", True),
    ("kernels.local_sdpa", "sdpa_enabled", (), "MEGATRON_ROCM_SDPA", "No", False),
    ("kernels.norm", "triton_serves", ("LayerNorm", 1), "MEGATRON_ROCM_TRITON_NORMS", "layernorm", True),
    ("kernels.grouped_gemm", "requested_implementation", (), "MEGATRON_ROCM_GROUPED_GEMM", "TRITON", "triton"),
    ("backend.cp.a2a_projection", "enabled", (), "MEGATRON_ROCM_CP_A2A_QKV", "off", False),
    ("backend.cp.handoff", "handoff_directions", (), "MEGATRON_ROCM_CP_A2A_HANDOFF", "no", frozenset()),
    ("backend.cp.copy_engine", "requested_transport", (), "MEGATRON_ROCM_CP_A2A_TRANSPORT", "Copy-Engine", "copy-engine"),
    ("backend.cp.a2a", "requested_stages", (), "MEGATRON_ROCM_CP_A2A_STAGES", "3", 3),
    ("backend.cp.block_attention", "requested_kernel", (), "MEGATRON_ROCM_CP_KERNEL", "Math", "math"),
    ("backend.te_sdpa", "requested_backends", (), "MEGATRON_ROCM_SDPA_BACKENDS", "Math, flash", "math,flash"),
    ("backend.packed.thd_attention", "requested_implementation", (None,), "MEGATRON_ROCM_PACKED_ATTENTION", "FLEX", "flex"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("module", "function", "args", "name", "text", "value"), THROUGH_THE_REGISTRY
)
def test_a_module_acts_on_the_registry_value(
    module: str, function: str, args: tuple, name: str, text: str, value: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    pytest.importorskip("torch")
    import importlib

    mod = importlib.import_module(f"megatron_rocm.runtime.{module}")
    monkeypatch.setenv(name, text)
    assert getattr(mod, function)(*args) == value


# what ``settings.get`` is stubbed to answer, and what the module then returns
STUBBED = {
    "MEGATRON_ROCM_KERNELS": (frozenset({"norm"}), True),
    "MEGATRON_ROCM_LOCAL_SDPA": (False, False),
    "MEGATRON_ROCM_TRITON_NORMS": (("LayerNorm",), True),
    "MEGATRON_ROCM_GROUPED_GEMM": ("loop", "loop"),
    "MEGATRON_ROCM_CP_A2A_QKV": (False, False),
    "MEGATRON_ROCM_CP_A2A_HANDOFF": (frozenset({"backward"}), frozenset({"backward"})),
    "MEGATRON_ROCM_CP_A2A_TRANSPORT": ("process-group", "process-group"),
    "MEGATRON_ROCM_CP_A2A_STAGES": (7, 7),
    "MEGATRON_ROCM_CP_KERNEL": ("cpu_flash", "cpu_flash"),
    "MEGATRON_ROCM_SDPA_BACKENDS": (("efficient", "math"), "efficient,math"),
    "MEGATRON_ROCM_PACKED_ATTENTION": ("reference", "reference"),
}


@pytest.mark.parametrize(
    ("module", "function", "args", "name"), [t[:3] + (t[3],) for t in THROUGH_THE_REGISTRY]
)
def test_a_module_asks_the_registry(
    module: str, function: str, args: tuple, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """With the environment empty, the module answers what the registry answers."""
    pytest.importorskip("torch")
    import importlib

    mod = importlib.import_module(f"megatron_rocm.runtime.{module}")
    name = settings.DEPRECATED.get(name, name)
    answer, expected = STUBBED[name]
    asked = []
    monkeypatch.setattr(settings, "get", lambda n: asked.append(n) or answer)
    assert getattr(mod, function)(*args) == expected and name in asked


def test_the_modules_take_their_choices_from_the_registry() -> None:
    pytest.importorskip("torch")
    from megatron_rocm.runtime.backend import te_sdpa as sdpa
    from megatron_rocm.runtime.backend.cp import block_attention as _cp_block_attention
    from megatron_rocm.runtime.backend.cp import copy_engine as _cp_copy_engine
    from megatron_rocm.runtime.backend.packed import thd_attention as pa
    from megatron_rocm.runtime.kernels import grouped_gemm, launch, norm

    assert launch.KERNELS == settings.choices("MEGATRON_ROCM_KERNELS")
    assert ("auto", *_cp_block_attention.KERNELS) == settings.choices("MEGATRON_ROCM_CP_KERNEL")
    assert _cp_copy_engine.TRANSPORTS == settings.choices("MEGATRON_ROCM_CP_A2A_TRANSPORT")
    assert ("auto", *pa.IMPLEMENTATIONS) == settings.choices("MEGATRON_ROCM_PACKED_ATTENTION")
    assert ("auto", *grouped_gemm.IMPLEMENTATIONS) == settings.choices("MEGATRON_ROCM_GROUPED_GEMM")
    assert set(norm.TRITON_NORMS) <= set(settings.choices("MEGATRON_ROCM_TRITON_NORMS"))
    for name in settings.choices("MEGATRON_ROCM_SDPA_BACKENDS"):  # each is a torch kernel
        sdpa._backend_priority(name)


# --------------------------------------------------------------- names and docs in step


def test_every_name_the_code_and_scripts_use_is_declared() -> None:
    """A switch added to the code without its declaration would pass unchecked (and be called
    unknown); a variable of the tool's would be refused by a training run."""
    named = set()
    scripts = [p for p in (REPO / "scripts").rglob("*") if p.suffix in (".py", ".sh")]
    patches = list((REPO / "patches").rglob("*.diff"))
    for path in [*(REPO / "megatron_rocm").rglob("*.py"), *scripts, *patches]:
        named |= set(re.findall(r"MEGATRON_ROCM_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    named = {n for n in named if not f"{n}_".startswith(settings.TEST_PREFIX)}  # the tests'
    known = set(settings.SETTINGS) | set(settings.DEPRECATED)
    assert named and named <= known, named - known


def test_scripts_and_patches_set_the_new_name() -> None:
    users = [*(REPO / "scripts").rglob("*.py"), *(REPO / "patches").rglob("*.diff")]
    old = [p.name for p in users if re.search(r"MEGATRON_ROCM_SDPA\b", p.read_text())]
    assert old == []


def _docs_table() -> str:
    text = (REPO / "docs" / "backend.md").read_text()
    start = text.index(BEGIN)
    return text[text.index("\n", start) + 1 : text.index(END)]


def test_the_docs_table_is_the_registry() -> None:
    """Regenerate with ``python -m megatron_rocm.runtime.settings --write docs/backend.md``."""
    assert _docs_table() == settings.markdown()


def test_every_switch_is_documented() -> None:
    table = _docs_table()
    assert all(f"| `{name}`" in table for name in settings.SETTINGS)


def test_the_markdown_command() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "megatron_rocm.runtime.settings", "--markdown"],
        cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert run.returncode == 0 and run.stdout == settings.markdown()
    bad = subprocess.run(
        [sys.executable, "-m", "megatron_rocm.runtime.settings", "--html"],
        cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.startswith("usage:")


def test_the_kernels_values_name_every_kernel_in_choices() -> None:
    """One edit adds a kernel: the docs text is derived from ``choices``, not kept beside it."""
    import dataclasses

    s = settings.SETTINGS["MEGATRON_ROCM_KERNELS"]
    grown = dataclasses.replace(s, choices=(*s.choices, "newop"))
    listed = settings.markdown().split(f"| `{s.name}` |")[1].split("\n")[0]
    assert all(f"`{k}`" in listed for k in s.choices)
    assert "`newop`" in settings._values(grown) and "`newop`" not in settings._values(s)


def test_the_write_command_rewrites_only_the_table(tmp_path: Path) -> None:
    doc = tmp_path / "backend.md"
    marker_line = "<!-- BEGIN settings table (generated) -->\n"
    doc.write_text(f"# intro\n\n{marker_line}| stale | row |\n{END}\n\nafter\n")
    cmd = [sys.executable, "-m", "megatron_rocm.runtime.settings", "--write", str(doc)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert doc.read_text() == f"# intro\n\n{marker_line}{settings.markdown()}{END}\n\nafter\n"
    plain = tmp_path / "plain.md"
    plain.write_text("no markers here\n")
    cmd[-1] = str(plain)
    bad = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and plain.read_text() == "no markers here\n"
    assert bad.stderr.count("\n") == 1 and "no '<!-- BEGIN settings table" in bad.stderr
    cmd[-1] = str(tmp_path / "missing.md")
    missing = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    assert missing.returncode == 2 and missing.stderr.startswith("settings: cannot read")


def test_the_registry_imports_no_torch() -> None:
    """``envtools`` (the doctor) lists the switches without torch installed."""
    code = "import sys, megatron_rocm.runtime.settings; print('torch' in sys.modules)"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert run.stdout.strip() == "False"
