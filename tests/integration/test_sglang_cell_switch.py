"""A cell's role switches against an SGLang-protocol server started the way an SGLang cell starts
one: :class:`gyre.rollout.sglang_driver.engine.SGLangEngine` launching the embedded engine in place of
``sglang.launch_server``.  Three rollout -> training -> rollout cycles while a client keeps calling
the model through the proxy: the engine sees SGLang's call order every time, and no call is lost."""

import sys
import pytest

from gyre.embedded_model import load_hf_model
from gyre.rollout.embedded.config import EngineConfig
from gyre.rollout.embedded.server import EngineServer
from gyre.rollout.sglang_driver.engine import SGLangEngine
from gyre.training.cell import CellRoles, TrainingState
from tests.switch_client import CallingClient

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
    cell_engine = SGLangEngine(tiny_model_dir, launcher=[sys.executable, "-m", "gyre.rollout.embedded.serve"],
                               startup_timeout=120, log_path=tmp_path / "engine.log").start()
    other = EngineServer(EngineConfig(model_dir=str(tiny_model_dir))).start()
    caller = CallingClient(tiny_model_dir, tmp_path / "records", other.url, cell_engine.url)
    try:
        trainer = load_hf_model(tiny_model_dir)
        named = {n: p.detach().clone() for n, p in trainer.state_dict().items() if n != "lm_head.weight"}
        engine = Recording(cell_engine.client(timeout=120))
        cell = CellRoles(1, "engine-1", engine, caller.proxy, TrainingState(trainer.parameters()))
        cell.training.offload()
        for i in range(3):
            cell.to_train("engine-0")
            cell.to_rollout(str(i + 1), named)
            caller.proxy.set_route(caller.execution.execution_id, "engine-1")
            while caller.ok < 2 * (i + 1):  # the client is served between switches
                assert not caller.other, caller.other
                caller.thread.join(0.05)
        caller.stop()
        assert not caller.thread.is_alive()
        one_cycle = [("pause_generation", ("abort",)), ("flush_cache", ()),
                     ("release_memory_occupation", ("weights", "kv_cache", "cuda_graph")),
                     ("resume_memory_occupation", ("weights",))]
        for i in range(3):
            assert engine.log[7 * i:7 * i + 7] == one_cycle + [
                ("update_weights_from_tensor", str(i + 1)), ("resume_memory_occupation", ("kv_cache", "cuda_graph")),
                ("continue_generation", ())]
        assert len(engine.log) == 21
        assert cell_engine.client().get_weight_version() == "3"
        records = caller.records()
        assert caller.other == [] and len(records) == caller.ok >= 6  # every call answered and recorded
    finally:
        caller.close()
        other.stop()
        cell_engine.stop()
