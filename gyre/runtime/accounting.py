"""What the controller counts: per-group and per-step statistics, role changes, busy time, the
run's summary (``summary.json``, ``timeline.json``) and its console form.

Pure bookkeeping: the controller feeds it and passes the clock's reading in; it reads the
scheduler's state and never talks to cells or the proxy.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.scheduler.events import CellState
from gyre.training import control as ctl

#: Step statistics reported by the core that become metrics of the step.
TRAIN_METRICS = ("loss", "clip_fraction", "clip_fraction_high", "clip_fraction_low", "token_clip_fraction",
                 "rho_mean", "rho_max", "rho_capped_fraction", "train_inference_mismatch", "entropy", "grad_norm",
                 "row_tokens", "forward_tokens", "consume_s", "update_s", "compute_s")


@dataclass
class GroupStats:
    """One rollout group: its task and version at dispatch, then what training received of it."""

    task: str
    version: int
    closed_rewards: list[float] = field(default_factory=list)   # valid rewards in closing order
    designated: list[str] = field(default_factory=list)         # execution ids trained
    rewards: list[float] = field(default_factory=list)          # the N rewards of the baseline
    zero_std: bool = False
    trajectories: int = 0
    targets: int = 0
    timeouts: int = 0
    excluded: int = 0
    micro_steps: int = 0
    dropped: str | None = None

    def closed(self, reward: float | None, *, surplus: bool) -> None:
        """One of the group's executions closed (a surplus one never counts)."""
        if reward is not None and not surplus:
            self.closed_rewards.append(float(reward))

    def ready(self, rg, group) -> None:
        """The group became ready (``rg``: the buffer's ReadyGroup) and was assembled as ``group``."""
        self.designated, self.rewards, self.zero_std = list(rg.execution_ids), list(rg.rewards), rg.zero_std
        self.trajectories, self.targets, self.micro_steps = len(group.rows), group.targets, group.micro_steps
        self.timeouts = sum(o.termination.value == "timeout" for o in rg.outcomes)
        self.excluded = len(rg.excluded_execution_ids)

    def drop(self, gd, n: int) -> None:
        """The buffer dropped the group: its first ``n`` closed rewards still count in the step's reward."""
        self.dropped, self.designated, self.excluded = gd.reason.value, [], len(gd.excluded_execution_ids)
        self.rewards = self.closed_rewards[:n]


@dataclass
class StepInfo:
    """One optimizer step: its groups, staleness, timing, window and the core's statistics."""

    step: int
    group_ids: list[int] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    started: float | None = None
    closed: float | None = None
    core_joined: bool = False
    window: int = 0
    train: ctl.StepDone | None = None
    switches: list[float] = field(default_factory=list)


