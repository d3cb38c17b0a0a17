"""Three rollout -> training -> rollout cycles of a cell whose engine is a real SGLang server, while
a client keeps calling the model through Gyre's proxy (its execution pinned to the cell between
switches, rerouted to a second SGLang server during them): every call is answered and recorded,
the weights come back with each switch's version, and the server never trips its idle assert."""

from __future__ import annotations

import threading
import time

from tests.sglang.conftest import assert_clean_log
from tests.switch_client import CallingClient


def test_three_switch_cycles_through_the_proxy(sglang_server, cell_server, sglang_model_dir, tmp_path):
    from gyre.embedded_model import load_hf_model
    from gyre.rollout.sglang_driver.weights import SGLangTensorClient
    from gyre.training.cell import CellRoles, TrainingState

    caller = CallingClient(sglang_model_dir, tmp_path / "records", sglang_server.url, cell_server.url,
                           max_context_tokens=900)
    try:
        trainer = load_hf_model(sglang_model_dir)
        named = {n: p.detach().clone() for n, p in trainer.state_dict().items() if n != "lm_head.weight"}
        engine = SGLangTensorClient(cell_server.client(timeout=120), "cpu", 1)
        cell = CellRoles(1, "engine-1", engine, caller.proxy, TrainingState(trainer.parameters()))
        cell.training.offload()
        health = []
        for i in range(3):
            cell.to_train("engine-0")
            with cell_server.client() as probe:
                health.append(probe.health())  # Gyre's servers answer without generating a token
            assert cell_server.proc.poll() is None
            cell.to_rollout(str(i + 1), named)
            caller.proxy.set_route(caller.execution.execution_id, "engine-1")
            deadline = time.monotonic() + 120
            while caller.ok < 2 * (i + 1):  # the client is served between switches
                assert not caller.other and time.monotonic() < deadline, (caller.other, cell.transitions)
                caller.thread.join(0.05)
        caller.stop()
        assert not caller.thread.is_alive()
        with cell_server.client() as c:
            assert c.get_weight_version() == "3" and c.health()
        print(f"switches: {[f'{t.direction} {t.latency_s:.2f}s' for t in cell.transitions]}; health while "
              f"released: {health}; calls answered {caller.ok}")
        assert health == [True] * 3  # a generating /health would wait 20 s for 503 each time
        records = caller.records()
        assert caller.other == [] and len(records) == caller.ok >= 6  # every call answered and recorded
        assert len(cell.transitions) == 6
    finally:
        caller.close()


class _Recording:
    """The real client, with each pause, flush (and whether SGLang accepted it) and release noted."""

    def __init__(self, client):
        self.client, self.calls = client, []

    def pause_generation(self, mode="abort"):
        self.calls.append(f"pause {mode}")
        return self.client.pause_generation(mode)

    def flush_cache(self):
        try:
            self.client.flush_cache()
        except Exception:
            self.calls.append("flush refused")
            raise
        self.calls.append("flush")

    def release_memory_occupation(self, tags=None):
        self.calls.append("release")
        return self.client.release_memory_occupation(tags)


def test_a_release_comes_only_after_sglang_said_it_was_idle(cell_server):
    """SGLang's release asserts its scheduler is idle and a failed assert takes the server down.  On
    0.5.23 an abort-mode pause already waits for the requests its front end holds, so the cell's own
    wait is checked directly: called while a request runs, it returns only after SGLang has finished
    that request (its flushes refused until then); and a release follows a flush SGLang accepted."""
    from gyre.training.cell import CellRoles

    box = {}

    def run(key):
        with cell_server.client() as c:
            box[key] = c.generate(list(range(10, 50)), {"max_new_tokens": 300, "ignore_eos": True})

    with cell_server.client() as c:
        engine = _Recording(c)
        roles = CellRoles(0, "engine-0", engine, None, None)
        t = threading.Thread(target=run, args=("waited",))
        t.start()
        time.sleep(1.0)
        assert t.is_alive()
        roles._wait_until_idle()
        assert "waited" in box and not box["waited"].aborted and box["waited"].completion_tokens == 300
        assert engine.calls[0] == "flush refused" and engine.calls[-1] == "flush"
        t.join(60)
        engine.calls.clear()
        t = threading.Thread(target=run, args=("aborted",))
        t.start()
        time.sleep(1.0)
        roles.release_engine()
        t.join(60)
        assert engine.calls[0] == "pause abort" and engine.calls[-2:] == ["flush", "release"], engine.calls
        assert box["aborted"].aborted and cell_server.proc.poll() is None
        c.resume_memory_occupation(None)
        c.continue_generation()
        assert c.generate([1, 2, 3], {"max_new_tokens": 2}).completion_tokens == 2
    assert_clean_log(cell_server)
