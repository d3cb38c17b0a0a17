"""A real harness keeps running through repeated role changes of the cell serving it.

Two embedded engines behind the proxy: cell 1 (the execution's route) and cell 0.  The reference
agent (a real child process) works a 12-turn task with a policy warm-started to call ``bash`` every
turn, while cell 1 switches rollout <-> training every 0.1 s (the agent's 12 turns take ~1-2 s): reroute + abort on the way into
training (the proxy retries at cell 0), release/resume memory and a versioned weight load on the
way back.  The harness must see no error, its tree must have no gap or duplicate, and the
reroutes must reach the metrics.
"""

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from gyre.metrics import MetricsSink, read_metrics

pytestmark = pytest.mark.slow
TURNS = 12


@pytest.fixture(scope="module")
def tool_loop_model(tmp_path_factory, tiny_model_dir):
    from gyre.embedded_model import load_hf_model, load_tokenizer
    from gyre.training.warmstart import sft
    from tools.warmstart import tool_loop_examples

    out = tmp_path_factory.mktemp("tool-loop-model")
    model, tok = load_hf_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    losses = sft(model, tok, tool_loop_examples(), steps=60, lr=3e-3, seed=0)
    assert losses[-1] < 0.1 < losses[0]
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_harness_survives_repeated_role_changes(tmp_path, tool_loop_model):
    from gyre.embedded_model import load_hf_model
    from gyre.proxy.serve import RolloutService, parse_args
    from gyre.rollout.client.engine_client import EngineClient
    from gyre.trajectory.store import TrajectoryStore
    from gyre.training.cell import CellRoles

    svc = RolloutService(parse_args(["--num-engines", "2", "--model-dir", str(tool_loop_model), "--port", "0",
                                     "--save-dir", str(tmp_path / "records"), "--rollout-max-new-tokens", "64"]))
    proxy = svc.start()
    sink = MetricsSink(tmp_path / "run")
    try:
        named = {k: v.detach().clone() for k, v in load_hf_model(tool_loop_model).state_dict().items()}
        cell = CellRoles(1, "engine-1", EngineClient(svc.engines[1].url), proxy,
                         on_transition=lambda t: sink.event("role_change", cell=t.cell, direction=t.direction,
                                                            latency_s=t.latency_s, rerouted=t.rerouted))
        reg = httpx.post(f"{proxy.url}/gyre/executions", json={"task_id": "loop", "harness": "reference"}).json()
        eid = reg["execution_id"]
        proxy.set_route(eid, "engine-1")
        ws = tmp_path / "ws"
        ws.mkdir()
        agent = subprocess.Popen(
            [sys.executable, "-m", "gyre.harness.reference_agent", "--base-url", proxy.url + "/v1",
             "--instruction", "Run the checks, one step at a time.", "--workdir", str(ws), "--tools", "bash",
             "--max-turns", str(TURNS), "--temperature", "0", "--transcript-file", str(tmp_path / "transcript.jsonl")],
            env=dict(os.environ, GYRE_API_KEY=reg["api_key"]), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        version = 0
        deadline = time.monotonic() + 240
        while agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            if cell.role == "rollout":
                cell.to_train("engine-0")
            else:
                version += 1
                cell.to_rollout(str(version), named)
                proxy.set_route(eid, "engine-1")  # the scheduler routes the execution back
        _, err = agent.communicate(timeout=60)
        counters = proxy.counters(eid)
        sink.log(0, {f"proxy_{k}": v for k, v in counters.items()})
        tree = proxy.tree(eid)
        proxy.close_execution(eid)
    finally:
        svc.stop()
        sink.close()

    # the harness saw no error: it ran to its turn limit (3), not a model-API failure (4)
    assert agent.returncode == 3, err[-2000:]
    events = [json.loads(line)["event"] for line in (tmp_path / "transcript.jsonl").read_text().splitlines()]
    assert events.count("tool") == TURNS and "error" not in events
    assert len(cell.transitions) >= 4
    assert counters["calls"] == counters["delivered"] == TURNS and counters["failed"] == 0
    assert counters["reroutes"] >= 1 and counters["retries"] >= counters["reroutes"]
    # one path, one record per call: no gap, no duplicate
    assert len(tree.leaves()) == 1
    assert sorted(r.call_index for r in tree.records) == list(range(TURNS))
    stored = TrajectoryStore(tmp_path / "records").read_records(eid)
    assert [r.call_index for r in stored] == list(range(TURNS))
    rows, ev = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows[0]["proxy_reroutes"] == counters["reroutes"]
    assert sum(e["event"] == "role_change" for e in ev) == len(cell.transitions)
