"""Scoring rules used by the example task sets (``scoring: gyre.tasks.rules:<name>``).

A rule takes the :class:`~gyre.evaluation.CheckResult` of an executable check and returns a
score in [0, 1] (see :mod:`gyre.evaluation.executable`). The harness launcher puts the
harness's final message into the evaluator target's metadata
(:data:`gyre.harness.FINAL_MESSAGE_KEY`), next to the task's own metadata.
"""

from __future__ import annotations

from typing import Any

from gyre.evaluation import CheckResult, Unresolved

__all__ = ["final_message_equals", "FINAL_MESSAGE_KEY"]

#: Metadata key of the harness's final message (duplicated in :mod:`gyre.harness.base`).
FINAL_MESSAGE_KEY = "final_message"


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
