"""The standalone pool's routing (route id -> engine id, spread over the pool) and its publication."""

import pytest
import torch

from gyre.runtime.standalone import StandalonePool, StandaloneRoutes
from gyre.scheduler.events import STANDALONE
from gyre.training import control as ctl


def test_cells_route_to_their_engine_and_the_pool_to_its_least_loaded_engine():
    r = StandaloneRoutes(["standalone-0", "standalone-1", "standalone-2"])
    assert r.engine_for("a", 2) == "engine-2" and r.engine_for("b", 0) == "engine-0"
    got = [r.engine_for(f"x{i}", STANDALONE) for i in range(7)]
    assert got == ["standalone-0", "standalone-1", "standalone-2"] * 2 + ["standalone-0"]
    assert r.load() == {"standalone-0": 3, "standalone-1": 2, "standalone-2": 2}
    # an execution keeps its pool engine when routed to the pool again
    assert r.engine_for("x1", STANDALONE) == "standalone-1"
    # closing frees a slot: the next one goes to the engine with the fewest executions
    r.release("x1")
    r.release("x4")
    assert r.load() == {"standalone-0": 3, "standalone-1": 0, "standalone-2": 2}
    assert r.engine_for("y", STANDALONE) == "standalone-1"
    # leaving the pool for a cell frees its engine too
    assert r.engine_for("x0", 1) == "engine-1"
    assert r.load() == {"standalone-0": 2, "standalone-1": 1, "standalone-2": 2}
    assert r.engine_for("z", STANDALONE) == "standalone-1"
    assert r.publish(3) == set()


def test_no_pool_refuses_the_standalone_route():
    r = StandaloneRoutes()
    assert r.engine_for("a", 1) == "engine-1"
    with pytest.raises(RuntimeError, match="standalone pool, which has no engine"):
        r.engine_for("a", STANDALONE)


class FakeClient:
    def __init__(self, fail=False):
        self.loads, self.fail = [], fail

    def update_weights_from_tensor(self, named, *, weight_version):
        if self.fail:
            raise ConnectionError("engine gone")
        self.loads.append((weight_version, {k: v.clone() for k, v in named.items()}))

    def get_server_info(self):
        return {"weight_version": self.loads[-1][0] if self.loads else "0"}

    def close(self):
        pass


class FakeServer:
    def __init__(self, i, fail=False):
        self.url, self.c, self.stopped = f"http://127.0.0.1:{9000 + i}", FakeClient(fail), False

    def client(self):
        return self.c

    def stop(self):
        self.stopped = True


class FakeSnapshot:
    """The core's snapshot at ``version``: every tensor filled with the version number."""

    def __init__(self, version):
        self.version, self.pulls = version, []

    def pull(self, tensors, *, at_least):
        self.pulls.append(at_least)
        assert self.version >= at_least
        for t in tensors:
            t.fill_(float(self.version))
        return self.version


SHAPES = [((2, 3), torch.float32), ((4,), torch.float32)]


class FakeStep:
    def hf_named(self, tensors):
        return {"w": tensors[0], "b": tensors[1]}


class Inbox:
    def __init__(self):
        self.sent = []

    def send(self, to, msg):
        self.sent.append((to, msg))


def test_pool_loads_every_engine_once_per_publication_and_replies_as_standalone():
    servers, snap, inbox = [FakeServer(0), FakeServer(1)], FakeSnapshot(2), Inbox()
    pool = StandalonePool(servers, snap, FakeStep(), SHAPES, inbox, version=0)
    assert pool.engine_ids == ["standalone-0", "standalone-1"]
    assert pool.urls == ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]
    assert pool.publish(1) == {STANDALONE}
    info = pool.server_info()  # waits for the load
    assert [i["weight_version"] for i in info] == ["2", "2"]  # the newest snapshot >= 1
    assert snap.pulls == [1]  # read once for both engines
    for s in servers:
        (version, named), = s.c.loads
        assert version == "2" and named["w"].shape == (2, 3) and torch.equal(named["b"], torch.full((4,), 2.0))
    (to, msg), = inbox.sent
    assert to == "rank0" and isinstance(msg, ctl.Published) and (msg.cell, msg.version) == (STANDALONE, 2)
    # version 2 is already served: the reply comes without another load
    pool.publish(2)
    pool.server_info()
    assert snap.pulls == [1] and [len(s.c.loads) for s in servers] == [1, 1]
    assert [(m.cell, m.version) for _, m in inbox.sent] == [(STANDALONE, 2), (STANDALONE, 2)]
    pool.stop()
    assert all(s.stopped for s in servers)


def test_a_failed_load_is_reported_as_failed():
    inbox = Inbox()
    pool = StandalonePool([FakeServer(0), FakeServer(1, fail=True)], FakeSnapshot(1), FakeStep(), SHAPES, inbox)
    pool.publish(1)
    assert [i["weight_version"] for i in pool.server_info()] == ["1", "0"]  # the first engine loaded
    (to, msg), = inbox.sent
    assert isinstance(msg, ctl.Failed) and (msg.cell, msg.command) == (STANDALONE, "load_weights")
    assert msg.detail == "ConnectionError: engine gone"
    assert pool.version == 0  # nothing counts as served
