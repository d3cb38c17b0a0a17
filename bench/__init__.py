"""Gyre's benchmarks: scripts run as ``python bench/<name>.py``; their output is quoted in docs/
beside the command that produced it. Helpers they share are in :mod:`bench.common` (and, for the
chaos sections, ``chaos_common.py``); what they share with the tests is in :mod:`gyre.testing`.
``bench/`` and ``tests/`` never import each other.

Proxy: ``proxy.py`` (added latency, CPU per call by stage), ``render.py`` (per-call preparation),
``engine_client.py`` (the engine client's CPU), ``retry_memory.py``, ``kv_migration.py``,
``tree.py`` (trajectory trees). Scale: ``scale.py`` (rank 0's proxy path under the paper's load;
``scale_load.py`` its load generator, ``scale_workers.py`` 1 vs K proxy workers,
``scale_main_job.py`` the main job at scale). Faults: ``chaos.py`` (with ``chaos_common.py``,
``chaos_hostile.py``, ``chaos_processes.py``). Executions: ``executions.py``,
``executions_fleet.py``. Engines and training: ``engine.py``, ``model.py``, ``train.py``,
``switch.py``. Learning and scheduling: ``toy_learning.py``, ``placement_parity.py``, ``sim.py``,
``sim_fidelity.py``, ``policy_search.py``.
"""
