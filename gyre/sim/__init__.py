"""Discrete-event cluster simulator driving the real scheduler policy.

* :mod:`gyre.sim.workload` -- execution durations: the ``paper-nl2repo`` fit, trace files;
* :mod:`gyre.sim.cluster` -- :class:`ClusterSim`, the simpy shell around :class:`gyre.scheduler.Scheduler`;
* :mod:`gyre.sim.presets` -- named workload + cluster setups;
* :mod:`gyre.sim.compare` -- placements at matched mean staleness (``tools/simulate.py``);
* :mod:`gyre.sim.plot` -- per-cell role timelines;
* :mod:`gyre.sim.from_run` -- a simulator setup measured from a finished run directory;
* :mod:`gyre.sim.table1` -- the paper's Table 1 ablations as configurations;
  :mod:`gyre.sim.mechanisms` -- what a simulated run did, read from its event log;
  :mod:`gyre.sim.sweep` -- how the Table 1 ratios move with their inputs.
"""

from .cluster import ClusterSim, SimConfig, SimResult
from .compare import compare, placement_config, run_placement, staleness_shape
from .presets import PRESETS, Preset, load_preset
from .workload import (GroupSample, LognormalWorkload, MixtureLognormalWorkload, TraceWorkload, Workload,
                       fit_mixture, mixture_statistics, paper_nl2repo)

__all__ = ["ClusterSim", "SimConfig", "SimResult", "compare", "placement_config", "run_placement",
           "staleness_shape", "PRESETS", "Preset", "load_preset", "GroupSample", "LognormalWorkload",
           "MixtureLognormalWorkload", "TraceWorkload", "Workload", "fit_mixture", "mixture_statistics",
           "paper_nl2repo"]
