"""Install a patched Megatron-LM tree into the current environment without touching torch.

Planning is pure (``plan``: read the tree and the environment, decide the steps); ``execute``
runs them. The guards: every pip call carries a constraints file pinning the installed torch
(and its companions) to their exact versions, the tree itself goes in with ``--no-deps``, its
declared dependencies are installed explicitly and refused when they are NVIDIA-only, and a
failed run uninstalls what it installed (judged by ``pip list`` before and after).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name

from megatron_rocm.envtools import rocm_support
from megatron_rocm.errors import FatalError, Interrupted, SourceError, UsageError
from megatron_rocm.patchtool import interrupts, refnames

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # holds pyproject.toml in a source checkout
# Installed packages that must keep their exact version: replacing any of them swaps the
# user's ROCm PyTorch for a CUDA wheel (or breaks its Triton).
PINNED = ("torch", "torchvision", "torchaudio", "triton", "pytorch-triton-rocm", "pytorch-triton")
ROCM_TORCH = rocm_support.ROCM_TORCH_HINT
NVIDIA_ONLY = re.compile(r"^(apex|transformer-engine.*|nvidia-.*|nv-.*|cupy-cuda.*|flashinfer.*)$")

Runner = Callable[[Sequence[str]], subprocess.CompletedProcess]


@dataclass
class Step:
    title: str
    argv: list[str] | None = None  # a command, or None for a step done in-process
    kind: str = "pip"  # pip | helpers | verify


@dataclass
class Plan:
    tree: Path
    editable: bool
    torch: str
    pins: dict[str, str]
    deps: list[str]
    build_isolation: bool
    helpers: Path | None
    install_self: bool
    constraints: Path
    steps: list[Step] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "tree": str(self.tree),
            "editable": self.editable,
            "torch": self.torch,
            "pins": self.pins,
            "deps": self.deps,
            "build_isolation": self.build_isolation,
            "helpers": str(self.helpers) if self.helpers else None,
            "install_self": self.install_self,
            "constraints": str(self.constraints),
            "steps": [{"title": s.title, "argv": s.argv} for s in self.steps],
        }


def megatron_tree(path: str | Path) -> Path:
    """The tree's root, or UsageError: both install and smoke need a real Megatron-LM tree."""
    root = refnames.user_path(path, "tree")
    if not (root / "megatron" / "core" / "package_info.py").is_file():
        raise UsageError(
            f"{root} is not a Megatron-LM tree (no megatron/core/package_info.py); "
            "pass the patched checkout made by `megatron-rocm apply`"
        )
    return root


def installed() -> dict[str, str]:
    """Canonical name -> version of every distribution visible to this interpreter."""
    return {
        canonicalize_name(d.metadata["Name"]): d.version
        for d in md.distributions()
        if d.metadata["Name"]
    }


def _read_toml(path: Path) -> dict:
    """The parsed file, or {} when absent. A malformed file is the tree's fault (UsageError
    naming it), never a traceback: install and smoke both read the tree's pyproject.toml."""
    if not path.is_file():
        return {}
    if tomllib is None:
        raise SourceError("reading pyproject.toml needs Python 3.11+ (or `pip install tomli`)")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: malformed TOML ({e})") from None
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror}") from None


def _table(doc: dict, key: str, path: Path) -> dict:
    """``doc[key]`` as a table ({} when absent): a string or a number there must not reach
    ``.get`` as an AttributeError."""
    value = doc.get(key, {})
    if not isinstance(value, dict):
        raise UsageError(f"{path}: [{key}] must be a table, not {type(value).__name__}")
    return value


def _strings(table: dict, key: str, where: str, path: Path) -> list[str]:
    """``table[key]`` as a list of strings ([] when absent). A bare string is refused, not
    iterated: ``dependencies = "numpy"`` would otherwise become pip install n u m p y."""
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageError(f"{path}: [{where}] {key} must be a list of strings")
    return value


def _pyproject(tree: Path) -> tuple[dict, Path]:
    """The tree's pyproject.toml (parsed, possibly empty) and its path, for messages."""
    path = tree / "pyproject.toml"
    return _read_toml(path), path


