"""New-CUDA-surface scan: NVIDIA-only imports, tools and options in upstream no patch covers.

Why: a new upstream tag rarely breaks a patch outright; it adds a fresh ``import apex`` or a
new NCCL-only flag in a file we never patched, and ROCm users find it at run time. One
``git grep -F`` over every selected tree (no checkout) finds candidate lines; Python rules then
decide which are findings, whether an import is optional (inside ``try``/``TYPE_CHECKING``),
and whether the series covers it. Comparing each tag with the previous one shows new
findings the day they land.

Deliberately *not* flagged: ``torch.cuda`` (HIP maps it), Triton, ``flash_attn``, ``mamba_ssm``
and ``causal_conv1d`` (ROCm ships ports under the same names), ``cupy`` and ``tilelang``
(ROCm builds exist), Megatron's own ``megatron.core.nccl_allocator`` module (its NCCL-only
parts are behind ``--nccl-ub``, flagged as an option), and anything inside a docstring. An
import under ``try``, ``TYPE_CHECKING`` or an ``if HAVE_<LIB>:`` flag is optional (guarded).
See docs/matrix.md.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rocm.patchtool import gitcmd

SCAN_PATHS = ("megatron/",)
_IMPORT = r"(?:^\s*(?:from|import)\s+|import_module\(\s*['\"])"

# Status of a finding, best first. "in-patched-file": a patch edits the file but none of its
# hunks names the symbol (weak coverage, shown but not counted as uncovered).
COVERED, IN_PATCHED_FILE, GUARDED, UNCOVERED = "covered", "in-patched-file", "guarded", "uncovered"
STATUSES = (COVERED, IN_PATCHED_FILE, GUARDED, UNCOVERED)


@dataclass(frozen=True)
class Rule:
    id: str
    title: str  # what it is and why it cannot work on ROCm
    keywords: tuple[str, ...]  # fixed strings for the git grep prefilter
    patterns: tuple[re.Pattern[str], ...]  # each has a group named "symbol"
    is_import: bool = True  # imports can be optional: guard analysis applies


def _rx(*parts: str) -> tuple[re.Pattern[str], ...]:
    return tuple(re.compile(p) for p in parts)


NVIDIA_LIBS = (
    "nvidia_resiliency_ext",
    "pynvml",
    "modelopt",
    "tensorrt_llm",
    "flashinfer",
    "flash_mla",
    "deep_ep",
    "deep_gemm",
    "nvshmem",
    "cudnn",
    "cutlass",
    "nvidia_kitchen",
    "grouped_gemm",
    "fast_hadamard_transform",
)

RULES: tuple[Rule, ...] = (
    Rule(
        "apex",
        "NVIDIA Apex (not built for ROCm PyTorch installs)",
        ("apex",),
        _rx(_IMPORT + r"(?P<symbol>apex)\b"),
    ),
    Rule(
        "apex-extension",
        "Apex CUDA extension module (amp_C, *_cuda)",
        ("amp_C", "_cuda"),
        _rx(
            _IMPORT + r"(?P<symbol>amp_C|\w+_cuda)\b",
            r"^\s*from\s+[\w.]+\s+import\s+.*?\b(?P<symbol>amp_C)\b",
        ),
    ),
    Rule(
        "transformer-engine",
        "NVIDIA TransformerEngine",
        ("transformer_engine",),
        _rx(_IMPORT + r"(?P<symbol>transformer_engine\w*)\b"),
    ),
    Rule(
        "nvidia-library",
        "NVIDIA-only Python package (CUDA/NVML/NVSHMEM/TensorRT builds)",
        (*NVIDIA_LIBS, "import cuda", "from cuda"),
        _rx(_IMPORT + r"(?P<symbol>" + "|".join(NVIDIA_LIBS) + r"|cuda(?=[.\s]))\b"),
    ),
    Rule(
        "cuda-toolchain",
        "CUDA toolchain at run time (nvcc, CUDA_HOME; None on ROCm)",
        ("nvcc", "CUDA_HOME"),
        _rx(r"\b(?P<symbol>CUDA_HOME|nvcc)\b"),
        is_import=False,
    ),
    Rule(
        "nccl-option",
        "NCCL/NVIDIA-only command-line option",
        ("--nccl-", "sharp", "--tp-comm-", "nvls", "symm"),
        _rx(
            r"['\"](?P<symbol>--(?:nccl-ub|use-sharp|sharp-enabled-group"
            r"|nccl-communicator-config-path|tp-comm-overlap[\w-]*|[\w-]*nvls[\w-]*"
            r"|[\w-]*symm(?:etric)?-[\w-]*))['\"]"
        ),
        is_import=False,
    ),
    Rule(
        "nccl-allocator",
        "a third-party NCCL user-buffer allocator (builds against nccl.h, ncclMemAlloc)",
        ("nccl_allocator",),
        _rx(  # Megatron's own module (megatron.*, relative imports) is not third-party
            _IMPORT + r"(?!megatron\b|\.)[\w.]*?(?P<symbol>nccl_allocator)\b",
            r"^\s*from\s+(?!megatron\b|\.)[\w.]+\s+import\s+.*?\b(?P<symbol>nccl_allocator)\b",
        ),
    ),
    Rule(
        "nvls-symmetric-memory",
        "NVLS multicast / symmetric memory (NVSwitch)",
        ("_symmetric_memory",),
        _rx(
            _IMPORT + r"torch\.distributed\.(?P<symbol>_symmetric_memory)\b",
            r"^\s*from\s+torch\.distributed\s+import\s+.*?(?P<symbol>_symmetric_memory)\b",
        ),
    ),
    Rule(
        "ptx-asm",
        "inline PTX assembly in Triton kernels (NVIDIA ISA)",
        ("inline_asm",),
        _rx(r"\b(?P<symbol>inline_asm_elementwise)\b"),
        is_import=False,
    ),
)


@dataclass
class Finding:
    rule: str
    path: str
    line: int
    text: str  # the source line, stripped
    symbol: str  # the token a covering hunk must mention
    status: str = UNCOVERED
    patch: str = ""  # the covering patch, when there is one

    @property
    def key(self) -> tuple[str, str, str]:
        """Identity across tags: line numbers drift and lines get reformatted; the file, the
        rule and the symbol stay (see ``_diff``)."""
        return (self.rule, self.path, self.symbol)


@dataclass
class RefSurface:
    ref: str
    findings: list[Finding] = field(default_factory=list)
    new: list[Finding] = field(default_factory=list)  # uncovered, absent at the previous ref
    gone: int = 0  # findings of the previous ref no longer present
    previous: str | None = None

    @property
    def uncovered(self) -> list[Finding]:
        return [f for f in self.findings if f.status == UNCOVERED]

    def counts(self) -> dict[str, int]:
        return {s: sum(f.status == s for f in self.findings) for s in STATUSES}


@dataclass
class SurfaceReport:
    refs: list[RefSurface]

    def get(self, ref: str) -> RefSurface | None:
        return next((r for r in self.refs if r.ref == ref), None)


# Coverage of one ref: path -> [(patch id, hunk text)] for the variants used at that ref.
Coverage = Mapping[str, Sequence[tuple[str, str]]]


def prefilter_keywords() -> list[str]:
    """The rules' fixed strings, minus those that contain another (git grep cost ~ count)."""
    kws = {k for r in RULES for k in r.keywords}
    return sorted(k for k in kws if not any(o != k and o in k for o in kws))


