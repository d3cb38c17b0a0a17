"""The rollout -> training race, reproduced deterministically on a real embedded engine.

A generate request that reaches the engine after the proxy aborted the cell's requests is running
when the cell switches; before the cell paused generation, ``release_memory_occupation`` then
failed (requests running) and the run ended.  Here the request is running at switch time by
construction, and a second one arrives while the cell trains.
"""

from __future__ import annotations

import threading

import pytest

from gyre.embedded_model import load_hf_model
from gyre.rollout.client.engine_client import EngineClient
from gyre.rollout.embedded.config import EngineConfig
from gyre.rollout.embedded.server import EngineServer
from gyre.training.cell import CellRoles
from tests.processes import wait_until


@pytest.fixture
def engine(tiny_model_dir):
    srv = EngineServer(EngineConfig(model_dir=str(tiny_model_dir), max_running_requests=4)).start()
    yield srv
    srv.stop()


def state(client: EngineClient) -> dict:
    return client.get_server_info()["internal_states"][0]


def generate_in_thread(client: EngineClient, box: dict, key: str, max_new_tokens: int) -> threading.Thread:
    def run():
        box[key] = client.generate([1, 2, 3, 4], {"max_new_tokens": max_new_tokens, "ignore_eos": True,
                                                  "temperature": 1.0})
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_request_in_flight_at_the_switch_is_aborted_and_a_late_one_waits(engine, tiny_model_dir):
    client = EngineClient(engine.url, timeout=120.0)
    roles = CellRoles(0, "engine-0", client, None)
    box: dict = {}
    first = generate_in_thread(client, box, "in_flight", max_new_tokens=4000)
    # it is running when the cell switches
    assert wait_until(lambda: state(client)["num_running_reqs"] == 1, 30, poll_s=0.01)

    tr = roles.to_train(None)  # no proxy abort reached it: the cell's own pause must
    first.join(30)
    assert roles.role == "training" and tr.direction == "rollout->training"
    assert box["in_flight"].finish_reason.type == "abort" and len(box["in_flight"].output_ids) < 4000
    info = state(client)
    assert info["paused"] == "abort" and info["memory_released"] == ["cuda_graph", "kv_cache", "weights"]

    late = generate_in_thread(client, box, "late", max_new_tokens=8)  # reaches the engine while it trains
    assert wait_until(lambda: state(client)["num_waiting_reqs"] == 1, 30, poll_s=0.01)
    assert "late" not in box and state(client)["num_running_reqs"] == 0

    weights = {k: v.detach() for k, v in load_hf_model(tiny_model_dir).state_dict().items()}
    roles.to_rollout("1", weights)
    late.join(60)
    assert box["late"].finish_reason.type == "length" and len(box["late"].output_ids) == 8
    assert box["late"].weight_version == "1"  # served by the weights loaded at the switch
    assert state(client)["paused"] is None
