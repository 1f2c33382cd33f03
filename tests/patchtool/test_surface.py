"""The new-CUDA-surface scan: line rules, optional-import guards, coverage, tag-to-tag diff."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from megatron_rocm.patchtool import gitcmd, surface
from megatron_rocm.patchtool.matrix import build_matrix, select_refs
from megatron_rocm.patchtool.series import load_series


@pytest.mark.parametrize(
    ("line", "rule", "symbol"),
    [
        ("import apex", "apex", "apex"),
        ("    from apex.optimizers import FusedAdam as Adam", "apex", "apex"),
        ("import apex.contrib.nccl_allocator as nccl_allocator", "apex", "apex"),
        ("        import amp_C", "apex-extension", "amp_C"),
        (
            "    import fused_weight_gradient_mlp_cuda",
            "apex-extension",
            "fused_weight_gradient_mlp_cuda",
        ),
        ("from megatron.core.utils import amp_C", "apex-extension", "amp_C"),
        ("import transformer_engine as te", "transformer-engine", "transformer_engine"),
        (
            "import transformer_engine_torch as tex",
            "transformer-engine",
            "transformer_engine_torch",
        ),
        (
            "mod = importlib.import_module('transformer_engine.pytorch')",
            "transformer-engine",
            "transformer_engine",
        ),
        ("from cuda.bindings import runtime", "nvidia-library", "cuda"),
        ("import cuda.cudart as rt", "nvidia-library", "cuda"),
        (
            "    from nvidia_resiliency_ext.inprocess import Wrapper",
            "nvidia-library",
            "nvidia_resiliency_ext",
        ),
        ("import deep_ep", "nvidia-library", "deep_ep"),
        ("home = cpp_extension.CUDA_HOME", "cuda-toolchain", "CUDA_HOME"),
        ('out = subprocess.check_output([cuda_dir + "/bin/nvcc", "-V"])', "cuda-toolchain", "nvcc"),
        ("group.add_argument('--nccl-ub', action='store_true')", "nccl-option", "--nccl-ub"),
        ('group.add_argument("--use-sharp", action="store_true")', "nccl-option", "--use-sharp"),
        (
            "group.add_argument('--tp-comm-overlap-cfg', type=str)",
            "nccl-option",
            "--tp-comm-overlap-cfg",
        ),
        ("import vendor_ub.nccl_allocator as ub", "nccl-allocator", "nccl_allocator"),
        ("from vendor_ub import nccl_allocator", "nccl-allocator", "nccl_allocator"),
        (
            "import torch.distributed._symmetric_memory as symm_mem",
            "nvls-symmetric-memory",
            "_symmetric_memory",
        ),
        ("    tl.inline_asm_elementwise(", "ptx-asm", "inline_asm_elementwise"),
    ],
)
def test_rules_flag_nvidia_only_code(line, rule, symbol):
    hit = surface.match_line(line)
    assert hit is not None and (hit[0].id, hit[1]) == (rule, symbol)


@pytest.mark.parametrize(
    "line",
    [
        "# import apex",
        "x = 1  # needs apex",
        "if tensor.is_cuda:",
        "import cuda_graphs",
        "from torch import cuda",
        "torch.cuda.synchronize()",
        "from flash_attn import flash_attn_func",  # ROCm ships flash_attn: deliberately not flagged
        "import triton",
        "apex_like = 3",
        "from megatron.core.transformer.moe import grouped_gemm_util",
        # Megatron's own module, not NVIDIA surface (its NCCL-only use sits behind --nccl-ub)
        "from megatron.core import mpu, nccl_allocator, tensor_parallel",
        "import megatron.core.nccl_allocator as nccl_allocator",
        "from megatron.core.nccl_allocator import create_nccl_mem_pool",
        "from . import nccl_allocator",
    ],
)
def test_rules_ignore_portable_code_and_comments(line):
    assert surface.match_line(line) is None


def lines(text: str) -> list[str]:
    return text.splitlines()


def test_guard_analysis():
    src = lines(
        "try:\n"
        "    import apex\n"
        "except ImportError:\n"
        "    from megatron.core.fallback import apex\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import transformer_engine\n"
        "import amp_C\n"
        "def f():\n"
        "    import scaled_masked_softmax_cuda\n"
        "try:\n"
        "    def g():\n"
        "        import fused_layer_norm_cuda\n"
        "except Exception:\n"
        "    pass\n"
        "def h():\n"
        "    try:\n"
        "        if True:\n"
        "            import pynvml\n"
        "    except ImportError:\n"
        "        pass\n"
    )
    guarded = {i + 1 for i in range(len(src)) if surface.is_guarded(src, i)}
    assert {2, 4, 7, 19} <= guarded
    assert not guarded & {8, 10, 13}


def test_have_flags_guard_imports_even_inside_functions():
    """``if HAVE_TE:`` runs its block only with TE present; a function defined under it
    exists only then, so its imports are optional too (unlike a try around a def)."""
    src = lines(
        "if HAVE_TE:\n"  # 1
        "    import transformer_engine as te\n"  # 2
        "elif HAVE_APEX and x:\n"  # 3
        "    import apex\n"  # 4
        "else:\n"  # 5
        "    import amp_C\n"  # 6
        "if HAVE_TE and is_te_min_version('2.2'):\n"  # 7
        "    def f():\n"  # 8
        "        from transformer_engine.pytorch import tensor\n"  # 9
        "if not HAVE_TE:\n"  # 10
        "    import transformer_engine\n"  # 11
        "if HAVE_TE or TYPE_CHECKING:\n"  # 12
        "    import transformer_engine as te\n"  # 13
        "class C:\n"  # 14
        "    def g(self):\n"  # 15
        "        if HAVE_TE_GRAPHS:\n"  # 16
        "            from transformer_engine.common import recipe\n"  # 17
    )
    guarded = {i + 1 for i in range(len(src)) if surface.is_guarded(src, i)}
    assert guarded & {2, 4, 6, 9, 11, 13, 17} == {2, 4, 9, 13, 17}


def test_docstring_lines():
    src = lines(
        "def f():\n"  # 1
        '    """Use it like this:\n'  # 2
        "\n"  # 3
        "        import apex.contrib.nccl_allocator as nccl_allocator\n"  # 4
        '    """\n'  # 5
        "    import apex\n"  # 6
        '    SOURCE = """\n'  # 7
        "    #include <nccl.h>\n"  # 8
        '    """\n'  # 9
        '    """One line."""  # --tp-comm-overlap\n'  # 10
        "    x = '--nccl-ub'\n"  # 11
    )
    assert surface.docstring_lines(src, len(src)) == {2, 3, 4, 5, 10}


