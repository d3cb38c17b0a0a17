"""The lint tier: ``ruff check`` (pyproject.toml's ``[tool.ruff]``) and ``lint-imports`` (the
import contracts of pyproject.toml's ``[tool.importlinter]``, docs/architecture.md's "Import
layers") over the checkout; each test fails with the tool's own report. Both tools are pinned in
requirements.txt (``bash tools/setup.sh`` installs them)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tool: str, argv: list[str]) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(tool) is None:
        pytest.fail(f"{tool} is not installed (bash tools/setup.sh installs requirements.txt)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _lint_imports(*contracts: str) -> subprocess.CompletedProcess:
    argv = ["-c", "from importlinter.cli import lint_imports_command; lint_imports_command()", "--no-cache"]
    for c in contracts:
        argv += ["--contract", c]
    return _run("importlinter", argv)


def test_ruff_finds_nothing():
    res = _run("ruff", ["-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."])
    assert res.returncode == 0, res.stdout + res.stderr


def test_packages_import_only_what_their_layer_allows():
    res = _lint_imports("layers", "pure-scheduler", "testing-aside", "acyclic")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("KEPT") == 4, res.stdout


def test_no_circle_between_the_modules_of_rollout():
    res = _lint_imports("acyclic-rollout")
    assert res.returncode == 0, res.stdout + res.stderr
