"""Advantages, the execution-level GSPO-style objective, loss normalisation."""

from gyre.rl.advantages import AdvantageConfig, GroupAdvantages, compute_advantages, group_advantages

__all__ = ["AdvantageConfig", "GroupAdvantages", "compute_advantages", "group_advantages"]
