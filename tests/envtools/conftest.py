"""Isolation for the smoke tests: ``smoke`` runs in-process and puts the tree it checks first on
``sys.path`` (what a CLI process wants). A test's fake tree must not stay importable as
``megatron`` for the tests that run after it, so both are restored around every test here."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def restore_import_state():
    path = list(sys.path)
    modules = set(sys.modules)
    yield
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        if name == "megatron" or name.startswith("megatron."):
            del sys.modules[name]
