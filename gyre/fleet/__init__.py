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
:mod:`~gyre.fleet.guard` (nothing a slot started outlives it). Only the first two import Ray, and
this package imports none of its modules, so ``import gyre.fleet`` does not.
"""
