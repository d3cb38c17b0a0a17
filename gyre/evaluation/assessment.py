"""The evaluator interface: what is assessed, what an assessment says (paper §5.2).

An :class:`Evaluator` looks at one preserved workspace (an :class:`EvaluationTarget`) and
returns an :class:`Assessment` ``(score, status, assessed_ref, details, duration_s)``:

* ``status == VALID``: ``score`` is a real reward (a valid ``0.0`` is a real zero);
* ``status == UNRESOLVED``: the evaluator could not decide (it crashed, timed out, its
  output could not be parsed); ``score`` is NaN. **Unresolved is never a zero**: the
  caller retries against the same preserved state and, when the budget runs out, excludes
  the execution from training (:mod:`gyre.evaluation.validity`,
  :mod:`gyre.evaluation.rewards`).

The target deliberately carries no termination status, elapsed time or trajectory length:
an evaluator cannot make the reward depend on them (partial scoring).
"""

from __future__ import annotations

import abc
import enum
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "AssessmentStatus",
    "Assessment",
    "EvaluationTarget",
    "Evaluator",
    "Unresolved",
]


class AssessmentStatus(str, enum.Enum):
    """Outcome of one assessment attempt."""

    VALID = "valid"
    UNRESOLVED = "unresolved"


class Unresolved(Exception):
    """Raised by a scoring rule (or evaluator internals) to say "cannot decide": the attempt
    becomes ``UNRESOLVED`` with this message as its reason, never a score of 0."""


@dataclass(slots=True, frozen=True)
class Assessment:
    """One assessment of one preserved workspace.

    * ``score`` -- the reward, a finite float when ``status`` is ``VALID``; NaN when unresolved;
    * ``status`` -- :class:`AssessmentStatus`;
    * ``assessed_ref`` -- what was assessed: workspace snapshot id / artifact version (e.g.
      ``sha256:<tree digest>``) -- copied from the target;
    * ``details`` -- JSON-serialisable evidence (test counts, exit code, judge reply, reason);
    * ``duration_s`` -- wall time of the attempt (seconds).

    Raises:
        ValueError: a valid assessment with a non-finite score.
    """

    score: float
    status: AssessmentStatus
    assessed_ref: str
    details: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0

    def __post_init__(self) -> None:
        status = AssessmentStatus(self.status)
        object.__setattr__(self, "status", status)
        object.__setattr__(self, "score", float(self.score))
        if status is AssessmentStatus.VALID and not math.isfinite(self.score):
            raise ValueError(f"a valid assessment needs a finite score, got {self.score!r}")
        if status is AssessmentStatus.UNRESOLVED:
            object.__setattr__(self, "score", math.nan)

    @property
    def valid(self) -> bool:
        return self.status is AssessmentStatus.VALID

    @classmethod
    def valid_score(cls, score: float, assessed_ref: str, details: dict[str, Any] | None = None,
                    duration_s: float = 0.0) -> "Assessment":
        """A ``VALID`` assessment with ``score``."""
        return cls(float(score), AssessmentStatus.VALID, assessed_ref, dict(details or {}), duration_s)

    @classmethod
    def unresolved(cls, reason: str, assessed_ref: str, details: dict[str, Any] | None = None,
                   duration_s: float = 0.0) -> "Assessment":
        """An ``UNRESOLVED`` assessment; ``details["reason"] = reason``."""
        d = dict(details or {})
        d["reason"] = reason
        return cls(math.nan, AssessmentStatus.UNRESOLVED, assessed_ref, d, duration_s)


@dataclass(slots=True, frozen=True)
class EvaluationTarget:
    """What one evaluator attempt assesses.

    * ``execution_id`` -- the execution whose work is assessed;
    * ``workspace`` -- the *preserved* workspace (a snapshot the harness no longer touches).
      Evaluators that run code copy it first (:class:`~gyre.evaluation.ExecutableCheck`);
      read-only evaluators (the judge) read it in place;
    * ``assessed_ref`` -- snapshot id / artifact version of ``workspace``;
    * ``branch`` -- branch ref of the artifact (``""`` when the workspace is not a branch);
    * ``attempt`` -- 1-based attempt number (retries of an unresolved assessment count up);
    * ``instruction`` -- the task instruction (judges show it with the rubric);
    * ``execution_key`` -- the execution's proxy key (the judge calls the model with it);
    * ``metadata`` -- task-specific data for custom rules.
    """

    execution_id: str
    workspace: Path
    assessed_ref: str
    branch: str = ""
    attempt: int = 1
    instruction: str = ""
    execution_key: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "workspace", Path(self.workspace))
        if int(self.attempt) < 1:
            raise ValueError(f"attempt must be >= 1, got {self.attempt!r}")


class Evaluator(abc.ABC):
    """Scores a preserved workspace.

    Implementations: :class:`~gyre.evaluation.ExecutableCheck` (run the task's tests),
    :class:`~gyre.evaluation.AgenticJudge` (a model with a rubric, role ``evaluator``),
    :class:`~gyre.evaluation.CompositeEvaluator` (weighted checks).

    Contract: :meth:`evaluate` should return ``UNRESOLVED`` rather than raise on any failure
    to decide; if it raises anyway, :class:`~gyre.evaluation.RewardManager` records the
    attempt as unresolved. It must not modify ``target.workspace``.
    """

    #: Name recorded with each assessment (assessment provenance).
    name: str = "evaluator"

    @abc.abstractmethod
    def evaluate(self, target: EvaluationTarget, *, timeout_s: float | None = None) -> Assessment:
        """Assess ``target``; ``timeout_s`` (seconds) bounds this attempt (``None``: the
        evaluator's own limit). Returns an :class:`Assessment` with ``target.assessed_ref``."""
