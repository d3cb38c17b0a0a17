"""The fleet tier: a Ray cluster of three nodes on this machine (``ray.cluster_utils.Cluster``), each
offering two execution slots, one CPU and a 100 MB object store. Skipped as a whole when Ray is not
installed (``pip install -c constraints.txt -r requirements-fleet.txt``)."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install -c constraints.txt -r requirements-fleet.txt)")

# the proxy and renderer fixtures of the single-node pipeline tests, for the fleet pipeline tests
from tests.runtime.test_run_execution import proxy, renderer  # noqa: E402, F401

NODES = 3
SLOTS_PER_NODE = 2
STORE_BYTES = 100 << 20
#: Quick node-death detection for the node-loss tests (Ray's defaults take about 15 s).
SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                 "health_check_initial_delay_ms": 0}


def node_args() -> dict:
    from gyre.fleet.slots import SLOT_RESOURCE

    return {"num_cpus": 1, "resources": {SLOT_RESOURCE: SLOTS_PER_NODE}, "object_store_memory": STORE_BYTES}


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A fresh three-node cluster for one test, shut down after it; slots keep their files under
    ``tmp_path/fleet`` (``GYRE_FLEET_DIR``)."""
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("GYRE_FLEET_DIR", str(tmp_path / "fleet"))
    c = Cluster(initialize_head=True, head_node_args={**node_args(), "_system_config": SYSTEM_CONFIG})
    try:
        for _ in range(NODES - 1):
            c.add_node(**node_args())
        c.wait_for_nodes()
        yield c
    finally:
        import ray as _ray

        _ray.shutdown()
        c.shutdown()
