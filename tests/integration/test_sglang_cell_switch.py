"""A cell's role switches against an SGLang-protocol server started the way an SGLang cell starts
one: :class:`gyre.rollout.sglang_engine.SGLangEngine` launching the embedded engine in place of
``sglang.launch_server``.  Three rollout -> training -> rollout cycles while a client keeps calling
the model through the proxy: the engine sees SGLang's call order every time, and no call is lost."""

import sys
import threading

import httpx
import pytest

from gyre.embedded_model import load_hf_model, load_tokenizer
from gyre.proxy.engines import ClientEngine
from gyre.proxy.render import ChatRenderer
from gyre.proxy.server import ProxyConfig, ProxyServer
from gyre.rollout.config import EngineConfig
from gyre.rollout.embedded_server import EngineServer
from gyre.rollout.engine_client import AsyncEngineClient
from gyre.rollout.sglang_engine import SGLangEngine
from gyre.training.cell import CellRoles, TrainingState
from gyre.trajectory.store import TrajectoryStore

pytestmark = pytest.mark.slow


class Recording:
    """An engine client that logs each control call (the switch's view of the engine)."""

    def __init__(self, client):
        self.client, self.log = client, []

    def __getattr__(self, name):
        fn = getattr(self.client, name)

        def call(*args, **kw):
            tags = args[0] if args else kw.get("tags")
            self.log.append((name, tuple(tags) if name.endswith("memory_occupation") else
                             kw.get("weight_version") if name == "update_weights_from_tensor" else args[:1]))
            return fn(*args, **kw)

        return call


def test_sglang_call_order_and_no_call_lost(tmp_path, tiny_model_dir):
    cell_engine = SGLangEngine(tiny_model_dir, launcher=[sys.executable, "-m", "gyre.rollout.serve"],
                               startup_timeout=120, log_path=tmp_path / "engine.log").start()
    other = EngineServer(EngineConfig(model_dir=str(tiny_model_dir))).start()
    store = TrajectoryStore(tmp_path / "records", fsync_every=0)
    proxy = ProxyServer(ChatRenderer(load_tokenizer(tiny_model_dir)), store=store,
                        config=ProxyConfig(max_context_tokens=4096, retry_timeout_s=120))
    proxy.add_engine(ClientEngine(AsyncEngineClient(other.url), "engine-0"))
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
                        calls["other"].append(r.status_code)

        th = threading.Thread(target=client, daemon=True)
        th.start()
        trainer = load_hf_model(tiny_model_dir)
        named = {n: p.detach().clone() for n, p in trainer.state_dict().items() if n != "lm_head.weight"}
        engine = Recording(cell_engine.client(timeout=120))
        cell = CellRoles(1, "engine-1", engine, proxy, TrainingState(trainer.parameters()))
        cell.training.offload()
        for i in range(3):
            cell.to_train("engine-0")
            cell.to_rollout(str(i + 1), named)
            proxy.set_route(ex.execution_id, "engine-1")
            while calls["ok"] < 2 * (i + 1):  # the client is served between switches
                th.join(0.05)
        stop.set()
        th.join(120)
        assert not th.is_alive()
        one_cycle = [("pause_generation", ("abort",)), ("flush_cache", ()),
                     ("release_memory_occupation", ("weights", "kv_cache", "cuda_graph")),
                     ("resume_memory_occupation", ("weights",))]
        for i in range(3):
            assert engine.log[7 * i:7 * i + 7] == one_cycle + [
                ("update_weights_from_tensor", str(i + 1)), ("resume_memory_occupation", ("kv_cache", "cuda_graph")),
                ("continue_generation", ())]
        assert len(engine.log) == 21
        assert cell_engine.client().get_weight_version() == "3"
        proxy.close_execution(ex.execution_id)
        records = store.read_records(ex.execution_id)
        assert calls["other"] == [] and len(records) == calls["ok"] >= 6  # every call answered and recorded
    finally:
        stop.set()
        proxy.stop()
        other.stop()
        cell_engine.stop()
