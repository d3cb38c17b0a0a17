import pytest
import torch

from gyre.training.cell import CellRoles, SwitchFailedError, TrainingState


class FakeProxy:
    def __init__(self):
        self.calls = []
        self.routes = {"e1": "engine-1", "e2": "engine-1", "e3": "engine-0"}

    def reroute_engine(self, source, destination):
        moved = [e for e, r in self.routes.items() if r == source]
        for e in moved:
            self.routes[e] = destination
        self.calls.append(("reroute", source, destination))
        return moved

    def abort_engine(self, engine_id):
        self.calls.append(("abort", engine_id))
        return 2


class FakeEngine:
    def __init__(self, log, release_failures=0, update_failures=0):
        self.log = log
        self.release_failures = release_failures
        self.update_failures = update_failures

    def pause_generation(self, mode="abort"):
        self.log.append(("pause", mode))
        return {"success": True}

    def continue_generation(self):
        self.log.append(("continue",))
        return {"success": True}

    def release_memory_occupation(self, tags=None):
        if self.release_failures:
            self.release_failures -= 1
            raise RuntimeError("1 requests are running")
        self.log.append(("release", tuple(tags)))
        return {"success": True}

    def resume_memory_occupation(self, tags=None):
        self.log.append(("resume", tuple(tags)))
        return {"success": True}

    def flush_cache(self):
        pass

    def update_weights_from_tensor(self, named_tensors=None, *, weight_version, **kw):
        if self.update_failures:
            self.update_failures -= 1
            raise RuntimeError("weights do not match")
        self.log.append(("update", weight_version, sorted(dict(named_tensors))))
        return {"success": True}


def test_training_state_offload_restore_round_trip():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    exp_avg = opt.state[model.weight]["exp_avg"].clone()
    st = TrainingState(model.parameters(), opt)
    st.offload()
    assert all(p.numel() == 0 for p in model.parameters())
    assert opt.state[model.weight]["exp_avg"].numel() == 0
    st.offload()  # idempotent
    st.restore()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.equal(opt.state[model.weight]["exp_avg"], exp_avg)
    opt.step()  # the optimizer still works on the restored tensors


def test_mixed_precision_main_parameters_are_offloaded_too():
    """An optimizer holding fp32 main copies of bf16 parameters (as Megatron's does, under
    ``fp32_from_float16_groups``, possibly chained): they leave memory and come back identical."""
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    main = [p.detach().float().clone() + 0.001 for p in model.parameters()]

    class Chained:
        chained_optimizers = [type("Mixed", (), {"fp32_from_float16_groups": [main[:1], main[1:]], "state": {}})()]
        state: dict = {}

    st = TrainingState(model.parameters(), Chained())
    assert st.main_params == main
    before = [t.clone() for t in main]
    st.offload()
    assert all(t.numel() == 0 for t in main) and all(p.numel() == 0 for p in model.parameters())
    st.restore()
    assert all(torch.equal(a, b) and a.dtype == torch.float32 for a, b in zip(main, before))
    assert TrainingState(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1)).main_params == []


def test_transitions_follow_the_documented_order_and_are_measured():
    log = []
    proxy = FakeProxy()
    ticks = iter([0.0, 0.1, 0.3, 0.35, 1.0, 1.05, 1.25, 1.5, 1.75])
    seen = []
    cell = CellRoles(1, "engine-1", FakeEngine(log), proxy, clock=lambda: next(ticks), on_transition=seen.append)
    tr = cell.to_train("standalone-0")
    assert proxy.calls == [("reroute", "engine-1", "standalone-0"), ("abort", "engine-1")]
    assert proxy.routes == {"e1": "standalone-0", "e2": "standalone-0", "e3": "engine-0"}
    assert log == [("pause", "abort"), ("release", ("weights", "kv_cache", "cuda_graph"))]
    assert (tr.direction, tr.rerouted, tr.aborted) == ("rollout->training", 2, 2)
    assert tr.latency_s == pytest.approx(0.35) and tr.phases_s["release"] == pytest.approx(0.2)
    with pytest.raises(RuntimeError, match="cell 1 is training, not rollout"):
        cell.to_train("x")
    tr2 = cell.to_rollout("7", {"w": torch.zeros(1)})
    # weights first (small), then the KV cache and CUDA graphs once the training state is offloaded
    assert log[2:] == [("resume", ("weights",)), ("update", "7", ["w"]), ("resume", ("kv_cache", "cuda_graph")),
                       ("continue",)]
    assert tr2.latency_s == pytest.approx(0.75) and tr2.version == "7"
    assert tr2.phases_s == pytest.approx({"resume_weights": 0.05, "load_weights": 0.2, "offload": 0.25,
                                          "resume_kv": 0.25})
    assert [t.direction for t in seen] == ["rollout->training", "training->rollout"]
    with pytest.raises(RuntimeError, match="not training"):
        cell.to_rollout("8", {})


