"""The patch catalog in ``patches/``: ordered patches with variants keyed by version range.

Why ranges and not one diff per tag: upstream files drift at most tags but a diff applies with
offsets across many; a variant covers the half-open range [since, until) of releases.

Why content probes too (``when``): a branch does not always say what it is. Upstream's ``dev``
reports the version of the release it was branched for (0.19.0, like the 0.19 sdist) while its
code is a release ahead, so no version range tells the two apart. A variant with ``when`` is
taken where its range covers the version *and* upstream's tree holds each probe's text; it wins
over the plain variant of that range, which every other tree keeps.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from megatron_rocm.errors import UsageError
from megatron_rocm.patchtool import series_journal

SERIES_ENV = "MEGATRON_ROCM_SERIES"
UPSTREAM_STATES = ("not-submitted", "submitted", "merged", "rocm-only")
# A patch id names its folder and the commit trailer that maps a fork commit back to it
# (``Megatron-ROCm-Patch: <id>``, one token), so it is one plain word.
PATCH_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def release_of(version: str | Version) -> Version:
    """``0.17.0rc0`` -> ``0.17.0``: tags can carry the next pre-release; ranges use releases."""
    v = version if isinstance(version, Version) else parse_version(version)
    return Version(".".join(str(p) for p in (v.release + (0, 0, 0))[:3]))


def parse_version(text: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise UsageError(f"not a version: {text!r} (expected e.g. 0.14.0)") from None


Reader = Callable[[str], "bytes | None"]  # upstream's file at a path, None when absent


@dataclass(frozen=True)
class Probe:
    """``path`` exists in upstream's tree and holds ``contains`` (bytes of UTF-8 text)."""

    path: str
    contains: str

    def holds(self, read: Reader) -> bool:
        data = read(self.path)
        return data is not None and self.contains.encode("utf-8") in data

    @property
    def text(self) -> str:
        return f"{self.path} has {self.contains!r}"


@dataclass(frozen=True)
class Variant:
    diff: str  # file name inside the patch folder
    since: Version
    until: Version | None = None
    skip: bool = False  # the change is not needed in this range
    when: tuple[Probe, ...] = ()  # content probes: all must hold (see the module docstring)

    def covers(self, version: Version) -> bool:
        v = release_of(version)
        return self.since <= v and (self.until is None or v < self.until)

    def matches(self, read: Reader) -> bool:
        return all(p.holds(read) for p in self.when)

    @property
    def range_text(self) -> str:
        text = f">={self.since}" + (f",<{self.until}" if self.until else "")
        return text + "".join(f" when {p.text}" for p in self.when)


@dataclass
class Patch:
    id: str
    reason: str
    upstream: str
    folder: Path
    variants: list[Variant] = field(default_factory=list)

    def variant_for(self, version: Version, read: Reader | None = None) -> Variant | None:
        """The variant for a tree of ``version``: the first probed variant whose probes hold
        in it (``read`` gives its files; without it, probed variants are never taken), else
        the plain variant whose range covers the version."""
        covering = [v for v in self.variants if v.covers(version)]
        if read is not None:
            probed = next((v for v in covering if v.when and v.matches(read)), None)
            if probed is not None:
                return probed
        return next((v for v in covering if not v.when), None)

    def diff_path(self, variant: Variant) -> Path:
        return self.folder / variant.diff


@dataclass
class Series:
    folder: Path
    patches: list[Patch]

    def get(self, patch_id: str) -> Patch:
        for p in self.patches:
            if p.id == patch_id:
                return p
        raise UsageError(f"no patch {patch_id!r} in {self.folder / 'series'}")


def default_series_dir() -> Path:
    """$MEGATRON_ROCM_SERIES, the checkout's patches/, or the copy bundled in the wheel."""
    env = os.environ.get(SERIES_ENV)
    if env:
        return Path(env)
    package = Path(__file__).resolve().parents[1]  # megatron_rocm/
    checkout = package.parent / "patches"
    if (checkout / "series").is_file():
        return checkout
    return package / "_patches"


