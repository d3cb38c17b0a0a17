"""An execution fleet: executions run on the nodes of a Ray cluster, rank 0 keeps the proxy.

Rank 0 is the Ray driver; the scheduler, the proxy and every record stay there. Each node offers
execution slots as the Ray resource ``gyre_execution_slot``; an execution is placed on a free slot,
runs there in the node's own sandbox backend with its workspace on the node, calls rank 0's proxy
over the network with its own key, and is assessed there; its harness log, ``execution.json`` and
the preserved workspace's digest come back to rank 0's run directory. ``docs/fleet.md`` says how
to start one.

Modules: :mod:`~gyre.fleet.launcher` (rank 0: :class:`FleetLauncher`, what the pipeline calls in
place of a harness), :mod:`~gyre.fleet.slots` (the slot actors Ray places), :mod:`~gyre.fleet.node`
(what a slot does on its node), :mod:`~gyre.fleet.shipping` (the archives sent with an execution),
:mod:`~gyre.fleet.guard` (nothing a slot started outlives it). Only the first two import Ray;
names are imported lazily (PEP 562), so ``import gyre.fleet`` does not.
"""

import importlib

_LAZY = {
    "FleetLauncher": "gyre.fleet.launcher",
    "NodeEvaluator": "gyre.fleet.launcher",
    "connect_ray": "gyre.fleet.launcher",
    "launcher_from_args": "gyre.fleet.launcher",
    "SLOT_RESOURCE": "gyre.fleet.slots",
    "SlotPool": "gyre.fleet.slots",
    "SlotAgent": "gyre.fleet.node",
    "fleet_dir": "gyre.fleet.node",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gyre.fleet' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = sorted(_LAZY)
