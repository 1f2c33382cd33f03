"""Every ``MEGATRON_ROCM_*`` environment switch, declared once, read through :func:`get`.

A switch steers a kernel choice or an attention call, often minutes into a run; a malformed
value would stop the run only there, and a misspelt name would change nothing, silently. So
each switch is one :class:`Setting` here (type, allowed values, default, one-line doc, the
spec or area it affects), parsed by one grammar per type (one boolean grammar for all),
and :func:`problems` checks them all at once: the native backend's argument validation
(``backend.options.reject_te_only_options``, called from upstream's ``validate_args`` by the
``te-spec-backend`` patch) raises with its lines before anything is built. The modules that
act on a switch read it with :func:`get` (a typed value, parsed once per distinct text), never
from ``os.environ``; ``tests/runtime/test_switches.py`` enforces that.

The tool's own settings (cache folder, series, fault injection) are declared too, so that a
training run does not call them unknown, but the runtime does not read them: the patch tool,
the smoke suite and the tests read them where they live.

``python -m megatron_rocm.runtime.settings --markdown`` prints the table docs/backend.md
carries between its generated markers; ``--write docs/backend.md`` replaces it there. This
module imports only the standard library.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

PREFIX = "MEGATRON_ROCM_"
TEST_PREFIX = "MEGATRON_ROCM_TEST_"  # the test suite's own variables, never checked
TRUE_WORDS = ("1", "true", "on", "yes")
FALSE_WORDS = ("0", "false", "off", "no")
BOOL_WORDS = "1/true/on/yes or 0/false/off/no"

logger = logging.getLogger("megatron_rocm.runtime.settings")


@dataclass(frozen=True)
class Setting:
    """One switch: how it is spelt, parsed and documented."""

    name: str
    kind: str  # bool | choice | list | count | kernels | handoff | path | text (the grammar)
    default: object  # the parsed value when unset (or set to blank)
    doc: str  # one line for the docs table
    area: str  # the spec or part of the code it affects
    choices: tuple[str, ...] = ()  # allowed values (choice/list; the kernels of ``kernels``)
    default_text: str = ""  # the default as the docs show it
    deprecated: tuple[str, ...] = ()  # old names still accepted, with a warning
    runtime: bool = True  # False: a tool's setting, not read (nor parsed) by the runtime
    values_text: str = ""  # the allowed values as the docs show them, where not ``choices``


def _bool(s: Setting, text: str) -> bool:
    word = text.lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{s.name}={text!r} is not a boolean; use {BOOL_WORDS}")


def _choice(s: Setting, text: str) -> str:
    for choice in s.choices:
        if text.lower() == choice.lower():
            return choice
    raise ValueError(f"{s.name}={text!r} is not one of {', '.join(s.choices)}")


def _list(s: Setting, text: str) -> tuple[str, ...]:
    """A comma-separated, non-empty list of ``choices`` (case-insensitive), in the given order."""
    canon = {c.lower(): c for c in s.choices}
    items = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in items if item.lower() not in canon]
    if unknown or not items:
        raise ValueError(
            f"{s.name}={text!r}: expected a comma-separated subset of {', '.join(s.choices)} "
            f"(got {', '.join(unknown) or 'no names'})"
        )
    return tuple(canon[item.lower()] for item in items)


def _count(s: Setting, text: str) -> int:
    if text.isascii() and text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"{s.name}={text!r} is not a positive whole number")


def _kernels(s: Setting, text: str) -> frozenset[str]:
    """``auto`` (none), ``reference`` (every kernel) or ``reference:<kernel>[,...]``: the
    kernels put on torch's path."""
    if text.lower() == "auto":
        return frozenset()
    if text.lower() == "reference":
        return frozenset(s.choices)
    mode, _, names = text.partition(":")
    chosen = {n.strip().lower() for n in names.split(",") if n.strip()}
    if mode.strip().lower() != "reference" or not chosen or not chosen <= set(s.choices):
        raise ValueError(
            f"{s.name}={text!r}: expected 'auto', 'reference' or "
            f"'reference:<kernel>[,<kernel>...]' with kernels from {', '.join(s.choices)}"
        )
    return frozenset(chosen)