class RunAccounting:
    """Counters of one run (module docstring).  After a resume, ``before`` is the whole run's
    summary at the checkpoint and ``before_timeline`` its role timeline over ``before_elapsed_s``
    seconds; :meth:`summary` and :meth:`role_timeline` then cover the whole run."""

    def __init__(self, history: dict | None = None, *, before: dict | None = None,
                 before_timeline: list | None = None, before_elapsed_s: float = 0.0):
        self.before, self.before_timeline, self.before_elapsed_s = before, before_timeline or [], before_elapsed_s
        self.groups: dict[int, GroupStats] = {}
        self.steps: dict[int, StepInfo] = {}
        self.transitions: list[dict[str, Any]] = []
        self.history = history or {"reward_mean_by_step": {}, "executions": 0}
        self.overlap_s = self.rollout_busy_s = self.training_busy_s = 0.0
        self.steps_without_signal = 0   # steps whose groups all had equal rewards (or were dropped)
        self._no_signal_note: str | None = None
        self.tasks_skipped = 0          # malformed tasks the task files held (not run)
        self.live_pushes = 0            # weight loads into an engine that kept serving

    def step(self, step: int) -> StepInfo:
        return self.steps.setdefault(step, StepInfo(step))

    def enqueued(self, step: int, group: int, staleness: int) -> None:
        """Group ``group`` joined step ``step``'s stream ``staleness`` versions behind."""
        self.step(step).group_ids.append(group)
        self.step(step).staleness.append(staleness)

    def busy(self, dt: float, *, training: bool, rolling: bool) -> None:
        """``dt`` seconds passed with some cell training and/or some execution running."""
        self.overlap_s += dt if (training and rolling) else 0.0
        self.training_busy_s += dt if training else 0.0
        self.rollout_busy_s += dt if rolling else 0.0

    def published(self, reply: ctl.Published) -> None:
        """Count a live weight push (a serving engine that had to load the new version)."""
        if reply.load_s > 0:
            self.live_pushes += 1

    def transition(self, reply: ctl.Switched, step: int, now: float) -> dict[str, Any]:
        """Record one role change (during step ``step``); returns the timeline record."""
        direction = "rollout->training" if reply.role == "training" else "training->rollout"
        rec = {"cell": reply.cell, "direction": direction, "latency_s": reply.latency_s, "t": now, **reply.phases_s}
        if reply.version is not None:
            rec["version"] = float(reply.version)
        self.transitions.append(rec)
        self.step(step).switches.append(reply.latency_s or 0.0)
        return rec

    def step_metrics(self, step: int, sched, *, now: float) -> dict[str, float]:
        """The metrics of step ``step`` (the training reward counts every group, dropped ones too);
        ``sched`` is the run's :class:`gyre.scheduler.Scheduler` (read only)."""
        info = self.steps[step]
        groups = [self.groups[g] for g in info.group_ids]
        rewards = [r for g in groups for r in g.rewards]
        designated = sum(len(g.designated) for g in groups)
        m: dict[str, float] = {
            "reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
            "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            "pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else float("nan"),
            "groups": len(groups),
            "groups_dropped": sum(g.dropped is not None for g in groups),
            "groups_zero_std": sum(g.zero_std for g in groups),
            "executions_trained": designated,
            "timeouts": sum(g.timeouts for g in groups),
            "excluded_executions": sum(g.excluded for g in groups),
            "trajectories_per_execution": sum(g.trajectories for g in groups) / designated if designated else 0.0,
            "targets_per_execution": sum(g.targets for g in groups) / designated if designated else 0.0,
            "staleness_mean": statistics.fmean(info.staleness) if info.staleness else 0.0,
            "waterlevel": sched.counters.waterlevel,
            "cells_training": sched.cells_in([CellState.TRAINING]),
            "cells_rollout": sched.cells_in([CellState.ROLLOUT]),
            "switch_latency_s": statistics.fmean(info.switches) if info.switches else float("nan"),
            "step_time_s": (info.closed or now) - (info.started or 0.0),
            "window": info.window,
        }
        t = info.train.metrics() if info.train is not None else {}
        m.update({k: t[k] for k in TRAIN_METRICS if k in t})
        if "row_tokens" in t and t.get("consume_s", 0) > 0:
            m["tokens_per_s"] = t["row_tokens"] / (t["consume_s"] + t.get("update_s", 0.0))
        self.history["reward_mean_by_step"][str(step + 1)] = m["reward_mean"]  # numbered as metrics.jsonl
        if groups and all(g.zero_std or g.dropped is not None for g in groups):
            self.steps_without_signal += 1
            if self.steps_without_signal == 1:
                self._no_signal_note = (f"step {step + 1}: every group's rewards were equal: zero advantages, "
                                        f"nothing to learn from this step (the summary counts such steps)")
        return m

    def role_timeline(self, sched, now: float) -> list[list[tuple[float, float, str]]]:
        """Each cell's ``(start_s, stop_s, state)`` intervals over the whole run (earlier attempts
        first; this attempt's times shifted by their run time)."""
        cur = [[(a + self.before_elapsed_s, b + self.before_elapsed_s, state.value) for a, b, state in cell]
               for cell in sched.role_timeline(now)]
        prev = [[tuple(iv) for iv in cell] for cell in self.before_timeline]
        return [(prev[c] if c < len(prev) else []) + cur[c] for c in range(len(cur))]

    def take_no_signal_note(self) -> str | None:
        """The console note about the first step without learning signal, once."""
        note, self._no_signal_note = self._no_signal_note, None
        return note

    def summary(self, sched, executions, *, placement: str, first_step: int, wall_s: float) -> dict[str, Any]:
        """``summary.json`` of the whole run: this attempt's counters (its own, the scheduler's
        ``sched`` and the :class:`gyre.runtime.executions.ExecutionTable`'s, read only) added
        to ``before``'s."""
        return merge_summaries(self.before, self._attempt_summary(sched, executions, placement=placement,
                                                                  first_step=first_step, wall_s=wall_s))

    def _attempt_summary(self, sched, executions, *, placement: str, first_step: int,
                         wall_s: float) -> dict[str, Any]:
        to_t = [t["latency_s"] for t in self.transitions if t["direction"] == "rollout->training"]
        to_r = [t["latency_s"] for t in self.transitions if t["direction"] == "training->rollout"]
        trained = [s for s in self.steps.values() if s.closed is not None]
        train = [s.train for s in trained if s.train is not None]
        return {
            "placement": placement,
            "steps": sched.steps_done,
            "first_step": first_step,
            "executions": executions.launched,
            "executions_closed": executions.closed_by_status,
            "executions_trained": len(executions.trained),
            "reward_mean_by_step": self.history["reward_mean_by_step"],
            "role_changes": len(self.transitions),
            "switch_failures": sched.switch_failures,
            "weight_pushes": {"live": self.live_pushes, "at_switch": len(to_r)},
            "switch_latency_s": {"rollout_to_training": to_t, "training_to_rollout": to_r,
                                 "mean": statistics.fmean(to_t + to_r) if to_t + to_r else None},
            "train_rollout_overlap_s": round(self.overlap_s, 3),
            "time_per_phase_s": {
                "rollout": round(self.rollout_busy_s, 3),          # some execution running
                "training": round(self.training_busy_s, 3),        # some cell in the training role
                "overlap": round(self.overlap_s, 3),
                "micro_steps": round(sum(t.consume_s for t in train), 3),
                "update": round(sum(t.update_s for t in train), 3),
                "switching": round(sum(t["latency_s"] or 0.0 for t in self.transitions), 3)},
            "trajectories_admitted": sum(self.groups[g].trajectories for s in trained for g in s.group_ids),
            "tokens_trained": sum(t.row_tokens or 0.0 for t in train),
            "steps_without_signal": self.steps_without_signal,
            "tasks_skipped": self.tasks_skipped,
            "staleness_mean": sched.mean_staleness,
            "wall_s": round(wall_s, 3),
        }