def _read_requirements_txt(path: Path) -> list[str]:
    """The requirement lines of a setup.py-era ``requirements.txt``, UsageError if unreadable."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text ({e})") from None
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror}") from None
    return _requirement_lines(text.splitlines())


def _requirement_lines(lines: Sequence[str]) -> list[str]:
    out = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            out.append(line)
    return out


def tree_requirements(tree: Path) -> list[str]:
    """Runtime dependencies megatron-core declares (static pyproject, else core/requirements)."""
    doc, path = _pyproject(tree)
    project = _table(doc, "project", path)
    dynamic = _strings(project, "dynamic", "project", path)
    if "dependencies" in project and "dependencies" not in dynamic:
        return list(_strings(project, "dependencies", "project", path))
    req = tree / "megatron" / "core" / "requirements.txt"  # setup.py-era trees (<= 0.13)
    return _read_requirements_txt(req) if req.is_file() else []


# Imported by megatron.training / pretrain_gpt.py but declared by no megatron-core release
# (NVIDIA's containers ship them); found by importing core_v0.12-0.16 trees in a bare venv.
TRAINING_RUNTIME = ("six", "regex", "pyyaml", "pydantic", "nltk", "psutil", "einops")


def training_requirements(have: dict[str, str]) -> list[str]:
    """The training-side imports that are not installed yet."""
    return [name for name in TRAINING_RUNTIME if canonicalize_name(name) not in have]


def build_requirements(tree: Path) -> list[Requirement]:
    """``[build-system] requires``, parsed: a malformed entry names the file (UsageError)."""
    doc, path = _pyproject(tree)
    texts = _strings(_table(doc, "build-system", path), "requires", "build-system", path)
    try:
        return [Requirement(text) for text in texts]
    except InvalidRequirement as e:
        raise UsageError(f"{path}: [build-system] requires has an unreadable entry ({e})") from None


def _satisfied(req: Requirement, have: dict[str, str]) -> bool:
    version = have.get(canonicalize_name(req.name))
    return version is not None and req.specifier.contains(version, prereleases=True)


def filter_deps(reqs: Sequence[str], have: dict[str, str], torch: str) -> list[str]:
    """Drop torch (checked, never installed) and deps whose markers exclude this platform;
    refuse NVIDIA-only packages and a torch requirement the installed torch does not meet."""
    keep, refused = [], []
    for text in reqs:
        try:
            req = Requirement(text)
        except InvalidRequirement as e:
            raise UsageError(f"the tree declares an unreadable requirement {text!r}: {e}") from e
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = canonicalize_name(req.name)
        if name == "torch":
            public = torch.split("+")[0]  # a pin may name the build (==2.13.0+rocm6.4) or not
            if not any(req.specifier.contains(v, prereleases=True) for v in (torch, public)):
                raise SourceError(
                    f"the tree needs {text} but torch {torch} is installed; "
                    f"install a matching ROCm build: {ROCM_TORCH}"
                )
            continue
        if name == "megatron-rocm":
            continue  # installed from this package, never from an index (see plan())
        if NVIDIA_ONLY.match(name):
            refused.append(text)
        else:
            keep.append(text)
    if refused:
        raise SourceError(
            f"the tree requires NVIDIA-only packages ({', '.join(refused)}); "
            "they cannot work on ROCm. Fix the tree's dependencies (a patch) first"
        )
    return keep


def check_python(tree: Path) -> None:
    """Refuse before any step when the tree's ``requires-python`` excludes this interpreter
    (megatron-core 0.17+ needs Python 3.12): pip would only say so after the helpers build,
    and ``smoke`` would fail on a raw ImportError. Shared by ``install`` and ``smoke``."""
    doc, path = _pyproject(tree)
    spec = _table(doc, "project", path).get("requires-python")
    if spec is None or spec == "":
        return
    if not isinstance(spec, str):
        raise UsageError(f"{path}: [project] requires-python must be a string")
    try:
        specifiers = SpecifierSet(spec)
    except InvalidSpecifier as e:
        raise UsageError(
            f"{path}: [project] requires-python is not a version range ({e})"
        ) from None
    here = ".".join(str(n) for n in sys.version_info[:3])
    if not specifiers.contains(here, prereleases=True):
        raise SourceError(
            f"this Megatron-LM tree requires Python {spec}, but this is Python {here}; "
            "use a matching interpreter (and its ROCm PyTorch), or apply a release this Python "
            "runs (megatron-rocm apply --ref <tag>; core_v0.16.x on 3.11)"
        )


def _needs_isolation(project: Path, have: dict[str, str]) -> bool:
    """Build isolation only when the build backend is missing: without it an install works on
    an offline machine (pip would otherwise fetch setuptools into a fresh build env)."""
    needs = build_requirements(project)
    if not all(_satisfied(r, have) for r in needs):
        return True
    # setuptools before 70.1 builds wheels only with the separate `wheel` package
    old_setuptools = any(r.name == "setuptools" for r in needs) and not _satisfied(
        Requirement("setuptools>=70.1"), have
    )
    return old_setuptools and "wheel" not in have


def _isolation_args(project: Path, have: dict[str, str]) -> list[str]:
    return [] if _needs_isolation(project, have) else ["--no-build-isolation"]


def pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", *args]


def plan(
    tree_dir: str | Path, editable: bool, workdir: Path, have: dict[str, str] | None = None
) -> Plan:
    """Decide every step without changing anything (``--dry-run`` prints exactly this)."""
    tree = megatron_tree(tree_dir)
    have = installed() if have is None else have
    if "torch" not in have:
        raise SourceError(
            f"torch is not installed; install the ROCm build of PyTorch first: "
            f"{ROCM_TORCH} (torch {rocm_support.VALIDATED_TORCH[0]}+; docs/rocm.md)"
        )
    check_python(tree)
    pins = {n: have[n] for n in PINNED if n in have}
    deps = filter_deps(tree_requirements(tree), have, have["torch"])
    deps += [d for d in training_requirements(have) if d not in deps]
    helpers = tree / "megatron" / "core" / "datasets" / "helpers.cpp"
    helpers = helpers if helpers.is_file() else None
    if helpers is not None and "pybind11" not in have:
        deps.append("pybind11")
    isolation = _needs_isolation(tree, have)
    p = Plan(
        tree,
        editable,
        have["torch"],
        pins,
        deps,
        isolation,
        helpers,
        "megatron-rocm" not in have and (PACKAGE_ROOT / "pyproject.toml").is_file(),
        workdir / "constraints.txt",
    )
    c = ["-c", str(p.constraints)]
    # megatron-rocm first, from this package: the patched tree declares it, and pip must never
    # resolve that name from an index (it is not published there; a squatter could be).
    if p.install_self:
        p.steps.append(
            Step(
                "install megatron-rocm (the kernels the patched tree imports)",
                pip(
                    "install",
                    *c,
                    *_isolation_args(PACKAGE_ROOT, have),
                    *(["-e"] if editable else []),
                    str(PACKAGE_ROOT),
                ),
            )
        )
    if deps:
        p.steps.append(
            Step(f"install the tree's dependencies ({', '.join(deps)})", pip("install", *c, *deps))
        )
    if helpers is not None:
        p.steps.append(Step("build Megatron's C++ dataset helpers (pybind11)", None, "helpers"))
    tree_args = ["install", *c, "--no-deps", *_isolation_args(tree, have)]
    p.steps.append(
        Step(
            f"install the tree ({'editable' if editable else 'regular'}, --no-deps)",
            pip(*tree_args, *(["-e"] if editable else []), str(tree)),
        )
    )
    p.steps.append(Step("verify: megatron.core imports and torch is unchanged", None, "verify"))
    return p


def helpers_target(helpers: Path) -> Path:
    return helpers.with_name("helpers_cpp" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))


def helpers_command(helpers: Path, run: Runner) -> list[str]:
    """What megatron/core/datasets/Makefile does, with this interpreter's pybind11 and suffix."""
    inc = run([sys.executable, "-m", "pybind11", "--includes"])
    if inc.returncode != 0:
        raise RuntimeError(f"pybind11 is not usable: {inc.stdout}{inc.stderr}".strip())
    cxx = shlex.split(os.environ.get("CXX", "")) or ["c++"]  # e.g. CXX="ccache g++"
    return [
        *cxx,
        "-O3",
        "-Wall",
        "-shared",
        "-std=c++17",
        "-fPIC",
        *inc.stdout.split(),
        str(helpers),
        "-o",
        str(helpers_target(helpers)),
    ]