def test_docstrings_are_not_findings(tmp_path):
    r = tmp_path / "r"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    write(
        r,
        "megatron/core/buf.py",
        'class B:\n    """Example:\n\n        import apex.contrib.nccl_allocator as a\n'
        '        import transformer_engine as te\n    """\n\n    import apex\n',
    )
    git(r, "add", "-A")
    git(r, "commit", "-q", "-m", "x")
    commit = git(r, "rev-parse", "HEAD").strip()
    rs = surface.scan(r, [("t", commit)], {}).refs[0]
    assert [(f.line, f.symbol) for f in rs.findings] == [(8, "apex")]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, check=True, capture_output=True, text=True
    ).stdout


def write(repo: Path, rel: str, text: str) -> None:
    p = repo / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


VERSION = "MAJOR = 0\nMINOR = {}\nPATCH = 0\n"
LAYERS = (
    "import torch\n\n\ndef wgrad(x):\n    import fused_weight_gradient_mlp_cuda\n"
    "    return fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x)\n"
)


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, Path]:
    """Upstream with a guarded and an unguarded import at 0.12; a new NCCL flag at 0.13."""
    r = tmp_path / "up"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    write(r, "megatron/core/package_info.py", VERSION.format(12))
    write(r, "megatron/core/layers.py", LAYERS)
    write(
        r,
        "megatron/core/opt.py",
        "try:\n    from apex.optimizers import FusedAdam\n"
        "except ImportError:\n    FusedAdam = None\n",
    )
    write(r, "megatron/core/clip.py", "import amp_C\n")
    write(r, "megatron/training/args.py", "def add(p):\n    p.add_argument('--lr')\n")
    write(r, "tools/not_scanned.py", "import apex\n")
    git(r, "add", "-A")
    git(r, "commit", "-q", "-m", "0.12")
    git(r, "tag", "core_v0.12.0")
    # the series: one patch replacing the Apex extension import in layers.py
    p = r / "megatron/core/layers.py"
    p.write_text(
        LAYERS.replace(
            "    import fused_weight_gradient_mlp_cuda\n",
            "    from megatron_rocm.runtime.kernels import grad_accum as fused_weight_gradient_mlp_cuda\n",
        )
    )
    diff = subprocess.run(
        ["git", *gitcmd.DIFF_ARGS], cwd=r, check=True, capture_output=True, text=True
    ).stdout
    git(r, "checkout", "--", ".")
    series = tmp_path / "series"
    write(series, "grad/v0.12.diff", diff)
    write(
        series,
        "grad/patch.toml",
        'id = "grad"\nreason = "r"\nupstream = "rocm-only"\n'
        '[[variant]]\ndiff = "v0.12.diff"\nsince = "0.12.0"\n',
    )
    write(series, "series", "grad\n")
    write(r, "megatron/core/package_info.py", VERSION.format(13))
    write(
        r,
        "megatron/training/args.py",
        "def add(p):\n    p.add_argument('--lr')\n    p.add_argument('--nccl-ub')\n",
    )
    write(r, "megatron/core/layers.py", "# moved\n" + LAYERS)
    git(r, "add", "-A")
    git(r, "commit", "-q", "-m", "0.13")
    git(r, "tag", "core_v0.13.0")
    return r, series