def _handoff(s: Setting, text: str) -> frozenset[str]:
    """A boolean (both directions or neither) or one direction."""
    if text.lower() in s.choices:
        return frozenset({text.lower()})
    try:
        return frozenset(s.choices) if _bool(s, text) else frozenset()
    except ValueError:
        raise ValueError(
            f"{s.name}={text!r} is not a boolean ({BOOL_WORDS}) or one of {', '.join(s.choices)}"
        ) from None


def _text(s: Setting, text: str) -> str:
    return text


_PARSERS: dict[str, Callable[[Setting, str], object]] = {
    "bool": _bool,
    "choice": _choice,
    "list": _list,
    "count": _count,
    "kernels": _kernels,
    "handoff": _handoff,
    "path": _text,
    "text": _text,
}

TE = "TE spec"
CP = "TE spec, context parallelism"
A2A = "TE spec, `--cp-comm-type a2a`"
SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "MEGATRON_ROCM_KERNELS",
            "kernels",
            frozenset(),
            area="Triton kernels (both specs)",
            choices=(
                "softmax",
                "rope",
                "cross_entropy",
                "norm",
                "grouped_gemm",
                "swiglu",
                "fp8",
                "fp8_accumulate",
                "fp8_blockwise",
            ),
            default_text="auto",
            doc="put every kernel, or the named ones, on torch's reference path (A/B runs, "
            "debugging)",
        ),
        Setting(
            "MEGATRON_ROCM_TRITON_NORMS",
            "list",
            None,
            area="Triton kernels (both specs)",
            choices=("LayerNorm", "RMSNorm"),
            default_text="RMSNorm on large calls",
            doc="the norms the Triton kernel serves, at every size; unset: RMSNorm on calls of "
            "2^24 elements or more (docs/kernels.md)",
        ),
        Setting(
            "MEGATRON_ROCM_LOCAL_SDPA",
            "bool",
            True,
            area="local spec",
            default_text="on",
            deprecated=("MEGATRON_ROCM_SDPA",),
            doc="the local spec's `DotProductAttention` through torch SDPA (the `sdpa-attention` "
            "patch); off: upstream's unfused path, as `--no-sdpa-attention`",
        ),
        Setting(
            "MEGATRON_ROCM_SDPA_BACKENDS",
            "list",
            (),
            area=TE,
            choices=("cudnn", "flash", "efficient", "math"),
            default_text="torch's choice",
            doc="SDPA kernel priority for the TE spec's attention (benchmarks; refused with "
            "`--attention-backend` other than `auto`)",
        ),
        Setting(
            "MEGATRON_ROCM_CP_KERNEL",
            "choice",
            "auto",
            area=CP,
            choices=("auto", "flash", "efficient", "cudnn", "cpu_flash", "math"),
            default_text="auto",
            doc="the context-parallel block kernel, every `--cp-comm-type` (benchmarks; refused "
            "with `--attention-backend` other than `auto`); an explicit one that cannot run "
            "is an error",
        ),
        Setting(
            "MEGATRON_ROCM_CP_A2A_STAGES",
            "count",
            None,
            area=A2A,
            default_text="by transport (1 copy engines, 2 process group)",
            values_text="a positive whole number",
            doc="head groups whose exchanges overlap the other groups' attention",
        ),
        Setting(
            "MEGATRON_ROCM_CP_A2A_TRANSPORT",
            "choice",
            "auto",
            area=A2A,
            choices=("auto", "process-group", "copy-engine"),
            default_text="auto",
            doc="how the heads travel: copy engines through symmetric memory or the process "
            "group's point-to-point",
        ),
        Setting(
            "MEGATRON_ROCM_CP_A2A_HANDOFF",
            "handoff",
            frozenset({"forward", "backward"}),
            area=A2A,
            choices=("forward", "backward"),
            default_text="on (both)",
            values_text=f"{BOOL_WORDS}, `forward`, `backward`",
            doc="which of the attention's exchanges the output projection overlaps with its "
            "GEMMs (on: both)",
        ),
        Setting(
            "MEGATRON_ROCM_CP_A2A_QKV",
            "bool",
            True,
            area=A2A + " (0.19, main)",
            default_text="on",
            doc="the attention computes upstream's QKV projection itself, one CP rank's rows at "
            "a time, overlapping the exchange (the `a2a-qkv-projection` patch)",
        ),
        Setting(
            "MEGATRON_ROCM_PACKED_ATTENTION",
            "choice",
            "auto",
            area="TE spec, packed (THD)",
            choices=("auto", "flash", "flex", "sdpa_loop", "reference"),
            default_text="auto",
            doc="the packed-sequence attention implementation (benchmarks; refused with "
            "`--attention-backend` other than `auto`)",
        ),
        Setting(
            "MEGATRON_ROCM_GROUPED_GEMM",
            "choice",
            "auto",
            area="TE spec, grouped linears (MoE)",
            choices=("auto", "torch", "triton", "loop"),
            default_text="auto",
            doc="the grouped linears' GEMM; an explicit one that cannot run is an error",
        ),
        # the tool's own settings: declared so a training run accepts them, read where they live
        Setting(
            "MEGATRON_ROCM_CACHE",
            "path",
            None,
            area="tool (cache.py)",
            runtime=False,
            default_text="the user cache folder's megatron-rocm (cache.py)",
            values_text="a folder",
            doc="the cache folder: upstream mirrors, sdists, logs",
        ),
        Setting(
            "MEGATRON_ROCM_SERIES",
            "path",
            None,
            area="tool (patch series)",
            runtime=False,
            default_text="the checkout's or bundled patches/",
            values_text="a folder",
            doc="the patch series folder the tool applies",
        ),
        Setting(
            "MEGATRON_ROCM_PYPI_URL",
            "text",
            None,
            area="tool (sdist downloads)",
            runtime=False,
            default_text="https://pypi.org/pypi",
            values_text="a URL",
            doc="the PyPI JSON API root sdists are looked up at",
        ),
        Setting(
            "MEGATRON_ROCM_SMOKE_FAULT",
            "choice",
            None,
            area="smoke suite (tests only)",
            choices=("softmax", "allreduce", "resume", "fp8", "fp8_state"),
            runtime=False,
            default_text="unset",
            doc="corrupt one result after the real computation, to prove the suite can fail",
        ),
        Setting(
            "MEGATRON_ROCM_SMOKE_REALDATA_TIMEOUT",
            "count",
            None,
            area="smoke suite",
            runtime=False,
            default_text="120 preprocessing, 240 each training run",
            values_text="seconds, a positive whole number",
            doc="one time limit for every step of the `real-data` check",
        ),
        Setting(
            "MEGATRON_ROCM_FAULT",
            "text",
            None,
            area="patch tool (tests only)",
            runtime=False,
            default_text="unset",
            values_text="`<step>:<action>`, action `SIGINT`, `SIGTERM`, `SIGHUP`, `SIGKILL` or `pause`",
            doc="interrupt the tool at a named step (interruption tests)",
        ),
        Setting(
            "MEGATRON_ROCM_FAULT_READY",
            "path",
            None,
            area="patch tool (tests only)",
            runtime=False,
            default_text="unset",
            values_text="a file",
            doc="with `pause`: the file created once the step is reached",
        ),
    )
}
DEPRECATED: dict[str, str] = {old: s.name for s in SETTINGS.values() for old in s.deprecated}
_warned: set[str] = set()