def write_constraints(p: Plan) -> None:
    p.constraints.parent.mkdir(parents=True, exist_ok=True)
    p.constraints.write_text("".join(f"{n}=={v}\n" for n, v in p.pins.items()), encoding="utf-8")


def pip_list(run: Runner) -> dict[str, str]:
    """What pip has installed: name -> version, with `` @ <folder>`` for an editable install
    (so that one moved to another tree of the same version counts as a change)."""
    try:
        res = run(pip("list", "--format=json", "--disable-pip-version-check"))
    except OSError as e:
        raise SourceError(f"cannot run pip ({sys.executable} -m pip): {e.strerror}") from None
    if res.returncode != 0:
        last = (res.stderr or res.stdout or "").strip().splitlines()[-1:] or ["no output"]
        raise SourceError(f"pip cannot list what is installed ({sys.executable} -m pip): {last[0]}")
    return {
        canonicalize_name(d["name"]): d["version"]
        + (f" @ {d['editable_project_location']}" if d.get("editable_project_location") else "")
        for d in json.loads(res.stdout)
    }


def rollback(before: dict[str, str], after: dict[str, str], run: Runner) -> list[str]:
    """Undo this run's pip changes: uninstall new packages, put changed ones back (an editable
    install back in its folder, any other at its version)."""
    done = []
    new = sorted(set(after) - set(before))
    if new and run(pip("uninstall", "-y", *new)).returncode == 0:
        done.append(f"uninstalled {', '.join(new)}")
    for name in sorted(n for n in after if n in before and after[n] != before[n]):
        version, _, folder = before[name].partition(" @ ")
        spec = ["-e", folder] if folder else [f"{name}=={version}"]
        ok = run(pip("install", "--no-deps", "--no-build-isolation", *spec)).returncode == 0
        label = f"{name} {version} (editable, {folder})" if folder else f"{name}=={version}"
        done.append(f"{'restored' if ok else 'COULD NOT restore'} {label}")
    return done


