"""AMD compile gate: every Triton kernel under ``megatron_rocm.runtime``, compiled on the CPU for
gfx942 (MI300X/MI325X), gfx950 (MI355X) and gfx90a (MI250X) with the launches its planner picks.

No AMD GPU runs in CI; the PyPI Triton wheel carries the AMD backend, so a kernel that cannot
compile for AMD, or whose LDS, scratch or wave count would fail or crawl there, fails here.
Kernels are found by walking the modules (:func:`aot.discover`), so a new kernel is covered by
construction; its module must declare ``aot_configs(shapes)`` (``runtime/kernels/aot.py``).
Planners run with ``torch.version.hip`` set, so they take their AMD branch.

Compiled objects are cached by Triton in ``$MEGATRON_ROCM_TEST_CACHE/triton`` (or
``~/.cache/megatron-rocm-tests/triton``), so a second run takes seconds.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import cache_paths  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from megatron_rocm.runtime.kernels import aot  # noqa: E402

pytestmark = [
    pytest.mark.amd_gate,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1",
        reason="TRITON_INTERPRET=1 replaces compiled kernels with interpreted ones",
    ),
    pytest.mark.skipif(  # CI's PyPI wheel has it: there the gate must run, not skip
        importlib.util.find_spec("triton.backends.amd") is None and not os.environ.get("CI"),
        reason="this Triton build has no AMD backend",
    ),
]


@pytest.fixture(scope="module")
def hip_launches() -> tuple[aot.Found, list[aot.Launch]]:
    """Every discovered kernel and every launch its planner picks on ROCm."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.version, "hip", "7.1.0", raising=False)
        found = aot.discover()
        return found, aot.collect(found, aot.Shapes())


@pytest.fixture(scope="module")
def compiled(hip_launches: tuple[aot.Found, list[aot.Launch]]) -> dict:
    """One compile per distinct launch and arch, shared by the tests (in cpu_count processes)."""
    cache: dict = {}
    reps = aot.representatives(hip_launches[1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(cache_paths.DOWNLOAD_CACHE / "triton"))
        aot.compile_all(reps, aot.ARCHS, cache, workers=os.cpu_count() or 1)
    return cache


def test_kernels_are_discovered_and_every_module_has_a_hook(
    hip_launches: tuple[aot.Found, list[aot.Launch]],
) -> None:
    found, launches = hip_launches
    names = {f.__name__ for fns in found.kernels.values() for f in fns}
    assert {"_rope_kernel", "_fwd_rows", "_backward", "_wgrad_kernel", "_row_grad"} <= names
    assert aot.missing_hooks(found) == []


def test_every_kernel_is_launched_or_called_by_one(
    hip_launches: tuple[aot.Found, list[aot.Launch]],
) -> None:
    """A kernel no hook launches is not covered: it must appear in some module's launches, or
    be a device function called from one."""
    found, launches = hip_launches
    launched = {id(s.kernel) for s in launches}
    for module, fns in found.kernels.items():
        entry = [f for f in fns if id(f) in launched]
        called = aot.device_functions(entry, fns)
        loose = [f.__name__ for f in fns if id(f) not in launched and f.__name__ not in called]
        assert not loose, f"{module}: {loose} not in {aot.HOOK}'s launches"


def test_planners_pick_power_of_two_blocks_and_grids_within_limits(
    hip_launches: tuple[aot.Found, list[aot.Launch]],
) -> None:
    """A property of every planner over the whole shape range (no compile needed)."""
    problems = [p for s in hip_launches[1] for p in aot.grid_problems(s) + aot.arange_problems(s)]
    assert problems == [], "\n".join(problems[:20])


def test_nvidia_planners_too() -> None:
    """The same property with the NVIDIA branch of the planners (32-wide warps)."""
    found = aot.discover()
    launches = aot.collect(found, aot.Shapes())
    problems = [p for s in launches for p in aot.grid_problems(s) + aot.arange_problems(s)]
    assert problems == [], "\n".join(problems[:20])


@pytest.mark.slow
@pytest.mark.full  # minutes of compiling on 2 cores: .ci/run's full tier runs it
def test_every_kernel_compiles_for_amd_within_lds_and_without_spills(
    hip_launches: tuple[aot.Found, list[aot.Launch]], compiled: dict
) -> None:
    problems = aot.gate(aot.representatives(hip_launches[1]), aot.ARCHS, compiled)
    assert problems == [], "\n".join(problems)


# -- the gate catches what it is for (mutations) -----------------------------------------------


@triton.jit
def _copy(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _lds_hog(x, y, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    a = tl.load(x + r[:, None] * BLOCK + r[None, :])
    tl.store(y + r[:, None] * BLOCK + r[None, :], tl.dot(a, a))


def _copy_launch(block: int) -> aot.Launch:
    return aot.launch(_copy, dict(BLOCK=block), ptrs=dict(x="fp32", y="fp32"), num_warps=4)


def test_gate_passes_a_sound_kernel() -> None:
    assert aot.gate([_copy_launch(1024)], ["gfx942"]) == []


def test_gate_fails_a_non_power_of_two_block() -> None:
    problems = aot.gate([_copy_launch(12)], ["gfx942"])
    assert any("BLOCK=12 is not a power of two" in p for p in problems), problems
    assert any("does not compile" in p and "power of 2" in p for p in problems), problems


def test_gate_fails_lds_over_ninety_percent_and_too_many_waves() -> None:
    big = aot.launch(_lds_hog, dict(BLOCK=128), ptrs=dict(x="fp32", y="fp32"), num_warps=4)
    problems = aot.gate([big], ["gfx942"])
    assert any("LDS" in p for p in problems), problems
    waves = aot.launch(_copy, dict(BLOCK=4096), ptrs=dict(x="fp32", y="fp32"), num_warps=32)
    assert any("waves" in p or "does not compile" in p for p in aot.gate([waves], ["gfx942"]))


def test_gate_fails_scratch_only_for_model_shapes() -> None:
    spill = aot.Result(shared=0, scratch=740, num_warps=16)
    spec = _copy_launch(1024)
    assert aot.problems_of(spec, "gfx942", spill)
    wide = aot.launch(
        _copy, dict(BLOCK=1024), ptrs=dict(x="fp32", y="fp32"), num_warps=4, model_shape=False
    )
    assert aot.problems_of(wide, "gfx942", spill) == []


def test_gate_fails_grids_past_the_limits() -> None:
    ok = aot.launch(_copy, dict(BLOCK=16), ptrs=dict(x="fp32"), num_warps=1, grid=(2**31 - 1, 1))
    assert aot.grid_problems(ok) == []
    for grid in ((2**31, 1), (1, 65536), (1, 1, 65536), (0,)):
        bad = aot.launch(_copy, dict(BLOCK=16), ptrs=dict(x="fp32"), num_warps=1, grid=grid)
        assert aot.grid_problems(bad), grid


def test_a_kernel_module_without_a_hook_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("fake_kernels")
    monkeypatch.setitem(sys.modules, "fake_kernels", module)
    found = aot.Found({"fake_kernels": [_copy]}, {"needs_megatron": "ModuleNotFoundError"})
    problems = aot.missing_hooks(found)
    assert any("fake_kernels" in p and "aot_configs" in p for p in problems)
    assert any("needs_megatron" in p for p in problems)
    module.aot_configs = lambda shapes: []
    assert aot.missing_hooks(aot.Found({"fake_kernels": [_copy]}, {})) == []