def merge_summaries(before: dict[str, Any] | None, now: dict[str, Any]) -> dict[str, Any]:
    """The whole run's summary from ``before`` (the run up to the checkpoint resumed from) and
    ``now`` (this attempt, from ``now["first_step"]`` on): counts and times add up, latencies
    concatenate, the staleness is weighted by steps; ``attempts`` counts the attempts."""
    if not before:
        return {**now, "attempts": 1}
    out = dict(now)
    out["switch_failures"] = before.get("switch_failures", 0) + now["switch_failures"]
    if "weight_pushes" in now:  # a run from before the count started has none
        pushes = before.get("weight_pushes", {})
        out["weight_pushes"] = {k: pushes.get(k, 0) + v for k, v in now["weight_pushes"].items()}
    for k in ("executions", "role_changes", "train_rollout_overlap_s", "trajectories_admitted", "tokens_trained",
              "steps_without_signal", "wall_s"):
        out[k] = round(before[k] + now[k], 3) if isinstance(now[k], float) else before[k] + now[k]
    for k in ("executions_closed", "time_per_phase_s"):
        keys = list(dict.fromkeys([*before[k], *now[k]]))
        out[k] = {x: round(before[k].get(x, 0) + now[k].get(x, 0), 3) for x in keys}
    sw = {d: before["switch_latency_s"][d] + now["switch_latency_s"][d]
          for d in ("rollout_to_training", "training_to_rollout")}
    every = sw["rollout_to_training"] + sw["training_to_rollout"]
    out["switch_latency_s"] = {**sw, "mean": statistics.fmean(every) if every else None}
    n_before, n_now = before["steps"], now["steps"] - now["first_step"]
    out["staleness_mean"] = ((before["staleness_mean"] * n_before + now["staleness_mean"] * n_now)
                             / (n_before + n_now)) if n_before + n_now else 0.0
    out["attempts"] = before.get("attempts", 1) + 1
    return out


