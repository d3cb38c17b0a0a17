"""Request records (TITO records): one model call, token-in / token-out.

A :class:`RequestRecord` holds the *exact* token ids the engine saw (``input_ids``), the
token ids it sampled (``output_ids``) with their behaviour log-probs, and a per-input-token
provenance mask. The proxy builds records; the trajectory tree
(:mod:`gyre.trajectory.tree`) organises them; the store (:mod:`gyre.trajectory.store`)
makes them durable.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "Provenance",
    "Role",
    "ROLES",
    "DEFAULT_ROLE_PRIORITY",
    "RequestRecord",
    "EXECUTION_ID_RE",
]


class Provenance(enum.IntEnum):
    """Per-token provenance stored as ``int8``.

    * ``POLICY`` (0): sampled by our engine for an earlier call of this execution. Only
      policy tokens that are a node's *output* (i.e. carry a behaviour log-prob) can become
      training targets.
    * ``EXTERNAL`` (1): system/user prompt, tool result, injected assistant text, template
      tokens -- anything the policy did not sample in this context.
    * ``EVALUATOR`` (2): evaluator-produced text (critiques); never a target.
    """

    POLICY = 0
    EXTERNAL = 1
    EVALUATOR = 2


class Role(str, enum.Enum):
    """Who issued a model call."""

    MAIN = "main"
    SUBAGENT = "subagent"
    COMPACTION = "compaction"
    AUXILIARY = "auxiliary"
    EVALUATOR = "evaluator"


#: All role names, in the default priority order followed by ``evaluator``.
ROLES: tuple[str, ...] = tuple(r.value for r in Role)

#: Default admission priority: main > subagent > compaction > auxiliary.
#: ``evaluator`` is never trainable and may not appear in a priority list.
DEFAULT_ROLE_PRIORITY: tuple[str, ...] = ("main", "subagent", "compaction", "auxiliary")

#: Execution ids name files in the store, so they are restricted to a safe alphabet.
EXECUTION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")

_MAX_PROVENANCE = max(int(p) for p in Provenance)


def _as_1d(name: str, value: Any, dtype: np.dtype) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=dtype)
    if arr.dtype != dtype:
        if np.issubdtype(dtype, np.integer) and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
        info = np.iinfo(dtype) if np.issubdtype(dtype, np.integer) else None
        if info is not None and (arr.min() < info.min or arr.max() > info.max):
            raise ValueError(f"{name} has values outside {np.dtype(dtype).name}")
        arr = arr.astype(dtype)
    return arr


@dataclass(slots=True)
class RequestRecord:
    """One model call of one execution (a token-in / token-out record).

    Fields (arrays are converted and validated in ``__post_init__``; they are *not*
    copied when already of the right dtype, so treat them as immutable):

    * ``execution_id`` -- the execution this call belongs to (``[A-Za-z0-9._-]``, ≤ 200 chars).
    * ``call_index`` -- 0-based index of the call within the execution (unique per execution).
    * ``role`` -- one of :data:`ROLES` (``main``/``subagent``/``compaction``/``auxiliary``/
      ``evaluator``).
    * ``input_ids`` -- ``int32[n_in]``: the exact token ids given to the engine (full context).
    * ``output_ids`` -- ``int32[n_out]``: the token ids the engine sampled.
    * ``output_logprobs`` -- ``float32[n_out]``: behaviour log-probs (natural log) of
      ``output_ids`` under the serving policy; finite, ≤ 0 (a tiny positive rounding
      error up to 1e-3 is tolerated).
    * ``input_provenance`` -- ``int8[n_in]`` of :class:`Provenance` values: ``POLICY`` for
      input tokens an earlier call of this execution sampled, ``EXTERNAL`` otherwise,
      ``EVALUATOR`` for evaluator-produced text. Defaults to all ``EXTERNAL``.
    * ``policy_version`` -- published policy version that served the call (≥ 0).
    * ``engine_id`` -- the engine that produced the final response.
    * ``delivered`` -- whether the harness received this response. Undelivered outputs
      (e.g. the harness timed out and retried) are not trainable by default.
    * ``timings`` -- seconds, e.g. ``{"queued_s": .., "first_token_s": .., "total_s": ..}``.
    * ``finish_reason`` -- engine finish reason (``stop``, ``length``, ``abort``, ...).
    * ``metadata`` -- free JSON-serialisable data (harness headers, request id, ...).

    Output tokens have provenance ``POLICY`` (``EVALUATOR`` when ``role == "evaluator"``);
    see :meth:`output_provenance`.

    Raises:
        ValueError: on a bad execution id, role, negative index/version, wrong array
            shapes/dtypes, mismatched lengths, out-of-range provenance values, or
            non-finite/positive log-probs.
    """

    execution_id: str
    call_index: int
    role: str
    input_ids: np.ndarray
    output_ids: np.ndarray
    output_logprobs: np.ndarray
    input_provenance: np.ndarray | None = None
    policy_version: int = 0
    engine_id: str = ""
    delivered: bool = True
    timings: dict[str, float] = field(default_factory=dict)
    finish_reason: str = "stop"
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.execution_id, str) or not EXECUTION_ID_RE.match(self.execution_id):
            raise ValueError(f"bad execution_id {self.execution_id!r}: use [A-Za-z0-9._-], ≤ 200 chars")
        if isinstance(self.role, Role):
            self.role = self.role.value
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; expected one of {ROLES}")
        if int(self.call_index) != self.call_index or self.call_index < 0:
            raise ValueError(f"call_index must be a non-negative int, got {self.call_index!r}")
        self.call_index = int(self.call_index)
        if int(self.policy_version) != self.policy_version or self.policy_version < 0:
            raise ValueError(f"policy_version must be a non-negative int, got {self.policy_version!r}")
        self.policy_version = int(self.policy_version)
        self.delivered = bool(self.delivered)
        self.input_ids = _as_1d("input_ids", self.input_ids, np.dtype(np.int32))
        self.output_ids = _as_1d("output_ids", self.output_ids, np.dtype(np.int32))
        lp = np.asarray(self.output_logprobs)
        if lp.ndim != 1:
            raise ValueError(f"output_logprobs must be 1-D, got shape {lp.shape}")
        if lp.dtype != np.float32:
            lp = lp.astype(np.float32)
        self.output_logprobs = lp
        if lp.shape[0] != self.output_ids.shape[0]:
            raise ValueError(
                f"output_logprobs has {lp.shape[0]} entries for {self.output_ids.shape[0]} output tokens"
            )
        if lp.size and (not np.isfinite(lp).all() or lp.max() > 1e-3):
            raise ValueError("output_logprobs must be finite natural-log probabilities (≤ 0)")
        if self.input_provenance is None:
            self.input_provenance = np.full(self.input_ids.shape[0], int(Provenance.EXTERNAL), np.int8)
        else:
            prov = _as_1d("input_provenance", self.input_provenance, np.dtype(np.int8))
            if prov.shape[0] != self.input_ids.shape[0]:
                raise ValueError(
                    f"input_provenance has {prov.shape[0]} entries for {self.input_ids.shape[0]} input tokens"
                )
            if prov.size and (prov.min() < 0 or prov.max() > _MAX_PROVENANCE):
                raise ValueError("input_provenance values must be Provenance members (0, 1, 2)")
            self.input_provenance = prov
        if (self.input_ids.size and self.input_ids.min() < 0) or (self.output_ids.size and self.output_ids.min() < 0):
            raise ValueError("token ids must be non-negative")
        if not isinstance(self.timings, dict) or not isinstance(self.metadata, dict):
            raise ValueError("timings and metadata must be dicts")

    @property
    def num_input_tokens(self) -> int:
        """``n_in``, tokens."""
        return int(self.input_ids.shape[0])

    @property
    def num_output_tokens(self) -> int:
        """``n_out``, tokens."""
        return int(self.output_ids.shape[0])

    def output_provenance_value(self) -> int:
        """Provenance of every output token: ``EVALUATOR`` for evaluator calls, else ``POLICY``."""
        return int(Provenance.EVALUATOR if self.role == Role.EVALUATOR.value else Provenance.POLICY)

    def output_provenance(self) -> np.ndarray:
        """``int8[n_out]`` provenance of the output tokens (see :meth:`output_provenance_value`)."""
        return np.full(self.num_output_tokens, self.output_provenance_value(), np.int8)

    def same_as(self, other: "RequestRecord") -> bool:
        """Bit-exact equality of every field (arrays compared by dtype, shape and bytes)."""
        if not isinstance(other, RequestRecord):
            return False
        for name in ("input_ids", "output_ids", "output_logprobs", "input_provenance"):
            a, b = getattr(self, name), getattr(other, name)
            if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
                return False
        return (
            self.execution_id == other.execution_id
            and self.call_index == other.call_index
            and self.role == other.role
            and self.policy_version == other.policy_version
            and self.engine_id == other.engine_id
            and self.delivered == other.delivered
            and self.finish_reason == other.finish_reason
            and _json_equal(self.timings, other.timings)
            and _json_equal(self.metadata, other.metadata)
        )


def _json_equal(a: Any, b: Any) -> bool:
    """Equality that treats NaN == NaN (JSON round-trips keep NaN as NaN)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b
