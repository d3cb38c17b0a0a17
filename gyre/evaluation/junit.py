"""JUnit XML test reports (as written by ``pytest --junitxml=PATH``), parsed with the standard library.

Counting is per ``<testcase>``: a case with a ``<failure>`` child failed, with an ``<error>``
child errored (pytest also reports collection errors and setup/teardown errors this way),
with a ``<skipped>`` child was skipped (pytest reports ``xfail`` as skipped too); any other
case passed. A report without ``<testcase>`` elements falls back to the ``tests``,
``failures``, ``errors`` and ``skipped`` attributes of its ``<testsuite>`` elements.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass

__all__ = ["JUnitCounts", "JUnitParseError", "parse_junit_xml", "parse_junit_file"]


class JUnitParseError(ValueError):
    """The report is missing, not XML, or not a JUnit report."""


@dataclass(slots=True, frozen=True)
class JUnitCounts:
    """Test counts of one report. ``tests`` counts every case (skipped included)."""

    tests: int
    failures: int
    errors: int
    skipped: int

    @property
    def passed(self) -> int:
        return self.tests - self.failures - self.errors - self.skipped

    def fraction_passed(self, skipped: str = "fail") -> float:
        """``passed / tests`` (``skipped="fail"``: a skipped test is not passed) or
        ``passed / (tests - skipped)`` (``skipped="exclude"``).

        Raises:
            ZeroDivisionError: no test counts towards the denominator.
            ValueError: unknown ``skipped`` policy.
        """
        if skipped == "fail":
            denom = self.tests
        elif skipped == "exclude":
            denom = self.tests - self.skipped
        else:
            raise ValueError(f"skipped policy must be 'fail' or 'exclude', got {skipped!r}")
        if denom <= 0:
            raise ZeroDivisionError("no tests to score")
        return self.passed / denom

    def as_dict(self) -> dict[str, int]:
        return {"tests": self.tests, "passed": self.passed, "failures": self.failures,
                "errors": self.errors, "skipped": self.skipped}


def _int_attr(el: ET.Element, name: str) -> int:
    v = el.get(name, "0") or "0"
    try:
        return int(float(v))
    except ValueError as exc:
        raise JUnitParseError(f"bad {name}={v!r} on <{el.tag}>") from exc


def parse_junit_xml(text: str | bytes) -> JUnitCounts:
    """Counts from a JUnit XML document (root ``<testsuites>`` or ``<testsuite>``).

    Raises:
        JUnitParseError: not XML, or neither root element.
    """
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise JUnitParseError(f"not XML: {exc}") from exc
    if root.tag not in ("testsuites", "testsuite"):
        raise JUnitParseError(f"root element <{root.tag}> is not <testsuites>/<testsuite>")
    cases = list(root.iter("testcase"))
    if cases:
        failures = errors = skipped = 0
        for case in cases:
            tags = {child.tag for child in case}
            if "error" in tags:
                errors += 1
            elif "failure" in tags:
                failures += 1
            elif "skipped" in tags:
                skipped += 1
        return JUnitCounts(len(cases), failures, errors, skipped)
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    totals = [sum(_int_attr(s, a) for s in suites) for a in ("tests", "failures", "errors", "skipped")]
    return JUnitCounts(*totals)


def parse_junit_file(path: str | os.PathLike[str]) -> JUnitCounts:
    """:func:`parse_junit_xml` of a file.

    Raises:
        JUnitParseError: the file is missing or unreadable, or see :func:`parse_junit_xml`.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise JUnitParseError(f"no JUnit report at {path}: {exc.strerror}") from exc
    return parse_junit_xml(data)