def test_a_release_that_fails_is_retried_then_reported(monkeypatch):
    monkeypatch.setattr("gyre.training.cell.time.sleep", lambda s: None)
    log = []
    cell = CellRoles(1, "engine-1", FakeEngine(log, release_failures=2), None)
    cell.to_train(None)
    assert log == [("pause", "abort")] * 3 + [("release", ("weights", "kv_cache", "cuda_graph"))]
    assert cell.role == "training"
    log = []
    failing = CellRoles(2, "engine-2", FakeEngine(log, release_failures=3), None)
    with pytest.raises(SwitchFailedError, match=r"cell 2 could not release its engine's memory \(3 attempts\): "
                                                r"RuntimeError: 1 requests are running"):
        failing.to_train(None)
    assert failing.role == "rollout" and not failing.transitions
    assert log == [("pause", "abort")] * 3 + [("continue",)]  # it serves rollouts again


class BusyEngine(FakeEngine):
    """Answers /flush_cache with SGLang's 400 while ``busy`` requests are still running or waiting."""

    def __init__(self, log, busy):
        super().__init__(log)
        self.busy = busy

    def flush_cache(self):
        from gyre.rollout.client.messages import EngineError

        if self.busy:
            self.busy -= 1
            self.log.append(("flush", 400))
            raise EngineError(400, "Cache not flushed: running or waiting requests")
        self.log.append(("flush", 200))


def test_memory_is_released_only_once_the_engine_flushes_its_cache(monkeypatch):
    monkeypatch.setattr("gyre.training.cell.time.sleep", lambda s: None)
    log = []
    CellRoles(1, "engine-1", BusyEngine(log, busy=2), None).to_train(None)
    assert log == [("pause", "abort"), ("flush", 400), ("flush", 400), ("flush", 200),
                   ("release", ("weights", "kv_cache", "cuda_graph"))]
    log, now = [], [0.0]

    def monotonic():
        now[0] += 1.0
        return now[0]

    monkeypatch.setattr("gyre.training.cell.time.monotonic", monotonic)
    stuck = CellRoles(2, "engine-2", BusyEngine(log, busy=10 ** 6), None)
    stuck.idle_timeout_s = 3.0
    with pytest.raises(SwitchFailedError, match="HTTP 400: Cache not flushed"):
        stuck.to_train(None)
    assert ("release", ("weights", "kv_cache", "cuda_graph")) not in log and log[-1] == ("continue",)
    assert stuck.role == "rollout" and log.count(("pause", "abort")) == 3


def test_a_failed_return_to_rollout_rolls_back_to_training():
    model = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    log = []
    cell = CellRoles(1, "engine-1", FakeEngine(log, update_failures=1), None, TrainingState(model.parameters()))
    cell.role = "training"
    with pytest.raises(SwitchFailedError, match="cell 1 could not bring its engine back: RuntimeError: weights do "
                                                "not match"):
        cell.to_rollout("3", {"w": torch.zeros(1)})
    assert cell.role == "training" and not cell.transitions
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # never offloaded
    assert log == [("resume", ("weights",)), ("pause", "abort"), ("release", ("weights",))]
    cell.to_rollout("3", {"w": torch.zeros(1)})  # the next command succeeds
    assert cell.role == "rollout" and log[-3:] == [("update", "3", ["w"]), ("resume", ("kv_cache", "cuda_graph")),
                                                   ("continue",)]


class FailingResume(FakeEngine):
    def resume_memory_occupation(self, tags=None):
        if "kv_cache" in tags:
            raise RuntimeError("out of memory")
        return super().resume_memory_occupation(tags)


def test_a_failed_kv_resume_releases_the_weights_and_restores_the_training_state():
    model = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    log = []
    cell = CellRoles(1, "engine-1", FailingResume(log), None, TrainingState(model.parameters()))
    cell.role = "training"
    with pytest.raises(SwitchFailedError, match="RuntimeError: out of memory"):
        cell.to_rollout("3", {"w": torch.zeros(1)})
    assert log == [("resume", ("weights",)), ("update", "3", ["w"]), ("pause", "abort"), ("release", ("weights",))]
    assert cell.role == "training" and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
