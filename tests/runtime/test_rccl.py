"""reject_nccl_only_options: ROCm is simulated by setting torch.version.hip; no Megatron needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rocm.runtime.rccl import NCCL_ONLY_OPTIONS, reject_nccl_only_options

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch

# What Megatron's parser leaves when none of these options is given (main's defaults).
DEFAULTS = {
    "tp_comm_overlap": False,
    "nccl_ub": False,
    "gtp_remat_nccl_ub": False,
    "gtp_expert_remat_nccl_ub": False,
    "use_sharp": False,
    "nccl_communicator_config_path": None,
    "symmetric_ar_type": None,
}

SET_VALUES = {
    "tp_comm_overlap": True,
    "nccl_ub": True,
    "gtp_remat_nccl_ub": True,
    "gtp_expert_remat_nccl_ub": True,
    "use_sharp": True,
    "nccl_communicator_config_path": "/tmp/nccl.yaml",
    "symmetric_ar_type": "two_shot",
}


def make_args(**overrides: object) -> SimpleNamespace:
    return SimpleNamespace(**{**DEFAULTS, **overrides})


@pytest.fixture
def rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None, raising=False)


def test_table_covers_every_option_under_test() -> None:
    assert {o.dest for o in NCCL_ONLY_OPTIONS} == set(SET_VALUES)


@pytest.mark.usefixtures("rocm")
def test_defaults_pass_on_rocm() -> None:
    reject_nccl_only_options(make_args())


@pytest.mark.usefixtures("rocm")
def test_old_megatron_without_these_attributes_passes() -> None:
    reject_nccl_only_options(SimpleNamespace(tensor_model_parallel_size=2))


@pytest.mark.usefixtures("rocm")
@pytest.mark.parametrize("option", NCCL_ONLY_OPTIONS, ids=lambda o: o.flag)
def test_each_option_is_rejected_with_its_advice(option) -> None:
    with pytest.raises(ValueError) as info:
        reject_nccl_only_options(make_args(**{option.dest: SET_VALUES[option.dest]}))
    message = str(info.value)
    assert option.flag in message
    assert "remove it" in message
    # Exactly one problem line: the header plus one indented line.
    assert len(message.splitlines()) == 2


@pytest.mark.usefixtures("rocm")
def test_tp_comm_overlap_message_names_userbuffers() -> None:
    with pytest.raises(ValueError, match="TransformerEngine userbuffers"):
        reject_nccl_only_options(make_args(tp_comm_overlap=True))


@pytest.mark.usefixtures("rocm")
def test_all_offending_options_reported_at_once() -> None:
    with pytest.raises(ValueError) as info:
        reject_nccl_only_options(make_args(**SET_VALUES))
    lines = str(info.value).splitlines()[1:]
    assert [line.split()[0] for line in lines] == [o.flag for o in NCCL_ONLY_OPTIONS]


@pytest.mark.usefixtures("cuda")
def test_cuda_accepts_everything() -> None:
    reject_nccl_only_options(make_args(**SET_VALUES))
