"""A patched tree with one patch taken back out: what the tests that show a patch is needed
run upstream's code on."""

from __future__ import annotations

import subprocess
from pathlib import Path


def without_patch(tree: Path, patch_id: str) -> None:
    """Take ``patch_id``'s commit back out of the applied ``tree`` (``git revert``, left
    uncommitted): the tree as the series leaves it without that one patch, whichever variant
    the tree took."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=tree, capture_output=True, text=True)
        assert done.returncode == 0, f"git {' '.join(args)} in {tree}: {done.stderr.strip()}"
        return done.stdout.strip()

    commit = git("log", "--format=%H", f"--grep=^Megatron-ROCm-Patch: {patch_id}$")
    assert len(commit.split()) == 1, f"{patch_id}: one commit expected in {tree}, got {commit!r}"
    git("revert", "--no-commit", commit)