def choices(name: str) -> tuple[str, ...]:
    """The allowed values of ``name`` (the modules take their constants from here)."""
    return SETTINGS[name].choices


@functools.lru_cache(maxsize=256)
def _parsed(name: str, text: str) -> object:
    s = SETTINGS[name]
    return _PARSERS[s.kind](s, text)


def parse(name: str, text: str) -> object:
    """``text`` parsed as switch ``name`` would be (an argument that takes the same values)."""
    return _parsed(name, text)


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def get(name: str) -> object:
    """The typed value of switch ``name`` (its default when unset or blank).

    Read from the environment at every call (tests and A/B runs change it), parsed once per
    distinct text. A malformed value raises ``ValueError`` naming the switch, the value and
    what it takes. A deprecated name still works, logged once; set beside the new name to a
    different value, it is an error.
    """
    s = SETTINGS[name]
    if not s.runtime:
        raise KeyError(f"{name} is a tool's setting; the runtime does not read it")
    text = _raw(name)
    for old in s.deprecated:
        old_text = _raw(old)
        if not old_text:
            continue
        if old not in _warned:
            _warned.add(old)
            logger.warning("megatron-rocm: %s is deprecated; set %s instead", old, name)
        old_value = _parsed(name, old_text)
        if not text:
            return old_value
        if _parsed(name, text) != old_value:
            raise ValueError(
                f"{name}={text!r} and its deprecated name {old}={old_text!r} disagree; unset {old}"
            )
    return _parsed(name, text) if text else s.default


