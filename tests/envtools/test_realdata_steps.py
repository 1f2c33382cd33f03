"""The real-data check's steps on stand-in trees (no torch, no Megatron): a step that never
ends is killed with what it started and fails the check by name, with its log's last lines;
the tokenizer flags never send a tree to the Hugging Face hub."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from megatron_rocm.envtools.smoke import checks_realdata, runner

# What upstream's preprocess_data.py does at 0.17+ when the tokenizer cannot load: the child
# that encodes dies, the parent waits on a queue for it. Here a child that sleeps, and a
# parent that prints a line and waits for it.
STUCK = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[0] + ".child", "w").write(str(child.pid))
print("Opening corpus.jsonl", flush=True)
print("waiting for the encoder", flush=True)
child.wait()
"""
# A preprocess_data.py that writes a non-empty .bin where the check looks for it.
WRITES_BIN = """
import sys
prefix = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--output-prefix=")][0]
open(prefix + "_text_document.bin", "wb").write(bytes(64))
print("done")
"""

SLEEPS = "import time\nprint('iteration 1', flush=True)\ntime.sleep(600)\n"


def _tree(tmp_path: Path, preprocess: str, pretrain: str = "") -> Path:
    tree = tmp_path / "tree"
    (tree / "tools").mkdir(parents=True)
    (tree / "megatron/training").mkdir(parents=True)
    (tree / "megatron/training/arguments.py").write_text("")
    (tree / "tools/preprocess_data.py").write_text(preprocess)
    (tree / "pretrain_gpt.py").write_text(pretrain)
    return tree


def _ctx(tree: Path, tmp_path: Path, lines: list[str]) -> runner.Context:
    ctx = runner.Context(tree=tree, device="cpu", gpu_count=0, log=lines.append)
    ctx._workdir = str(tmp_path / "work")
    return ctx


def _gone(pid: int) -> bool:
    """Exited (a zombie left to a container's init counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_stuck_preprocess_fails_by_name_with_its_log_and_its_children_killed(tmp_path) -> None:
    tree = _tree(tmp_path, STUCK)
    lines: list[str] = []
    start = time.monotonic()
    with pytest.raises(runner.CheckFailed) as err:
        checks_realdata.real_data_results(
            _ctx(tree, tmp_path, lines), ["unused"], "gloo", timeout=3
        )
    assert time.monotonic() - start < 60
    msg = str(err.value)
    assert "preprocess_data.py did not finish in 3 s" in msg
    assert checks_realdata.TIMEOUT_ENV in msg
    assert "waiting for the encoder" in msg  # the tail of its log
    assert any("preprocess_data.py started (limit 3 s)" in x for x in lines)
    assert any("preprocess_data.py TIMED OUT" in x for x in lines)
    child = int((tree / "tools/preprocess_data.py.child").read_text())
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child), "the step's own child outlived the timeout"


def test_a_stuck_training_run_fails_by_name(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(checks_realdata.TIMEOUT_ENV, "3")
    tree = _tree(tmp_path, WRITES_BIN, SLEEPS)
    lines: list[str] = []
    with pytest.raises(runner.CheckFailed) as err:
        checks_realdata.real_data_results(_ctx(tree, tmp_path, lines), [sys.executable], "gloo")
    msg = str(err.value)
    assert f"pretrain_gpt.py to iteration {checks_realdata.ITERS // 2} did not finish in 3 s" in msg
    assert "iteration 1" in msg
    assert any("preprocess_data.py exited 0" in x for x in lines)


def test_timeouts_default_env_and_bad_value(monkeypatch) -> None:
    monkeypatch.delenv(checks_realdata.TIMEOUT_ENV, raising=False)
    assert checks_realdata.timeouts() == checks_realdata.TIMEOUTS
    assert checks_realdata.timeouts(7) == {"preprocess": 7, "train": 7}
    monkeypatch.setenv(checks_realdata.TIMEOUT_ENV, "45")
    assert checks_realdata.timeouts() == {"preprocess": 45, "train": 45}
    monkeypatch.setenv(checks_realdata.TIMEOUT_ENV, "soon")
    with pytest.raises(runner.CheckFailed, match="whole number of seconds"):
        checks_realdata.timeouts()


@pytest.mark.parametrize(
    ("legacy_flag", "new_system", "want"),
    [
        (False, False, "GPT2BPETokenizer"),  # 0.12 - 0.15
        (True, True, "GPT2BPETokenizer --legacy-tokenizer"),  # 0.16
        (False, True, "HuggingFaceTokenizer"),  # 0.17+: GPT2BPETokenizer looks up "gpt2"
    ],
)
def test_tokenizer_flags_stay_local(tmp_path, legacy_flag, new_system, want) -> None:
    tree = _tree(tmp_path, "")
    text = "group.add_argument('--legacy-tokenizer')" if legacy_flag else ""
    (tree / "megatron/training/arguments.py").write_text(text)
    if new_system:
        (tree / "megatron/core/tokenizers").mkdir(parents=True)
    tok = tmp_path / "tok"
    args = checks_realdata._tokenizer_args(tree, tok)
    kind = args[0].split("=", 1)[1]
    assert " ".join([kind, *(a for a in args if a == "--legacy-tokenizer")]) == want
    if kind == "HuggingFaceTokenizer":
        assert args == ["--tokenizer-type=HuggingFaceTokenizer", f"--tokenizer-model={tok}"]
    else:
        assert f"--vocab-file={tok / 'vocab.json'}" in args


def test_steps_run_with_the_hub_offline(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    env = checks_realdata._env(_tree(tmp_path, ""), None)
    assert {k: env[k] for k in checks_realdata.OFFLINE} == checks_realdata.OFFLINE


def test_a_new_tree_without_transformers_skips_with_the_reason(tmp_path, monkeypatch) -> None:
    tree = _tree(tmp_path, "")
    (tree / "megatron/core/tokenizers").mkdir(parents=True)
    real = checks_realdata.importlib.util.find_spec
    monkeypatch.setattr(
        checks_realdata.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else real(name, *a),
    )
    ctx = runner.Context(tree=tree, device="cuda", gpu_count=1)
    with pytest.raises(runner.Skip, match="through Hugging Face transformers"):
        checks_realdata.pretrain_gpt_real_data(ctx)