def by_path(rs: surface.RefSurface) -> dict[str, str]:
    return {f.path: f.status for f in rs.findings}


def test_scan_statuses_and_new_findings(repo):
    r, series_dir = repo
    m = build_matrix(r, select_refs(r, ["core_v*"]), load_series(series_dir), source="t")
    assert m.surface is not None
    first, second = m.surface.refs
    assert by_path(first) == {
        "megatron/core/layers.py": surface.COVERED,  # a hunk names the extension module
        "megatron/core/opt.py": surface.GUARDED,
        "megatron/core/clip.py": surface.UNCOVERED,
    }
    assert first.new == [] and first.previous is None
    assert [(f.path, f.symbol) for f in second.new] == [("megatron/training/args.py", "--nccl-ub")]
    # layers.py moved a line: the same finding (keyed by rule, file, symbol), not a new one
    assert second.gone == 0
    assert next(f for f in second.findings if f.path.endswith("layers.py")).patch == "grad"


def test_scan_coverage_levels(repo):
    r, _ = repo
    commit = git(r, "rev-parse", "core_v0.12.0^{commit}").strip()
    cov = {
        "core_v0.12.0": {
            "megatron/core/clip.py": [("p", "-import amp_C\n+x\n")],
            "megatron/training/args.py": [("n", "+if args.nccl_ub: fail()\n")],
            "megatron/core/layers.py": [("q", "@@ unrelated hunk\n")],
        }
    }
    rs = surface.scan(r, [("core_v0.12.0", commit)], cov).refs[0]
    assert by_path(rs)["megatron/core/clip.py"] == surface.COVERED
    assert by_path(rs)["megatron/core/layers.py"] == surface.IN_PATCHED_FILE
    assert rs.counts()[surface.UNCOVERED] == 0
    flag = surface.Finding("nccl-option", "megatron/training/args.py", 3, "", "--nccl-ub")
    assert surface._coverage_status(flag, cov["core_v0.12.0"]) == (surface.COVERED, "n")


def test_scan_only_looks_under_megatron(repo):
    r, _ = repo
    commit = git(r, "rev-parse", "core_v0.12.0").strip()
    rs = surface.scan(r, [("t", commit)], {}).refs[0]
    assert all(f.path.startswith("megatron/") for f in rs.findings)
    assert len(rs.findings) == 3
