import pytest
import torch

from gyre.training.cell import CellRoles, TrainingState


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
    def __init__(self, log):
        self.log = log

    def release_memory_occupation(self, tags=None):
        self.log.append(("release", tuple(tags)))
        return {"success": True}

    def resume_memory_occupation(self, tags=None):
        self.log.append(("resume", tuple(tags)))
        return {"success": True}

    def update_weights_from_tensor(self, named_tensors=None, *, weight_version, **kw):
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


def test_transitions_follow_the_documented_order_and_are_measured():
    log = []
    proxy = FakeProxy()
    ticks = iter([0.0, 0.1, 0.3, 0.35, 1.0, 1.05, 1.25, 1.75])
    seen = []
    cell = CellRoles(1, "engine-1", FakeEngine(log), proxy, clock=lambda: next(ticks), on_transition=seen.append)
    tr = cell.to_train("standalone-0")
    assert proxy.calls == [("reroute", "engine-1", "standalone-0"), ("abort", "engine-1")]
    assert proxy.routes == {"e1": "standalone-0", "e2": "standalone-0", "e3": "engine-0"}
    assert log == [("release", ("weights", "kv_cache"))]
    assert (tr.direction, tr.rerouted, tr.aborted) == ("rollout->training", 2, 2)
    assert tr.latency_s == pytest.approx(0.35) and tr.phases_s["release"] == pytest.approx(0.2)
    with pytest.raises(RuntimeError, match="cell 1 is training, not rollout"):
        cell.to_train("x")
    tr2 = cell.to_rollout("7", {"w": torch.zeros(1)})
    assert log[1:] == [("resume", ("weights", "kv_cache")), ("update", "7", ["w"])]
    assert tr2.latency_s == pytest.approx(0.75) and tr2.version == "7"
    assert [t.direction for t in seen] == ["rollout->training", "training->rollout"]
    with pytest.raises(RuntimeError, match="not training"):
        cell.to_rollout("8", {})
