"""Three rollout -> training -> rollout cycles of a cell whose engine is a real SGLang server, while
a client keeps calling the model through Gyre's proxy (its execution pinned to the cell between
switches, rerouted to a second SGLang server during them): every call is answered and recorded,
the weights come back with each switch's version, and the server never trips its idle assert."""

from __future__ import annotations

import threading
import time

import httpx

from tests.sglang.conftest import assert_clean_log


def test_three_switch_cycles_through_the_proxy(sglang_server, cell_server, sglang_model_dir, tmp_path):
    from gyre.embedded_model import load_hf_model, load_tokenizer
    from gyre.proxy.engines import ClientEngine
    from gyre.proxy.render import ChatRenderer
    from gyre.proxy.server import ProxyConfig, ProxyServer
    from gyre.rollout.engine_client import AsyncEngineClient
    from gyre.rollout.sglang_engine import SGLangTensorClient
    from gyre.training.cell import CellRoles, TrainingState
    from gyre.trajectory.store import TrajectoryStore

    cell_engine = cell_server
    store = TrajectoryStore(tmp_path / "records", fsync_every=0)
    proxy = ProxyServer(ChatRenderer(load_tokenizer(sglang_model_dir)), store=store,
                        config=ProxyConfig(max_context_tokens=900, retry_timeout_s=120))
    proxy.add_engine(ClientEngine(AsyncEngineClient(sglang_server.url), "engine-0"))
    proxy.add_engine(ClientEngine(AsyncEngineClient(cell_engine.url), "engine-1"))
    proxy.start()
    stop, calls = threading.Event(), {"ok": 0, "other": []}
    try:
        ex = proxy.register_execution(engine_id="engine-1")

        def client():
            with httpx.Client(timeout=120) as h:
                while not stop.is_set():
                    r = h.post(proxy.url + "/v1/chat/completions", headers={"authorization": f"Bearer {ex.api_key}"},
                               json={"model": "m", "max_tokens": 24, "ignore_eos": True,
                                     "messages": [{"role": "user", "content": "Tell me a long story."}]})
                    if r.status_code == 200:
                        calls["ok"] += 1
                    else:
                        calls["other"].append((r.status_code, r.text[:200]))

        th = threading.Thread(target=client, daemon=True)
        th.start()
        trainer = load_hf_model(sglang_model_dir)
        named = {n: p.detach().clone() for n, p in trainer.state_dict().items() if n != "lm_head.weight"}
        engine = SGLangTensorClient(cell_engine.client(timeout=120), "cpu", 1)
        cell = CellRoles(1, "engine-1", engine, proxy, TrainingState(trainer.parameters()))
        cell.training.offload()
        health = []
        for i in range(3):
            cell.to_train("engine-0")
            with cell_engine.client() as probe:
                health.append(probe.health())  # SGLang answers 503 while its memory is released
            assert cell_engine.proc.poll() is None
            cell.to_rollout(str(i + 1), named)
            proxy.set_route(ex.execution_id, "engine-1")
            deadline = time.monotonic() + 120
            while calls["ok"] < 2 * (i + 1):  # the client is served between switches
                assert not calls["other"] and time.monotonic() < deadline, (calls, cell.transitions)
                th.join(0.05)
        stop.set()
        th.join(120)
        assert not th.is_alive()
        with cell_engine.client() as c:
            assert c.get_weight_version() == "3" and c.health()
        print(f"switches: {[f'{t.direction} {t.latency_s:.2f}s' for t in cell.transitions]}; health while "
              f"released: {health}; calls answered {calls['ok']}")
        proxy.close_execution(ex.execution_id)
        records = store.read_records(ex.execution_id)
        assert calls["other"] == [] and len(records) == calls["ok"] >= 6  # every call answered and recorded
        assert len(cell.transitions) == 6
    finally:
        stop.set()
        proxy.stop()


def test_a_cell_that_starts_as_a_trainer_releases_only_when_idle(cell_server):
    """A request already waiting when the cell starts training (here: queued behind a retract pause)
    would trip SGLang's idle assert on release; the cell pauses in abort mode and waits first."""
    from gyre.training.cell import CellRoles

    box = {}

    def run():
        with cell_server.client() as c:
            box["res"] = c.generate(list(range(10, 50)), {"max_new_tokens": 400, "ignore_eos": True})

    t = threading.Thread(target=run)
    t.start()
    with cell_server.client() as c:
        time.sleep(1.0)
        c.pause_generation("retract")  # the request now waits in SGLang's queue
        CellRoles(0, "engine-0", c, None, None).release_engine()
        t.join(60)
        assert box["res"].aborted and cell_server.proc.poll() is None
        c.resume_memory_occupation(None)
        c.continue_generation()
        assert c.generate([1, 2, 3], {"max_new_tokens": 2}).completion_tokens == 2
    assert_clean_log(cell_server)
