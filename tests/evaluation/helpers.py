"""Helpers for evaluation tests: tiny pytest workspaces, a fake clock, the pytest test command."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

CALC = """\
def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def mul(a, b):
    return {mul}


def div(a, b):
    return a / b
"""

TESTS = """\
from calc import add, div, mul, sub


def test_add():
    assert add(2, 3) == 5


def test_sub():
    assert sub(2, 3) == -1


def test_mul():
    assert mul(2, 3) == 6


def test_div():
    assert div(6, 3) == 2
"""

#: The task's test command: pytest with a JUnit report, plugins not auto-loaded (fast start).
PYTEST_CMD = ["{python}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml={junit_xml}"]
FAST_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def write_workspace(root: Path, *, passing: int = 3, extra_tests: str = "") -> Path:
    """A workspace with ``calc.py`` and 4 tests of which 3 (bug in ``mul``) or 4 pass."""
    root.mkdir(parents=True, exist_ok=True)
    assert passing in (3, 4)
    (root / "calc.py").write_text(CALC.format(mul="a * b" if passing == 4 else "a + b"))
    (root / "test_calc.py").write_text(TESTS + textwrap.dedent(extra_tests))
    return root


class FakeClock:
    """Monotonic seconds that only move when told; ``sleep`` advances it and is recorded."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt

    def sleep(self, dt: float) -> None:
        assert dt >= 0
        self.sleeps.append(dt)
        self.now += dt


PYTHON = sys.executable

#: A JUnit report as pytest writes it for the 3-of-4 workspace.
JUNIT_3_OF_4 = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest" \
errors="0" failures="1" skipped="0" tests="4" time="0.01"><testcase classname="test_calc" name="test_add" time="0.0"/>\
<testcase classname="test_calc" name="test_sub" time="0.0"/><testcase classname="test_calc" name="test_mul" time="0.0">\
<failure message="assert 5 == 6">AssertionError</failure></testcase>\
<testcase classname="test_calc" name="test_div" time="0.0"/></testsuite></testsuites>"""


def canned_command(xml: str = JUNIT_3_OF_4, rc: int = 1) -> list[str]:
    """A fast stand-in for the pytest command: writes ``xml`` as the report and exits ``rc``."""
    return ["sh", "-c", f"printf '%s' '{xml}' > \"$GYRE_EVAL_JUNIT_XML\"; exit {rc}"]