def default_runner(argv: Sequence[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    # cwd=/ so a tree's .python-version or a local "torch" folder cannot change what runs.
    return subprocess.run(list(argv), capture_output=True, text=True, env=env, cwd="/")


def _verify(p: Plan, run: Runner) -> None:
    code = (
        "import importlib.metadata as m, megatron.core as c; "
        "print(m.version('torch')); print(c.__file__)"
    )
    res = run([sys.executable, "-c", code])
    if res.returncode != 0:
        raise RuntimeError(f"import megatron.core failed: {res.stderr.strip().splitlines()[-1:]}")
    torch_now, where = res.stdout.splitlines()[:2]  # a path may hold spaces
    if torch_now != p.torch:
        raise RuntimeError(f"torch changed from {p.torch} to {torch_now}")
    if p.editable and p.tree not in Path(where).resolve().parents:
        raise RuntimeError(f"megatron.core imports from {where}, not from {p.tree}")


def execute(
    p: Plan, run: Runner = default_runner, log: Callable[[str], None] = print
) -> tuple[list[str], list[Path]]:
    """Run the steps; on a failure, or an interrupt, roll back and say what was undone.

    A failed step raises SourceError (exit 3) naming it; Ctrl-C / SIGTERM raise
    ``Interrupted`` with the rollback in its message (further signals wait until the rollback
    is over). Returns the rollback-free outcome: (step titles done, files written into the
    tree)."""
    write_constraints(p)
    before = _pip_snapshot(p, run, "before")
    done: list[str] = []
    built: dict[Path, Path | None] = {}  # file written into the tree -> its copy from before
    n = len(p.steps)
    for k, step in enumerate(p.steps, 1):
        log(f"[{k}/{n}] {step.title}")
        try:
            _run_step(p, step, run, log, built)
        except BaseException as e:  # noqa: BLE001 - a failure or an interrupt: undo, then say
            later = f"interrupted after rolling back step {k}/{n}; logs in {p.constraints.parent}"
            with interrupts.Guard() as guard, guard.deferred(later):
                undone = "; ".join(_undo(p, before, built, run)) or "nothing to undo"
            where = f"rolled back: {undone}; logs in {p.constraints.parent}"
            if isinstance(e, KeyboardInterrupt):
                signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
                raise Interrupted(signum, f"interrupted at step {k}/{n}; {where}") from None
            if not isinstance(e, (RuntimeError, OSError, FatalError)):
                e.add_note(f"install step {k}/{n} ({step.title}); {where}")
                raise  # a bug of ours: the CLI's internal error (exit 4), traceback in its log
            # pip, the compiler or the import check failed: the environment (or the tree
            # given as its source), not a patch, so exit 3, never 1 ("checks failed")
            raise SourceError(f"step {k}/{n} ({step.title}) failed: {e}; {where}") from e
        done.append(step.title)
    _pip_snapshot(p, run, "after")
    return done, list(built)


def _pip_snapshot(p: Plan, run: Runner, when: str) -> dict[str, str]:
    """``pip_list``, also kept as ``pip-list-<when>.json`` beside the constraints file."""
    installed = pip_list(run)
    (p.constraints.parent / f"pip-list-{when}.json").write_text(json.dumps(installed, indent=1))
    return installed


def _run_step(
    p: Plan,
    step: Step,
    run: Runner,
    log: Callable[[str], None],
    built: dict[Path, Path | None],
) -> None:
    if step.kind == "helpers":
        assert p.helpers is not None
        target = helpers_target(p.helpers)
        if target.exists() and target.stat().st_mtime >= p.helpers.stat().st_mtime:
            log(f"      up to date: {target.name}")
            return
        saved = None
        if target.exists():  # a rebuild: keep the working one until this run succeeds
            saved = p.constraints.parent / f"{target.name}.before"
            shutil.copy2(target, saved)
        built[target] = saved
        res = run(helpers_command(p.helpers, run))
        if res.returncode != 0:
            raise _failed(p, res)
    elif step.kind == "verify":
        _verify(p, run)
    else:
        assert step.argv is not None
        res = run(step.argv)
        if res.returncode != 0:
            raise _failed(p, res)


def _undo(
    p: Plan, before: dict[str, str], built: dict[Path, Path | None], run: Runner
) -> list[str]:
    """Put pip's packages and the tree's built files back as they were before the run."""
    undone: list[str] = []
    try:
        undone += rollback(before, _pip_snapshot(p, run, "after"), run)
    except FatalError as e:
        undone.append(f"COULD NOT read pip's state to undo it ({e})")
    for target, saved in built.items():
        if saved is None:
            target.unlink(missing_ok=True)
            undone.append(f"removed {target.name}")
        else:
            shutil.copy2(saved, target)
            undone.append(f"put back the earlier {target.name}")
    return undone


def _failed(p: Plan, res: subprocess.CompletedProcess, lines: int = 6) -> RuntimeError:
    """The failure of a command, its last lines in the message and all of its output kept in
    ``failed-step.log`` beside the constraints file: pip's last lines are often only "see
    above", and the one line the CLI prints has no "above"."""
    text = ((res.stdout or "") + (res.stderr or "")).strip()
    log = p.constraints.parent / "failed-step.log"
    log.write_text(f"$ {shlex.join(res.args)}\n{text}\n", encoding="utf-8")
    tail = " | ".join(text.splitlines()[-lines:])
    return RuntimeError(f"exit {res.returncode}: {tail} (whole output: {log})")
