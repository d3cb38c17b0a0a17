"""Composite evaluator: a weighted combination of checks.

``score = sum_k w_k * s_k / sum_k w_k`` over the components, each run on the same target.
If any component is unresolved the composite is unresolved (a missing part is not a zero);
its reason names the components that failed. Components run in order; the attempt limit is
shared (each component gets what the previous ones left).
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from gyre.evaluation.assessment import Assessment, EvaluationTarget, Evaluator

__all__ = ["CompositeEvaluator"]


class CompositeEvaluator(Evaluator):
    """Weighted mean of component evaluators.

    Args:
        components: ``(evaluator, weight)`` pairs, weights finite and > 0.
        name: recorded with each assessment.
        clock: monotonic seconds.

    Raises:
        ValueError: no components or a bad weight.
    """

    def __init__(self, components: Sequence[tuple[Evaluator, float]], *, name: str = "composite",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not components:
            raise ValueError("a composite needs at least one component")
        for _, w in components:
            if not (math.isfinite(w) and w > 0):
                raise ValueError(f"component weights must be finite and > 0, got {w!r}")
        self.components = [(ev, float(w)) for ev, w in components]
        self.name = name
        self.clock = clock

    def evaluate(self, target: EvaluationTarget, *, timeout_s: float | None = None) -> Assessment:
        start = self.clock()
        parts: list[dict[str, Any]] = []
        failed: list[str] = []
        total = weights = 0.0
        for ev, w in self.components:
            left = None if timeout_s is None else timeout_s - (self.clock() - start)
            if left is not None and left <= 0:
                parts.append({"evaluator": ev.name, "weight": w, "status": "unresolved", "reason": "no time left"})
                failed.append(ev.name)
                continue
            try:
                a = ev.evaluate(target, timeout_s=left)
            except Exception as exc:
                a = Assessment.unresolved(f"evaluator crashed: {type(exc).__name__}: {exc}", target.assessed_ref,
                                          {"traceback": traceback.format_exc(limit=8)})
            parts.append({"evaluator": ev.name, "weight": w, "status": a.status.value,
                          "score": None if not a.valid else a.score, "details": a.details})
            if a.valid:
                total += w * a.score
                weights += w
            else:
                failed.append(ev.name)
        details = {"evaluator": self.name, "components": parts}
        dur = self.clock() - start
        if failed:
            return Assessment.unresolved(f"unresolved components: {', '.join(failed)}", target.assessed_ref,
                                         details, dur)
        return Assessment.valid_score(total / weights, target.assessed_ref, details, dur)
