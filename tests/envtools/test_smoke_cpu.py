"""The smoke suite on CPU: kernel checks pass, injected faults fail them, GPU-only checks skip
with a reason (never pass), and collectives catch a corrupted all_reduce over gloo."""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from megatron_rocm.commands.smoke import smoke
from megatron_rocm.envtools.smoke.catalog import load_checks
from megatron_rocm.envtools.smoke.checks_collectives import run_world
from megatron_rocm.envtools.smoke.runner import FAULT_ENV, CheckFailed
from megatron_rocm.main import main

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def no_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULT_ENV, raising=False)


@pytest.fixture
def fake_tree(tmp_path: Path) -> Path:
    """Enough of a tree to pass the CLI's tree check; GPU-only checks must skip before using it."""
    (tmp_path / "tree/megatron/core").mkdir(parents=True)
    (tmp_path / "tree/megatron/core/package_info.py").write_text("MAJOR, MINOR, PATCH = 0, 16, 0\n")
    return tmp_path / "tree"


def load(path: Path) -> dict[str, dict]:
    return {c["name"]: c for c in json.loads(path.read_text())["checks"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_kernel_checks_pass_on_cpu(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # not a tree: --only kernels must not need one
    out, xml = tmp_path / "r.json", tmp_path / "r.xml"
    assert smoke(".", str(out), str(xml), only=["kernels"]) == 0
    checks = load(out)
    registered = {name for name in load_checks() if name.startswith("kernels.")}
    assert len(registered) >= 11  # softmax x3, norm x2, rope, swiglu, grad_accum, optimizer, ...
    assert set(checks) == registered and {c["status"] for c in checks.values()} == {"pass"}
    assert checks["kernels.swiglu"]["detail"].startswith("8 comparisons")  # 4 widths, fwd + grad
    assert json.loads(out.read_text())["device"] == "cpu"
    assert ET.parse(xml).getroot().get("failures") == "0"


def test_swiglu_check_fails_on_a_wrong_kernel(tmp_path: Path, monkeypatch) -> None:
    """The check compares with its own reference math, so a broken kernel is caught."""
    from megatron_rocm.runtime.kernels import swiglu

    monkeypatch.setattr(swiglu, "forward", lambda y, fallback: fallback(y) * 1.01)
    out = tmp_path / "r.json"
    assert smoke(".", str(out), None, only=["kernels.swiglu"]) == 1
    assert "forward: max abs error" in load(out)["kernels.swiglu"]["detail"]


def test_softmax_fault_makes_the_check_fail(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "softmax")
    out = tmp_path / "r.json"
    assert smoke(".", str(out), None, only=["kernels.softmax", "kernels.rope"]) == 1
    checks = load(out)
    for name in ("kernels.softmax.causal", "kernels.softmax.masked", "kernels.softmax.scaled"):
        assert checks[name]["status"] == "fail"
        assert "forward: max abs error" in checks[name]["detail"]
    assert checks["kernels.rope"]["status"] == "pass"  # the fault is targeted


def test_detail_names_the_path_each_kernel_takes(tmp_path: Path, monkeypatch) -> None:
    """Where Triton would run, a check says so for the kernels that take it, not for LayerNorm
    (on torch's kernel by design) nor for a kernel forced onto its reference path."""
    from megatron_rocm.envtools.smoke.checks_kernels import _path
    from megatron_rocm.runtime.kernels import launch as _runtime

    monkeypatch.setattr(_runtime, "triton_available", lambda: True)
    monkeypatch.setattr(_runtime, "interpreting", lambda: True)
    t = torch.empty(1)
    assert (_path(None, t, "norm"), _path(None, t, None)) == ("triton", "torch native, cpu")
    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "reference:norm")
    assert (_path(None, t, "norm"), _path(None, t, "rope")) == ("torch reference", "triton")
    monkeypatch.delenv("MEGATRON_ROCM_KERNELS")
    out = tmp_path / "r.json"
    assert smoke(".", str(out), None, only=["kernels.norm.layernorm"]) == 0
    assert load(out)["kernels.norm.layernorm"]["detail"].endswith("(torch native, cpu)")


@pytest.mark.parametrize(("user", "inside"), [(None, "RMSNorm"), ("LayerNorm", "LayerNorm")])
def test_norm_check_names_the_default_norms_for_its_small_shapes(
    monkeypatch: pytest.MonkeyPatch, user: str | None, inside: str
) -> None:
    """By default the Triton norm takes only large calls; the smoke check's shapes are small,
    so it names the default norms while it runs (their kernel is what it compares) and puts
    the environment back; a user's own setting is left as it is."""
    from megatron_rocm.envtools.smoke.checks_kernels import _triton_norms_at_every_size
    from megatron_rocm.runtime.kernels import norm

    if user is None:
        monkeypatch.delenv(norm.TRITON_NORMS_ENV, raising=False)
    else:
        monkeypatch.setenv(norm.TRITON_NORMS_ENV, user)
    with _triton_norms_at_every_size(norm):
        assert norm.triton_serves(inside, 15 * 64)
        assert norm.triton_norms() == (inside,)
    assert os.environ.get(norm.TRITON_NORMS_ENV) == user


@pytest.mark.parametrize("before", [None, "", "  "])
def test_norm_check_puts_back_an_empty_setting_as_it_was(
    monkeypatch: pytest.MonkeyPatch, before: str | None
) -> None:
    from megatron_rocm.envtools.smoke.checks_kernels import _triton_norms_at_every_size
    from megatron_rocm.runtime.kernels import norm

    if before is None:
        monkeypatch.delenv(norm.TRITON_NORMS_ENV, raising=False)
    else:
        monkeypatch.setenv(norm.TRITON_NORMS_ENV, before)
    with pytest.raises(RuntimeError):
        with _triton_norms_at_every_size(norm):
            assert norm.triton_norms() == norm.TRITON_NORMS
            raise RuntimeError("a failed comparison")
    assert os.environ.get(norm.TRITON_NORMS_ENV) == before


def test_the_norm_check_runs_its_cases_with_the_default_norms_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check itself, not only the helper: its cases see the default norms named."""
    from megatron_rocm.envtools.smoke import checks_kernels
    from megatron_rocm.runtime.kernels import norm

    monkeypatch.delenv(norm.TRITON_NORMS_ENV, raising=False)
    seen = []
    monkeypatch.setattr(
        checks_kernels,
        "_norm_cases",
        lambda ctx, normalization, k: seen.append(os.environ.get(k.TRITON_NORMS_ENV)) or "",
    )
    checks_kernels._norm_check(None, "RMSNorm")
    assert seen == ["RMSNorm"] and norm.TRITON_NORMS_ENV not in os.environ


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_gpu_checks_skip_with_reason_on_cpu(tmp_path: Path, fake_tree: Path) -> None:
    out = tmp_path / "r.json"
    only = ["training", "collectives", "parallel"]
    assert smoke(str(fake_tree), str(out), None, only=only) == 0
    checks = load(out)
    # training x spec, resume (2 + 4 GPUs), collectives, parallel (2 + 4 GPUs), and the
    # 1-GPU FP8 resume (TE spec only)
    assert len(checks) == 4 + 4 + 4 + 2 + 16 + 8 + 1
    assert {c["status"] for c in checks.values()} == {"skip"}  # never "pass" without a GPU
    assert "needs a GPU" in checks["training.gpt.te"]["detail"]
    assert "needs 1 GPU; no GPU visible" in checks["training.resume.1gpu.local"]["detail"]
    assert "needs 1 GPU; no GPU visible" in checks["training.resume.1gpu_fp8.te"]["detail"]
    assert "needs 2 GPUs; no GPU visible" in checks["training.resume.dp2_distopt.te"]["detail"]
    assert "needs 2 GPUs; no GPU visible" in checks["collectives.nccl"]["detail"]
    assert (
        checks["parallel.cp2.local"]["detail"] == "the parallel tier needs 2 GPUs; no GPU visible"
    )
    assert checks["parallel.tp2_cp2.te"]["detail"] == (
        "parallel.tp2_cp2.te needs 4 GPUs; no GPU visible"
    )


def test_cli_refuses_a_non_tree_for_imports(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["smoke", "--only", "imports"]) == 2
    assert "not a Megatron-LM tree" in capsys.readouterr().err


def test_cli_exit_code_follows_failures(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["smoke", "--only", "kernels.softmax.scaled"]) == 0
    monkeypatch.setenv(FAULT_ENV, "softmax")
    assert main(["smoke", "--only", "kernels.softmax.scaled"]) == 1


@pytest.mark.full
@pytest.mark.slow
def test_collectives_over_gloo_pass_and_catch_a_bad_allreduce(monkeypatch) -> None:
    assert "all_reduce" in run_world(2, "gloo", "collectives", timeout=120)
    monkeypatch.setenv(FAULT_ENV, "allreduce")
    with pytest.raises(CheckFailed, match=r"rank 0: .*all_reduce\(sum\): wrong result") as e:
        run_world(2, "gloo", "collectives", timeout=120)
    assert "all_gather" not in str(e.value)  # the other collectives still agreed


def test_training_hides_megatron_chatter_but_not_errors(capsys) -> None:
    import logging

    from megatron_rocm.envtools.smoke.checks_training import quiet_megatron

    log = logging.getLogger("megatron.core.distributed")
    log.addHandler(handler := logging.StreamHandler())
    try:
        with quiet_megatron():
            print("Params for bucket 1")
            log.info("DistributedDataParallelConfig(...)")
            log.warning("GPTModel IS DEPRECATED")
            log.error("a real error")
    finally:
        log.removeHandler(handler)
    out = capsys.readouterr()
    assert "bucket" not in out.out and "DistributedDataParallelConfig" not in out.err
    assert "DEPRECATED" not in out.err and "a real error" in out.err
    assert logging.getLogger("megatron").level == logging.NOTSET  # restored


@pytest.mark.full
@pytest.mark.slow
def test_a_world_whose_port_was_taken_starts_again_on_another(monkeypatch) -> None:
    """free_port() cannot reserve its port: when another process binds it first, rank 0's store
    fails with EADDRINUSE and the world starts again on a new port (the GPU box's
    collectives.nccl failed so once, with two smoke runs side by side)."""
    import socket

    from megatron_rocm.envtools.smoke import world

    squatter = socket.socket()
    squatter.bind(("", 0))
    squatter.listen()
    taken, real_free_port, handed = squatter.getsockname()[1], world.free_port, []

    def first_taken() -> int:
        handed.append(real_free_port() if handed else taken)
        return handed[-1]

    monkeypatch.setattr(world, "free_port", first_taken)
    monkeypatch.setattr(world, "GRACE_S", 2.0)  # rank 1 waits on the squatter until killed
    try:
        assert "all_reduce" in run_world(2, "gloo", "collectives", timeout=120)
    finally:
        squatter.close()
    assert handed[0] == taken and len(handed) == 2


LIBUV_STORE = (
    "torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
    "network address. port: 57125, useIpv6: false, code: -98, name: EADDRINUSE, message: "
    "address already in use"
)
SOCKET_STORE = (
    "The server socket has failed to listen on any local network address. The server socket "
    "has failed to bind to [::]:29500 (errno: 98 - Address already in use). The server socket "
    "has failed to bind to 0.0.0.0:29500 (errno: 98 - Address already in use)."
)
BIND_WARNING = (
    "[W] The server socket has failed to bind to [::]:29500 (errno: 98 - Address already in use)."
)


def test_port_was_taken_reads_the_store_error() -> None:
    from megatron_rocm.envtools.smoke.world import port_was_taken

    assert port_was_taken(LIBUV_STORE) and port_was_taken(SOCKET_STORE)
    assert not port_was_taken(BIND_WARNING)  # IPv6 taken, IPv4 bound: the store works
    assert not port_was_taken("RuntimeError: NCCL error: unhandled system error")


@pytest.mark.parametrize(
    ("rank0", "starts"),
    [
        ("print(STORE); raise SystemExit(1)", 3),  # the port was taken: start again, 3 tries
        ("print(STORE)", 1),  # the same words, but rank 0 succeeded: the world is done
        ("raise SystemExit(1)", 1),  # failed for another reason: no second start
    ],
)
def test_only_a_rank_0_that_failed_on_its_port_starts_the_world_again(
    tmp_path: Path, rank0: str, starts: int
) -> None:
    """Every start removes the ranks' result files, so no attempt is judged by an earlier one."""
    from megatron_rocm.envtools.smoke.world import start_world

    counter, result = tmp_path / "starts", tmp_path / "rank0.json"
    script = (
        f"import os; from pathlib import Path; STORE = {LIBUV_STORE!r}\n"
        "if os.environ['RANK'] == '0':\n"
        f"    assert not Path({str(result)!r}).exists()\n"
        f"    open({str(counter)!r}, 'a').write('x')\n"
        f"    Path({str(result)!r}).write_text('{{}}')\n"
        f"    {rank0}\n"
    )
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    cmd = [sys.executable, "-c", script]
    assert start_world(cmd, 2, {}, logs, timeout=60, results=[result]) is False
    assert counter.read_text() == "x" * starts
    assert "AssertionError" not in logs[0].read_text() + logs[1].read_text()