def write_summary(run_dir: Path, summary: dict[str, Any], timeline: list, placement: str) -> None:
    """``summary.json`` and ``timeline.json`` (each cell's role intervals) in the run directory."""
    (run_dir / "timeline.json").write_text(json.dumps({"timeline": timeline, "placement": placement}))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))


#: The console's explanation of steps that could not change the policy.
NO_SIGNAL = ("gyre: {n} of {of} steps had no learning signal: in each, every group's executions got equal rewards, "
             "so every advantage (and the loss and its gradient) was 0; tasks the policy always or never solves "
             "teach it nothing (examples/cpu_toy_learning.yaml is a task set it learns from)")


def format_step(iteration: int, m: dict[str, Any]) -> str:
    """The log line of step ``iteration`` (1-based) from its metrics ``m``."""
    return (f"step {iteration}: reward {m['reward_mean']:.3f} ({m['groups']} groups), loss {m.get('loss')}, "
            f"grad norm {m.get('grad_norm')}, staleness {m['staleness_mean']:.2f}, window {m['window']}")


def format_summary(s: dict[str, Any]) -> str:
    """A few human-readable lines of ``summary.json`` for the console."""
    rewards = ", ".join(f"{float(v):.3f}" if v is not None else "-"
                        for _, v in sorted(s["reward_mean_by_step"].items(), key=lambda kv: int(kv[0])))
    sw = s["switch_latency_s"]
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
    ph = s["time_per_phase_s"]
    return "\n".join([
        f"gyre: {s['steps']} steps ({s['placement']}) in {s['wall_s']:.1f} s; executions {s['executions']} "
        f"(closed {s['executions_closed']}), trained {s['executions_trained']}",
        f"gyre: reward by step [{rewards}]",
        f"gyre: trajectories admitted {s['trajectories_admitted']}, tokens trained {int(s['tokens_trained'])}, "
        f"mean staleness {s['staleness_mean']:.2f}",
        f"gyre: role changes {s['role_changes']}, switch median R->T {med(sw['rollout_to_training']):.3f} s, "
        f"T->R {med(sw['training_to_rollout']):.3f} s"
        + (f", failed switches {s['switch_failures']}" if s.get("switch_failures") else "")
        + (f"; weight pushes live {s['weight_pushes']['live']}, at switch {s['weight_pushes']['at_switch']}"
           if "weight_pushes" in s else ""),
        f"gyre: time per phase: rollout {ph['rollout']:.1f} s, training {ph['training']:.1f} s, overlap "
        f"{ph['overlap']:.1f} s, micro-steps {ph['micro_steps']:.1f} s, updates {ph['update']:.1f} s, "
        f"switching {ph['switching']:.1f} s",
        *([NO_SIGNAL.format(n=s["steps_without_signal"], of=s["steps"])] if s.get("steps_without_signal") else []),
        *([f"gyre: {s['tasks_skipped']} malformed task(s) in the task files were skipped (the warnings at the "
           f"start name them; --strict-tasks refuses such a run)"] if s.get("tasks_skipped") else [])])