def is_set(name: str) -> bool:
    """Whether ``name`` (or a deprecated name of it) is set to a non-blank value."""
    return any(_raw(n) for n in (name, *SETTINGS[name].deprecated))


def chooses(name: str) -> bool:
    """Whether ``name`` is set to something other than ``auto``, valid or not (a kernel switch
    beside ``--attention-backend``: two choices are refused before the value is parsed)."""
    return any(_raw(n).lower() not in ("", "auto") for n in (name, *SETTINGS[name].deprecated))


def runtime_names() -> list[str]:
    """The switches the runtime reads, in declaration order."""
    return [s.name for s in SETTINGS.values() if s.runtime]


def problems() -> list[str]:
    """One line per malformed switch and per ``MEGATRON_ROCM_*`` variable nothing reads."""
    found = []
    for name in runtime_names():
        if is_set(name):
            try:
                get(name)
            except ValueError as e:
                found.append(str(e))
    for name in sorted(k for k in os.environ if k.startswith(PREFIX)):
        if name not in SETTINGS and name not in DEPRECATED and not name.startswith(TEST_PREFIX):
            found.append(
                f"{name} is not a megatron-rocm setting, so it would change nothing; the "
                f"runtime's are {', '.join(sorted(runtime_names()))} (docs/backend.md)"
            )
    return found


def _values(s: Setting) -> str:
    if s.values_text:
        return s.values_text
    if s.kind == "bool":
        return BOOL_WORDS
    listed = ", ".join(f"`{c}`" for c in s.choices)
    if s.kind == "kernels":  # the kernel names come from ``choices``: one edit adds a kernel
        return f"`auto`, `reference`, `reference:<kernel>[,...]` (kernels: {listed})"
    return f"comma list of {listed}" if s.kind == "list" else listed


def markdown() -> str:
    """The docs table of every setting, rendered from ``SETTINGS``."""
    rows = [
        "| variable | type | values | default | affects | what it does |",
        "|---|---|---|---|---|---|",
    ]
    for s in SETTINGS.values():
        name = f"`{s.name}`" + "".join(f" (old name `{old}`)" for old in s.deprecated)
        rows.append(f"| {name} | {s.kind} | {_values(s)} | {s.default_text} | {s.area} | {s.doc} |")
    return "\n".join(rows) + "\n"


BEGIN_MARK = "<!-- BEGIN settings table"  # the line that opens the table in docs/backend.md
END_MARK = "<!-- END settings table -->"


def write_table(path: str) -> str | None:
    """Replace the table between the markers of ``path`` (docs/backend.md) with
    :func:`markdown`; the text outside them is kept. None when done, else why not."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        return f"cannot read {path}: {e.strerror}"
    start, end = text.find(BEGIN_MARK), text.find(END_MARK)
    if start < 0 or end < start:
        return f"{path} has no '{BEGIN_MARK} ...' and '{END_MARK}' lines"
    body_start = text.index("\n", start) + 1
    new = text[:body_start] + markdown() + text[end:]
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    usage = (
        "usage: python -m megatron_rocm.runtime.settings --markdown (print the docs table)\n"
        "       python -m megatron_rocm.runtime.settings --write docs/backend.md (replace the "
        "table between its markers)"
    )
    if args in (["-h"], ["--help"]):
        print(usage)
        return 0
    if args == ["--markdown"]:
        sys.stdout.write(markdown())
        return 0
    if len(args) == 2 and args[0] == "--write":
        problem = write_table(args[1])
        if problem:
            print(f"settings: {problem}", file=sys.stderr)
            return 2
        return 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
