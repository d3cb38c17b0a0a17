"""Advantages, the execution-level GSPO-style objective, loss normalisation.

* :mod:`gyre.rl.advantages` -- group-relative advantages (paper §5.3);
* :mod:`gyre.rl.objective` -- the execution-level GSPO-style objective (paper §6.1), needs torch.
"""

from gyre.rl.advantages import AdvantageConfig, GroupAdvantages, compute_advantages, group_advantages

__all__ = ["AdvantageConfig", "GroupAdvantages", "compute_advantages", "group_advantages"]

# The objective (gyre.rl.objective) needs torch: exported lazily so that importing the
# torch-free parts of gyre.rl (advantages) stays cheap.
_OBJECTIVE_EXPORTS = ("LOSS_TYPES", "ObjectiveConfig", "ObjectiveInputs", "ObjectiveOutput", "ObjectiveStats",
                      "execution_objective")


def __getattr__(name: str):
    if name in _OBJECTIVE_EXPORTS:
        from gyre.rl import objective

        return getattr(objective, name)
    raise AttributeError(f"module 'gyre.rl' has no attribute {name!r}")
