"""Scoring rules used by the example task sets (``scoring: gyre.tasks.rules:<name>``).

A rule takes the :class:`~gyre.evaluation.CheckResult` of an executable check and returns a
score in [0, 1] (see :mod:`gyre.evaluation.executable`). The harness launcher puts the
harness's final message into the evaluator target's metadata
(:data:`gyre.harness.FINAL_MESSAGE_KEY`), next to the task's own metadata.
"""

from __future__ import annotations

import re
from typing import Any

from gyre.evaluation import CheckResult, Unresolved

__all__ = ["final_message_equals", "final_message_last_number", "last_integer", "FINAL_MESSAGE_KEY"]

#: Metadata key of the harness's final message (duplicated in :mod:`gyre.harness.base`).
FINAL_MESSAGE_KEY = "final_message"


_INTEGER_RE = re.compile(r"-?\d+")


def _normalise(text: str) -> str:
    return " ".join(text.strip().strip(".!\"'`").split()).lower()


def final_message_equals(result: CheckResult) -> tuple[float, dict[str, Any]]:
    """1.0 when the harness's final message equals ``metadata["expected_reply"]``
    (case-insensitive, surrounding whitespace/quotes/final punctuation ignored), else 0.0.
    A missing final message scores 0.0 (the harness said nothing).

    Raises:
        Unresolved: the task has no ``expected_reply`` (a task-set bug, not the policy's).
    """
    meta = result.target.metadata
    expected = meta.get("expected_reply")
    if not isinstance(expected, str):
        raise Unresolved("task metadata has no 'expected_reply'")
    got = meta.get(FINAL_MESSAGE_KEY)
    got = got if isinstance(got, str) else ""
    score = 1.0 if _normalise(got) == _normalise(expected) else 0.0
    return score, {"final_message": got[-200:], "expected_reply": expected}


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (digits, with a directly preceding ``-``), or ``None``.
    ``"7 + 5 = 12."`` -> 12; ``"1,000"`` -> 0 (no thousands separators); ``"2.5"`` -> 5."""
    found = _INTEGER_RE.findall(text)
    return int(found[-1]) if found else None


def final_message_last_number(result: CheckResult) -> tuple[float, dict[str, Any]]:
    """1.0 when the last integer of the harness's final message (:func:`last_integer`) equals
    ``int(metadata["answer"])``, else 0.0 (also when the message has no integer or is missing).

    Raises:
        Unresolved: the task's ``answer`` is missing or not an integer (a task-set bug).
    """
    meta = result.target.metadata
    try:
        expected = int(str(meta.get("answer")))
    except ValueError:
        raise Unresolved(f"task metadata has no integer 'answer': {meta.get('answer')!r}") from None
    got = meta.get(FINAL_MESSAGE_KEY)
    got = got if isinstance(got, str) else ""
    value = last_integer(got)
    return (1.0 if value == expected else 0.0), {"final_message": got[-200:], "answer": expected, "last_integer": value}
