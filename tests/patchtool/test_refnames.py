"""User-supplied names are checked before git sees them, by git's own ref-name rules."""

from __future__ import annotations

import subprocess

import pytest

from megatron_rocm.errors import UsageError
from megatron_rocm.patchtool import refnames

GOOD = ["core_v0.12.0", "main", "rocm/core_v0.19.0", "feature/x-1", "a1b2c3d", "v1.0rc1", "x@y"]
BAD = [
    "",
    "-D",
    "--upload-pack=touch x;",
    "name with space",
    "line\nbreak",
    "tab\there",
    "@{-1}",
    "@",
    "..",
    "a..b",
    "HEAD~1",
    "v1^{}",
    "a:b",
    "what?",
    "star*",
    "[x]",
    "back\\slash",
    "/lead",
    "trail/",
    "a//b",
    "end.",
    ".hidden",
    "dir/.hidden",
    "x.lock",
    "dir/x.lock/y",
    "$(touch x)",
    "`touch x`",
]


def git_accepts(name: str) -> bool:
    proc = subprocess.run(
        ["git", "check-ref-format", "--allow-onelevel", name], capture_output=True, check=False
    )
    return proc.returncode == 0


@pytest.mark.parametrize("name", GOOD)
def test_valid_names_pass_and_git_agrees(name):
    assert refnames.check_ref(name) == name
    assert git_accepts(name)


@pytest.mark.parametrize("name", BAD)
def test_invalid_names_are_usage_errors_on_one_line(name):
    with pytest.raises(UsageError) as e:
        refnames.check_ref(name)
    assert "\n" not in str(e.value)
    assert e.value.code == 2


@pytest.mark.parametrize("name", [n for n in BAD if n and not n.startswith("-")])
def test_we_refuse_only_what_git_refuses(name):
    """Apart from a leading '-' (git would read an option) we add no rule of our own."""
    assert not git_accepts(name)


def test_branch_names():
    assert refnames.check_branch("rocm/mine") == "rocm/mine"
    for bad in ("HEAD", "refs/heads/x", "-D", "a..b"):
        with pytest.raises(UsageError):
            refnames.check_branch(bad)


def test_tag_patterns_allow_globs_only():
    assert refnames.check_pattern("core_v0.1[2-9]*") == "core_v0.1[2-9]*"
    assert refnames.check_pattern("core_v0.?.0") == "core_v0.?.0"
    for bad in ("-x*", "a..*", "@{*", "sp ace*"):
        with pytest.raises(UsageError):
            refnames.check_pattern(bad)


@pytest.mark.parametrize(
    ("ref", "branch"),
    [
        ("core_v0.19.0", "rocm/core_v0.19.0"),
        ("main", "rocm/main"),
        ("refs/heads/main", "rocm/main"),
        ("refs/tags/core_v0.19.0", "rocm/core_v0.19.0"),
        ("refs/remotes/origin/dev", "rocm/dev"),
        ("origin/dev", "rocm/dev"),
        ("HEAD", "rocm/0123456789ab"),
        ("0123456", "rocm/0123456789ab"),
    ],
)
def test_the_fork_branch_is_named_after_the_refs_short_name(ref, branch):
    from megatron_rocm.patchtool.transaction import branch_name

    assert branch_name(ref, "0123456789abcdef" * 2 + "01234567") == branch
