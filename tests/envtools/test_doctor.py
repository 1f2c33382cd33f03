"""doctor: a simulated ROCm/CUDA torch and a fake filesystem root; no GPU, no real torch needed."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rocm.commands import doctor as doctor_cmd
from megatron_rocm.envtools import envcheck


def fake_torch(hip: str | None = "6.4.43482", cuda: str | None = None, archs=("gfx942",) * 2):
    """Just the attributes envcheck reads: version, cuda.* and device properties."""
    props = [
        SimpleNamespace(
            name="AMD Instinct MI300X" if a.startswith("gfx") else "NVIDIA H100",
            gcnArchName=f"{a}:sramecc+:xnack-" if a.startswith("gfx") else "",
            major=9,
            minor=0,
            total_memory=192 * 2**30,
        )
        for a in archs
    ]
    cuda_ns = SimpleNamespace(
        is_available=lambda: bool(props),
        device_count=lambda: len(props),
        get_device_properties=lambda i: props[i],
        nccl=SimpleNamespace(version=lambda: (2, 21, 5)),
    )
    return SimpleNamespace(
        __version__="2.13.0+rocm7.2" if hip else "2.13.0+cu130",
        version=SimpleNamespace(hip=hip, cuda=cuda),
        cuda=cuda_ns,
    )


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for name in ("eth0", "lo", "ens50f0np0"):
        (tmp_path / "sys/class/net" / name).mkdir(parents=True)
    return tmp_path


@pytest.fixture(autouse=True)
def triton_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envcheck, "_triton_version", lambda: "3.6.0")


def codes(torch, env: dict[str, str], root: Path) -> list[str]:
    snap = envcheck.collect(torch, env, root)
    return [p.code for p in envcheck.problems(snap)]


def test_rocm_snapshot_reads_arch_and_rccl(root: Path) -> None:
    snap = envcheck.collect(fake_torch(), {"HSA_ENABLE_SDMA": "0", "HOME": "/x"}, root)
    assert [g.arch for g in snap.gpus] == ["gfx942", "gfx942"]
    assert snap.collectives == "RCCL 2.21.5"
    assert snap.env == {"HSA_ENABLE_SDMA": "0"}  # only watched variables are reported
    assert envcheck.problems(snap) == []


def test_cuda_snapshot_reports_compute_capability(root: Path) -> None:
    snap = envcheck.collect(fake_torch(hip=None, cuda="12.6", archs=("sm",)), {}, root)
    assert snap.gpus[0].arch == "sm_90" and snap.collectives == "NCCL 2.21.5"


@pytest.mark.parametrize(
    ("env", "code"),
    [
        ({"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "0"}, "visible-devices-disagree"),
        (
            {"ROCR_VISIBLE_DEVICES": "4,5", "HIP_VISIBLE_DEVICES": "4"},
            "visible-devices-out-of-range",
        ),
        ({"NCCL_SOCKET_IFNAME": "ib0"}, "bad-ifname"),
        ({"GLOO_SOCKET_IFNAME": "=eth"}, "bad-ifname"),  # '=' asks for an exact name
        ({"MASTER_PORT": "6000x"}, "bad-master-port"),
        ({"MASTER_PORT": "70000"}, "bad-master-port"),
        ({"WORLD_SIZE": "two"}, "bad-world_size"),
        ({"HSA_OVERRIDE_GFX_VERSION": "9.4.2"}, "needless-gfx-override"),
    ],
)
def test_inconsistencies_are_flagged(root: Path, env: dict[str, str], code: str) -> None:
    assert codes(fake_torch(), env, root) == [code]


@pytest.mark.parametrize(
    "env",
    [
        {"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "0, 1"},
        {"NCCL_SOCKET_IFNAME": "eth", "GLOO_SOCKET_IFNAME": "ens50f0np0"},  # prefix match
        {"NCCL_SOCKET_IFNAME": "^docker,lo"},  # exclusion lists are not checked
        {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6000", "NNODES": "2", "NODE_RANK": "1"},
    ],
)
def test_consistent_settings_pass(root: Path, env: dict[str, str]) -> None:
    assert codes(fake_torch(), env, root) == []


def test_gfx_override_is_fine_on_an_unsupported_arch(root: Path) -> None:
    torch = fake_torch(archs=("gfx1031",))
    assert codes(torch, {"HSA_OVERRIDE_GFX_VERSION": "10.3.0"}, root) == []


def test_cuda_torch_on_rocm_machine(root: Path) -> None:
    (root / "opt/rocm").mkdir(parents=True)
    found = codes(fake_torch(hip=None, cuda="12.6", archs=()), {}, root)
    assert found == ["cuda-torch-on-rocm", "no-gpu"]


def test_missing_triton_is_a_problem_only_with_a_gpu(monkeypatch, root: Path) -> None:
    monkeypatch.setattr(envcheck, "_triton_version", lambda: None)
    assert codes(fake_torch(), {}, root) == ["no-triton"]
    assert codes(fake_torch(archs=()), {}, root) == ["no-gpu"]


@pytest.mark.parametrize(
    ("raw", "text"), [((2, 21, 5), "2.21.5"), (21903, "2.19.3"), (2708, "2.7.8")]
)
def test_collective_version_formats(raw, text: str) -> None:
    assert envcheck._version_string(raw) == text


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in envcheck.WATCHED_VARS:
        monkeypatch.delenv(var, raising=False)


def test_doctor_without_torch_exits_3(monkeypatch, capsys, clean_env) -> None:
    monkeypatch.setattr(doctor_cmd, "import_torch", lambda: (None, None))
    assert doctor_cmd.doctor(as_json=True) == 3
    out = json.loads(capsys.readouterr().out)
    assert out["torch"] is None and out["problems"][0]["code"] == "no-torch"
    assert "rocm" in out["problems"][0]["fix"]


def test_doctor_exit_codes_and_human_output(monkeypatch, capsys, clean_env) -> None:
    monkeypatch.setattr(doctor_cmd, "import_torch", lambda: (fake_torch(), None))
    assert doctor_cmd.doctor() == 0
    out = capsys.readouterr().out
    assert "ROCm/HIP 6.4.43482" in out and "gfx942" in out and "no problems found" in out
    monkeypatch.setenv("MASTER_PORT", "nope")
    assert doctor_cmd.doctor() == 1
    assert "fix: export MASTER_PORT" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("env", "code"),
    [({"MASTER_PORT": "²"}, "bad-master-port"), ({"NODE_RANK": "¹"}, "bad-node_rank")],
)
def test_digits_that_are_not_ascii_are_flagged_not_a_crash(
    root: Path, env: dict[str, str], code: str
) -> None:
    assert codes(fake_torch(), env, root) == [code]


def test_an_installed_torch_that_does_not_import_is_said_as_such(
    monkeypatch, capsys, clean_env
) -> None:
    failure = "ImportError: libamdhip64.so: cannot open shared object file"
    monkeypatch.setattr(doctor_cmd, "import_torch", lambda: (None, failure))
    assert doctor_cmd.doctor() == 3
    out = capsys.readouterr().out
    assert "INSTALLED BUT DOES NOT IMPORT" in out and "libamdhip64.so" in out
    assert "NOT INSTALLED" not in out.replace("BUT DOES NOT", "")


@pytest.mark.parametrize(
    ("raises", "says"),
    [
        ("ImportError('libamdhip64.so: cannot open')", "ImportError: libamdhip64.so"),
        ("RuntimeError('HIP error')", "RuntimeError: HIP error"),
    ],
)
def test_import_torch_tells_a_broken_torch_from_a_missing_one(tmp_path, raises, says) -> None:
    import subprocess
    import sys

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(f"raise {raises}\n")
    probe = "from megatron_rocm.runtime.platform import import_torch; print(import_torch()[1])"
    package = Path(doctor_cmd.__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={"PYTHONPATH": f"{tmp_path}:{package}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip().startswith(says)