def _version_in(text: str, where: Path, key: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise UsageError(f"{where}: {key!r} is not a version: {text!r}") from None


def _variant(raw: object, folder: Path) -> Variant:
    where = folder / "patch.toml"
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: every [[variant]] must be a table (got {raw!r})")
    if "since" not in raw:
        raise UsageError(f"{where}: every [[variant]] needs 'since'")
    for key in ("since", "until"):
        if key in raw and not isinstance(raw[key], str):  # `since = 17` or `0.14` in TOML
            raise UsageError(
                f'{where}: {key!r} must be a quoted version such as "0.14.0" (got {raw[key]!r})'
            )
    since = release_of(_version_in(raw["since"], where, "since"))
    until = release_of(_version_in(raw["until"], where, "until")) if raw.get("until") else None
    if until is not None and until <= since:
        raise UsageError(f"{where}: variant range {since}..{until} is empty")
    skip = raw.get("skip", False)
    if not isinstance(skip, bool):
        raise UsageError(f"{where}: 'skip' must be true or false (got {skip!r})")
    diff = str(raw.get("diff", ""))
    if diff and (Path(diff).name != diff or diff in (".", "..")):
        raise UsageError(f"{where}: diff {diff!r} must be a file name inside {folder}")
    if not skip:
        if not diff:
            raise UsageError(f"{where}: variant since {since} names no diff file")
        if not (folder / diff).is_file():
            raise UsageError(f"{where}: diff file {diff!r} does not exist")
    return Variant(diff=diff, since=since, until=until, skip=skip, when=_probes(raw, where))


def _probes(raw: dict, where: Path) -> tuple[Probe, ...]:
    """``when = {path = "...", contains = "..."}`` or a list of such tables (all must hold)."""
    if "when" not in raw:
        return ()
    value = raw["when"]
    tables = value if isinstance(value, list) else [value]
    probes = []
    for t in tables:
        if (
            not isinstance(t, dict)
            or set(t) != {"path", "contains"}
            or not all(isinstance(x, str) and x for x in t.values())
        ):
            raise UsageError(
                f'{where}: \'when\' must be a table {{path = "...", contains = "..."}} or a '
                f"list of them, both non-empty strings (got {t!r})"
            )
        probes.append(Probe(t["path"], t["contains"]))
    if not probes:
        raise UsageError(f"{where}: 'when' is an empty list; leave it out for a plain variant")
    return tuple(probes)


def _check_overlaps(patch: Patch) -> None:
    """Plain ranges must not overlap; a probed variant lies over them by design."""
    ordered = sorted((v for v in patch.variants if not v.when), key=lambda v: v.since)
    for a, b in zip(ordered, ordered[1:]):
        if a.until is None or a.until > b.since:
            raise UsageError(
                f"{patch.folder / 'patch.toml'}: version ranges overlap "
                f"({a.range_text} and {b.range_text})"
            )


def load_patch(folder: Path, patch_id: str) -> Patch:
    meta = folder / "patch.toml"
    if not meta.is_file():
        raise UsageError(f"series names {patch_id!r} but {meta} does not exist")
    try:
        data = tomllib.loads(meta.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{meta}: malformed TOML ({e})") from None
    if data.get("id", patch_id) != patch_id:
        raise UsageError(f"{meta}: id {data.get('id')!r} does not match folder {patch_id!r}")
    upstream = str(data.get("upstream", "not-submitted"))
    words = upstream.split()
    if not words or words[0] not in UPSTREAM_STATES:
        raise UsageError(f"{meta}: upstream must start with one of {', '.join(UPSTREAM_STATES)}")
    variants = data.get("variant", [])
    if not isinstance(variants, list) or not variants:
        raise UsageError(f"{meta}: needs at least one [[variant]]")
    patch = Patch(
        id=patch_id,
        reason=str(data.get("reason", "")).strip() or patch_id,
        upstream=upstream,
        folder=folder,
        variants=[_variant(v, folder) for v in variants],
    )
    _check_overlaps(patch)
    return patch


def load_series(folder: str | Path | None = None) -> Series:
    if folder is not None and not str(folder).strip():
        raise UsageError("--series is empty; give the series folder (or leave it out)")
    root = Path(folder) if folder is not None else default_series_dir()
    series_journal.settle(root)  # an export killed half way: finish or undo it first
    listing = root / "series"
    if not listing.is_file():
        raise UsageError(f"no patch series at {root} (missing {listing.name} file)")
    try:
        text = listing.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{listing}: not UTF-8 text") from None
    ids: list[str] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not PATCH_ID.fullmatch(line):
            raise UsageError(
                f"{listing}: patch id {line!r} is not one word of letters, digits, '.', '_', "
                "'+' or '-' (it names a folder and a commit trailer)"
            )
        if line in ids:
            raise UsageError(f"{listing}: patch {line!r} is listed twice")
        ids.append(line)
    return Series(folder=root, patches=[load_patch(root / i, i) for i in ids])


def format_patch_toml(patch: Patch) -> str:
    """Serialize a new patch's metadata (export writes it when a commit becomes a patch)."""
    lines = [
        f"id = {_q(patch.id)}",
        f"reason = {_q(patch.reason)}",
        f"upstream = {_q(patch.upstream)}",
    ]
    for v in patch.variants:
        lines += ["", *_variant_block(v)]
    return "\n".join(lines) + "\n"


def _variant_block(v: Variant) -> list[str]:
    lines = ["[[variant]]"]
    if v.diff:
        lines.append(f"diff = {_q(v.diff)}")
    lines.append(f"since = {_q(str(v.since))}")
    if v.until is not None:
        lines.append(f"until = {_q(str(v.until))}")
    if v.skip:
        lines.append("skip = true")
    return lines


_TOML_ESCAPES = {
    "\\": "\\\\",
    '"': '\\"',
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _q(s: str) -> str:
    """``s`` as a TOML basic string: quotes, backslashes and every control character escaped
    (a raw one makes the file unreadable for every later command)."""
    return '"' + "".join(_TOML_ESCAPES.get(c) or _escape_control(c) for c in s) + '"'


def is_control(c: str) -> bool:
    """A C0 control character or DEL: what TOML strings (and one-line texts) cannot hold raw."""
    return ord(c) < 0x20 or ord(c) == 0x7F


def _escape_control(c: str) -> str:
    return f"\\u{ord(c):04X}" if is_control(c) else c


_FIELD = re.compile(r'^(?P<key>diff|since|until)\s*=\s*"(?P<value>[^"]*)"(?P<rest>.*)$')


def update_patch_toml(text: str, patch: Patch) -> str:
    """``text`` (a patch.toml) rewritten for ``patch``'s variants, keeping what a developer
    wrote: the header and its comments, and each surviving variant's block with its comments
    (``since``/``until`` changed in place). New variants get a block of their own, in order;
    blocks of variants that are gone are dropped."""
    head, *chunks = re.split(r"(?m)^(?=\[\[\s*variant\s*\]\]\s*(?:#.*)?$)", text)
    blocks: dict[str, tuple[list[str], dict[str, re.Match[str]]]] = {}
    for chunk in chunks:
        lines = chunk.rstrip("\n").split("\n")
        fields = {m["key"]: m for ln in lines if (m := _FIELD.match(ln))}
        key = fields["diff"]["value"] if "diff" in fields else _skip_key(fields.get("since"))
        blocks[key] = (lines, fields)
    out = [head.rstrip("\n")]
    for v in patch.variants:
        found = blocks.get(v.diff or f"skip@{v.since}")
        if found is None:
            out.append("\n".join(_variant_block(v)))
            continue
        lines, fields = found
        until_rest = fields["until"]["rest"] if "until" in fields else ""
        kept: list[str] = []
        for ln in lines:
            m = _FIELD.match(ln)
            if m and m["key"] == "until":
                continue  # written after since, from the variant
            if m and m["key"] == "since":
                ln = f"since = {_q(str(v.since))}{m['rest']}"
            kept.append(ln)
            if m and m["key"] == "since" and v.until is not None:
                kept.append(f"until = {_q(str(v.until))}{until_rest}")
        out.append("\n".join(kept).rstrip("\n"))
    updated = "\n\n".join(out) + "\n"
    _check_rewrite(updated, patch)
    return updated


def _check_rewrite(text: str, patch: Patch) -> None:
    """The rewrite must read back as exactly ``patch``'s variants. Where the developer's file
    is written in a form the in-place edit does not follow (variants as an inline array,
    single-quoted values, a key the block splitter does not see), refuse rather than write a
    file that no longer loads or means something else."""
    try:
        raw = tomllib.loads(text).get("variant")
    except tomllib.TOMLDecodeError:
        raw = None
    want = [
        (v.diff, str(v.since), str(v.until) if v.until else None, v.skip) for v in patch.variants
    ]
    got = (
        [
            (str(r.get("diff", "")), r.get("since"), r.get("until"), r.get("skip", False))
            for r in raw
        ]
        if isinstance(raw, list) and all(isinstance(r, dict) for r in raw)
        else None
    )
    if got != want:
        raise UsageError(
            f"{patch.folder / 'patch.toml'}: export cannot update its variants in place; write "
            'each as a [[variant]] table with diff/since/until as "..." strings, then export '
            "again (nothing was written)"
        )


def _skip_key(since: re.Match[str] | None) -> str:
    """A block without a diff (a skip range) is known by where it starts."""
    return f"skip@{since['value'] if since else ''}"
