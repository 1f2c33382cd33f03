"""Maintainer scripts, importable as a package: run them from the repository root as
``python -m scripts.<family>.<name>`` (``bench``, ``training``); nothing edits ``sys.path``.
"""