class GrepJob:
    """List the trees and grep every distinct blob once, in a thread started early.

    Why blobs and not trees: consecutive tags share most files, so grepping each distinct
    blob once (and matching its lines once) does a fraction of the work of grepping every
    tree; the job runs while the engine checks the refs.
    """

    CHUNK = 1000  # blob ids per git grep call (keeps the command line short)

    def __init__(self, repo: Path, commits: Sequence[str]) -> None:
        self.repo = repo
        self.commits = list(dict.fromkeys(commits))
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._future = self._pool.submit(self._run)

    def _run(self) -> tuple[dict[str, list[tuple[str, str]]], dict[str, list[tuple[int, str]]]]:
        trees: dict[str, list[tuple[str, str]]] = {}
        for commit in self.commits:
            out = gitcmd.git(
                "ls-tree", "-r", "-z", "--full-tree", commit, "--", *SCAN_PATHS, cwd=self.repo
            )
            entries = []
            for item in out.decode("utf-8", errors="surrogateescape").split("\0"):
                meta, _, path = item.partition("\t")
                parts = meta.split()
                if len(parts) == 3 and parts[1] == "blob" and parts[0] != "120000":
                    entries.append((path, parts[2]))
            trees[commit] = entries
        oids = sorted({oid for entries in trees.values() for _, oid in entries})
        args = ["grep", "-F", "-n", "-I", "-z", "--no-color"]
        for kw in prefilter_keywords():
            args += ["-e", kw]
        # git grep matches patterns one by one on one core: split the blobs over the cores.
        workers = max(1, min(4, os.cpu_count() or 1))
        size = max(1, min(self.CHUNK, -(-len(oids) // workers)))
        chunks = [oids[i : i + size] for i in range(0, len(oids), size)]
        hits: dict[str, list[tuple[int, str]]] = {}
        with ThreadPoolExecutor(max_workers=workers) as pool:
            outs = pool.map(lambda c: gitcmd.git(*args, *c, cwd=self.repo, check=False), chunks)
            for out in outs:
                for raw in out.decode("utf-8", errors="replace").split("\n"):
                    parts = raw.split("\0", 2)
                    if len(parts) == 3 and parts[1].isdigit():
                        hits.setdefault(parts[0], []).append((int(parts[1]), parts[2]))
        return trees, hits

    def result(self) -> tuple[dict[str, list[tuple[str, str]]], dict[str, list[tuple[int, str]]]]:
        """(commit -> [(path, blob id)], blob id -> [(line number, text)])."""
        try:
            return self._future.result()
        finally:
            self._pool.shutdown()


def match_line(text: str) -> tuple[Rule, str] | None:
    """The first rule (in RULES order) one source line triggers, and its symbol.

    One finding per line: ``import apex.contrib.nccl_allocator`` is an Apex import first.
    Comments never count.
    """
    if text.lstrip().startswith("#"):
        return None
    for rule in RULES:
        for rx in rule.patterns:
            m = rx.search(text)
            if m and "#" not in text[: m.start()]:
                return rule, m.group("symbol")
    return None


_HEADER = re.compile(r"^\s*(try|except\b[^:]*|if\s+(?:typing\.)?TYPE_CHECKING)\s*:")
# ``if HAVE_TE:`` / ``elif HAVE_APEX and ...:``: the block runs only when the library is there.
_HAVE = re.compile(r"^\s*(?:el)?if\b(?![^#:]*\bnot\s+HAVE_)[^#:]*\bHAVE_[A-Z0-9_]+\b[^#]*:")
_SCOPE = re.compile(r"^\s*(?:async\s+)?(?:def|class)\s")


def is_guarded(lines: Sequence[str], index: int) -> bool:
    """Is line ``index`` (0-based) an optional import?

    Optional: inside ``try``/``except`` or ``if TYPE_CHECKING`` within the same function, or
    anywhere below an ``if HAVE_<LIB>:`` flag. Walks the enclosing blocks by indentation: an
    import in a function body runs whenever the function does, so a ``try`` outside the
    function does not protect it; but a function defined under ``if HAVE_TE:`` exists only
    when TE does.
    """
    indent = len(lines[index]) - len(lines[index].lstrip())
    crossed_scope = False
    for i in range(index - 1, -1, -1):
        text = lines[i]
        stripped = text.strip()
        if not stripped or stripped.startswith("#"):
            continue
        own = len(text) - len(text.lstrip())
        if own >= indent:
            continue
        if _HAVE.match(text) or (not crossed_scope and _HEADER.match(text)):
            return True
        crossed_scope = crossed_scope or bool(_SCOPE.match(text))
        if own == 0:
            return False
        indent = own
    return False


_TRIPLE = re.compile(r"\"\"\"|\'\'\'")
_DOC_OPEN = re.compile(r"^\s*[rRuU]?$")


def docstring_lines(lines: Sequence[str], last: int) -> set[int]:
    """1-based numbers of the lines up to ``last`` that lie in a docstring (a triple-quoted
    string that is a statement of its own: text there is prose, never code).

    A line scanner, not a parser: a few milliseconds per file where ``ast`` takes tens, and
    the matrix reads hundreds of files. Triple quotes inside one-line strings are rare
    enough in Megatron to ignore.
    """
    out: set[int] = set()
    inside: str | None = None
    doc = False
    for no, line in enumerate(lines[:last], 1):
        pos = 0
        while True:
            if inside is None:
                m = _TRIPLE.search(line, pos)
                if m is None or "#" in line[pos : m.start()]:
                    break
                doc = pos == 0 and bool(_DOC_OPEN.match(line[: m.start()]))
                inside, pos = m.group(), m.end()
                if doc:
                    out.add(no)
                continue
            if doc:
                out.add(no)
            end = line.find(inside, pos)
            if end < 0:
                break
            inside, pos = None, end + 3
    return out


def _spellings(symbol: str) -> tuple[str, ...]:
    """A flag is also named by its attribute: ``--nccl-ub`` is ``args.nccl_ub`` in a hunk."""
    if symbol.startswith("--"):
        return (symbol, symbol[2:].replace("-", "_"))
    return (symbol,)


def _coverage_status(f: Finding, coverage: Coverage) -> tuple[str, str]:
    hunks = coverage.get(f.path, ())
    names = _spellings(f.symbol)
    for patch_id, text in hunks:
        if any(n in text for n in names):
            return COVERED, patch_id
    if hunks:
        return IN_PATCHED_FILE, hunks[0][0]
    return "", ""


def scan(
    repo: Path,
    refs: Sequence[tuple[str, str]],
    coverage: Mapping[str, Coverage],
    job: GrepJob | None = None,
) -> SurfaceReport:
    """Scan ``refs`` ((name, commit), in version order); ``coverage`` is keyed by ref name."""
    job = job or GrepJob(repo, [c for _, c in refs])
    trees, hits = job.result()
    per_blob = _blob_findings(repo, hits)
    report = SurfaceReport(refs=[])
    prev: RefSurface | None = None
    for name, commit in refs:
        cov = coverage.get(name, {})
        rs = RefSurface(ref=name, previous=prev.ref if prev else None)
        for path, oid in trees.get(commit, []):
            for rule, line, text, symbol, guarded in per_blob.get(oid, ()):
                f = Finding(rule, path, line, text, symbol, GUARDED if guarded else UNCOVERED)
                status, patch = _coverage_status(f, cov)
                if status:
                    f.status, f.patch = status, patch
                rs.findings.append(f)
        if prev is not None:
            rs.new, rs.gone = _diff(prev.findings, rs.findings)
        report.refs.append(rs)
        prev = rs
    return report


def _diff(before: list[Finding], after: list[Finding]) -> tuple[list[Finding], int]:
    """(new uncovered findings, number gone): per (rule, path, symbol), only a rise in the
    count is new, and the lines whose text was not there before are the ones reported."""
    old_count = Counter(f.key for f in before)
    new_count = Counter(f.key for f in after)
    old_text = {(f.key, f.text) for f in before}
    new: list[Finding] = []
    for key, n in new_count.items():
        extra = n - old_count.get(key, 0)
        if extra <= 0:
            continue
        same = [f for f in after if f.key == key]
        same.sort(key=lambda f: (f.key, f.text) in old_text)  # unseen text first
        new += [f for f in same[:extra] if f.status == UNCOVERED]
    new.sort(key=lambda f: (f.path, f.line))
    gone = sum(max(0, n - new_count.get(k, 0)) for k, n in old_count.items())
    return new, gone


def _blob_findings(
    repo: Path, hits: Mapping[str, list[tuple[int, str]]]
) -> dict[str, list[tuple[str, int, str, str, bool]]]:
    """blob id -> [(rule, line, text, symbol, guarded)]; a blob with a candidate line is read
    to drop lines inside docstrings and to judge guards."""
    import_rules = {r.id for r in RULES if r.is_import}
    out: dict[str, list[tuple[str, int, str, str, bool]]] = {}
    with gitcmd.CatFile(repo) as cat:
        for oid, rows in hits.items():
            candidates = [(line, text, hit) for line, text in rows if (hit := match_line(text))]
            if not candidates:
                continue
            data = cat.read(oid) or b""
            lines = data.decode("utf-8", errors="replace").splitlines()
            prose = docstring_lines(lines, max(line for line, _, _ in candidates))
            found = []
            for line, text, (rule, symbol) in candidates:
                if line in prose:
                    continue
                guarded = (
                    rule.id in import_rules
                    and 0 < line <= len(lines)
                    and is_guarded(lines, line - 1)
                )
                found.append((rule.id, line, text.strip(), symbol, guarded))
            if found:
                out[oid] = found
    return out
