"""Gyre: elastic online RL for xLong-horizon agents behind black-box harnesses.

Gyre trains a policy online on executions of unmodified agent harnesses: cells switch between
serving rollouts and hosting a training replica (:mod:`gyre.scheduler`), a proxy records the
harnesses' model calls as trajectories, evaluators score the preserved workspaces.
"""

__version__ = "0.1.0"
