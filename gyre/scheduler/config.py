"""Scheduler configuration as plain data (flags of :mod:`gyre.arguments`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

PLACEMENTS: tuple[str, ...] = ("elastic", "async", "colocate")


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """Shape of the dispatch queue and the cell pool.

    Attributes:
        N: executions per rollout group (``--n-samples-per-prompt``).
        B: rollout groups per optimizer step (``--global-batch-groups``).
        phi: extra dispatch in units of ``B`` groups (``--extra-dispatch``); ``phi * B`` must be
            a whole number of groups.
        mu: optimizer steps per burst, i.e. between two weight publications (``--steps-per-burst``).
        num_cells: ``K`` cells; cell 0 is the core (``--num-cells``).
        rollout_concurrency_per_cell: ``c``, concurrent executions one rollout cell serves.
        standalone_concurrency: ``c_s``, concurrent executions of the standalone pool (0: none).
        placement: ``elastic``, ``async`` or ``colocate``.
        train_cells: async only: cells ``0..train_cells-1`` are fixed in training.
        max_steps: optimizer steps of the run; ``None`` runs until the shell stops.
        oversample: extra executions dispatched per group (``--oversample-executions``); the
            first ``N`` valid ones are used, the rest are closed as surplus.
        streaming: ``True``: ready groups enter the current step's stream one by one, so
            training starts before the step's ``B`` groups are all ready; ``False``: a step's
            groups enter its stream together, once ``B`` ready groups are waiting.
        standalone_handoff: colocate only, needs a standalone pool: the pool switches to
            training once the unfinished executions fit in the standalone pool (which keeps
            serving them) and there is training work, instead of waiting for all executions
            to finish (without ``streaming``, also once the burst's ``mu * B`` groups are
            ready); it also allows ``phi > 0``.
        max_switch_failures: a cell whose switch into training failed this many times in a row
            (``--max-switch-failures``) and every cell above it stay in rollout for the rest of
            the run; for the core (cell 0) this means no cell can train.

    Raises:
        ValueError: on an inconsistent shape (see :meth:`validate`, called on construction).
    """

    N: int = 16
    B: int = 32
    phi: float = 0.0
    mu: int = 1
    num_cells: int = 1
    rollout_concurrency_per_cell: int = 1
    standalone_concurrency: int = 0
    placement: str = "elastic"
    train_cells: int = 1
    max_steps: int | None = None
    oversample: int = 0
    streaming: bool = True
    standalone_handoff: bool = False
    max_switch_failures: int = 3

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the fields' ranges and the placement invariants; raise ``ValueError`` naming the field."""
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.N >= 1, f"N must be >= 1, got {self.N}")
        need(self.B >= 1, f"B must be >= 1, got {self.B}")
        need(self.mu >= 1, f"mu must be >= 1, got {self.mu}")
        need(math.isfinite(self.phi) and self.phi >= 0, f"phi must be >= 0, got {self.phi}")
        need(abs(self.phi * self.B - round(self.phi * self.B)) < 1e-9,
             f"phi * B must be a whole number of groups, got {self.phi} * {self.B}")
        need(self.num_cells >= 1, f"num_cells must be >= 1, got {self.num_cells}")
        need(self.rollout_concurrency_per_cell >= 1,
             f"rollout_concurrency_per_cell must be >= 1, got {self.rollout_concurrency_per_cell}")
        need(self.standalone_concurrency >= 0,
             f"standalone_concurrency must be >= 0, got {self.standalone_concurrency}")
        need(self.placement in PLACEMENTS, f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        need(self.oversample >= 0, f"oversample must be >= 0, got {self.oversample}")
        need(self.max_steps is None or self.max_steps >= 1, f"max_steps must be >= 1, got {self.max_steps}")
        need(self.max_switch_failures >= 1, f"max_switch_failures must be >= 1, got {self.max_switch_failures}")
        if self.placement == "colocate" and not self.standalone_handoff:
            need(self.phi == 0, f"colocate requires phi = 0 (unless standalone_handoff), got {self.phi}")
        if self.standalone_handoff:
            need(self.placement == "colocate", f"standalone_handoff is for colocate, got {self.placement!r}")
            need(self.standalone_concurrency > 0,
                 "standalone_handoff needs a standalone pool (standalone_concurrency > 0)")
        if self.placement == "async":
            need(1 <= self.train_cells < self.num_cells or
                 (1 <= self.train_cells <= self.num_cells and self.standalone_concurrency > 0),
                 f"async needs 1 <= train_cells < num_cells (or a standalone pool), got "
                 f"train_cells={self.train_cells}, num_cells={self.num_cells}")

    @property
    def extra_groups(self) -> int:
        """``phi * B``: groups dispatched beyond one burst's need."""
        return int(round(self.phi * self.B))

    @property
    def queue_depth_groups(self) -> int:
        """``(phi + mu) * B``: groups dispatched at startup (paper §4.1)."""
        return self.extra_groups + self.mu * self.B

    @property
    def executions_per_group(self) -> int:
        """``N + oversample``: executions dispatched per group."""
        return self.N + self.oversample

    @property
    def expected_staleness(self) -> float:
        """``E[d] = phi + (mu - 1) / 2`` (paper App. A)."""
        return self.phi + (self.mu - 1) / 2

    @classmethod
    def from_args(cls, args: Any, **overrides: Any) -> "SchedulerConfig":
        """Build from an argparse namespace of :mod:`gyre.arguments`.

        Reads ``n_samples_per_prompt``, ``global_batch_groups``, ``extra_dispatch``,
        ``steps_per_burst``, ``placement``, ``num_cells``, ``train_cells``,
        ``rollout_concurrency_per_cell``, ``standalone_concurrency``, ``oversample_executions``,
        ``max_switch_failures``, ``streaming_training``, ``standalone_handoff`` and ``train_steps``
        (as ``max_steps``); keyword ``overrides`` win over the namespace.
        """
        fields: dict[str, Any] = dict(
            N=int(args.n_samples_per_prompt),
            B=int(args.global_batch_groups),
            phi=float(args.extra_dispatch),
            mu=int(args.steps_per_burst),
            placement=str(args.placement),
            num_cells=int(args.num_cells),
            train_cells=int(args.train_cells),
            rollout_concurrency_per_cell=int(args.rollout_concurrency_per_cell),
            standalone_concurrency=int(args.standalone_concurrency),
            oversample=int(args.oversample_executions),
            max_steps=int(args.train_steps),
            max_switch_failures=int(args.max_switch_failures),
            streaming=bool(getattr(args, "streaming_training", True)),
            standalone_handoff=bool(getattr(args, "standalone_handoff", False)),
        )
        fields.update(overrides)
        return cls(**fields)
