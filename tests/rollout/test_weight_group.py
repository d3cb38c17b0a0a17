"""Weights broadcast from a trainer to engines over a weight-update group (SGLang's
``/init_weights_update_group`` + ``/update_weights_from_distributed``), on gloo: one broadcast
reaches two engine processes, which then serve exactly what an engine loaded by value serves; engines
of several TP ranks take consecutive ranks, each receiving every broadcast."""

import sys

import pytest
import torch

from gyre.rollout.ports import free_port


@pytest.mark.slow  # engine processes
def test_one_broadcast_updates_every_engine(tmp_path, tiny_model_dir):
    from gyre.rollout.client.engine_client import EngineClient
    from gyre.rollout.client.messages import EngineError
    from gyre.rollout.embedded.config import EngineConfig
    from gyre.rollout.embedded.model_runner import read_weights
    from gyre.rollout.embedded.server import EngineServer
    from gyre.rollout.sglang_driver.engine import SGLangEngine
    from gyre.rollout.weight_group import WeightBroadcaster

    proc = SGLangEngine(tiny_model_dir, launcher=[sys.executable, "-m", "gyre.rollout.embedded.serve"],
                        startup_timeout=120, log_path=tmp_path / "engine.log").start()
    # a second process, not an in-process engine: like SGLang's ranks, each group member is its own process
    local = SGLangEngine(tiny_model_dir, launcher=[sys.executable, "-m", "gyre.rollout.embedded.serve"],
                         startup_timeout=120, log_path=tmp_path / "engine2.log").start()
    ref = EngineServer(EngineConfig(model_dir=str(tiny_model_dir))).start()
    try:
        clients = [EngineClient(proc.url, timeout=120), EngineClient(local.url, timeout=120)]
        greedy = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
        prompt = [17, 23, 99, 512, 7]
        before = clients[0].generate(prompt, greedy).output_ids
        sender = WeightBroadcaster(clients, "127.0.0.1", free_port(), backend="gloo", timeout_s=60)
        g = torch.Generator().manual_seed(4)
        new = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in read_weights(tiny_model_dir).items()}
        names = sorted(new)
        buckets = [{n: new[n] for n in names[i:i + 4]} for i in range(0, len(names), 4)]
        assert sender.push(buckets, "v5") == len(names)
        EngineClient(ref.url, timeout=120).update_weights_from_tensor(new, weight_version="v5")
        expected = EngineClient(ref.url, timeout=120).generate(prompt, greedy).output_ids
        assert expected != before
        for c in clients:
            got = c.generate(prompt, greedy)
            assert got.weight_version == "v5" and got.output_ids == expected
        # a bucket of the wrong shape is refused after the broadcast, and the engines keep v5
        with pytest.raises(EngineError, match="shape"):
            sender.push([{"model.norm.weight": torch.ones(3)}], "bad")
        assert [c.get_weight_version() for c in clients] == ["v5", "v5"]
        sender.close()
        assert sender.group.process_group not in torch.distributed.distributed_c10d._world.pg_map
        with pytest.raises(EngineError, match="no weight-update group"):
            clients[1].update_weights_from_distributed(names=["model.norm.weight"], dtypes=["float32"],
                                                       shapes=[[1]], weight_version="x")
    finally:
        proc.stop()
        local.stop()
        ref.stop()


def test_joining_a_group_nobody_hosts_fails_with_a_clear_error(tiny_model_dir):
    from gyre.rollout.client.engine_client import EngineClient
    from gyre.rollout.client.messages import EngineError
    from gyre.rollout.embedded.config import EngineConfig
    from gyre.rollout.embedded.server import EngineServer
    from gyre.rollout.weight_group import open_weight_group

    server = EngineServer(EngineConfig(model_dir=str(tiny_model_dir))).start()
    try:
        port = free_port()
        import threading

        def host():  # rank 0 of a group of 3 whose rank 2 never comes: it gives up after 2 s
            with pytest.raises(Exception):
                open_weight_group("127.0.0.1", port, 0, 3, group_name="g", timeout_s=2)

        t = threading.Thread(target=host, daemon=True)
        t.start()
        with pytest.raises(EngineError, match="joining weight-update group 'g' at 127.0.0.1"):
            EngineClient(server.url, timeout=120).init_weights_update_group(
                master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=3, group_name="g",
                backend="gloo")
        t.join(30)
        assert EngineClient(server.url).health()
    finally:
        server.stop()


def test_engine_rank_offsets_follow_tp_sizes():
    from gyre.rollout.weight_group import engine_rank_offsets

    assert engine_rank_offsets([1, 1, 1]) == ([1, 2, 3], 4)
    assert engine_rank_offsets([2, 1, 4]) == ([1, 3, 4], 8)
    assert engine_rank_offsets([]) == ([], 1)
    with pytest.raises(ValueError, match=">= 1"):
        engine_rank_offsets([2, 0])


def _engine_rank(port, rank, world, out):
    from gyre.rollout.weight_group import open_weight_group

    g = open_weight_group("127.0.0.1", port, rank, world, group_name="wg", timeout_s=60)
    t = torch.zeros(3)
    g.broadcast(t)
    out.put((rank, t.tolist()))


class _TPEngine:
    """An engine of ``tp`` ranks as SGLang runs one: each TP rank a process joining at ``rank_offset + r``."""

    def __init__(self, tp, ctx, out):
        self.tp, self.ctx, self.out, self.procs, self.seen = tp, ctx, out, [], None

    def init_weights_update_group(self, *, master_address, master_port, rank_offset, world_size, group_name, backend):
        self.seen = (rank_offset, world_size)
        self.procs = [self.ctx.Process(target=_engine_rank, args=(master_port, rank_offset + r, world_size, self.out))
                      for r in range(self.tp)]
        for p in self.procs:
            p.start()
        return {"success": True}


@pytest.mark.slow  # engine processes
def test_engines_of_several_tp_ranks_each_receive_the_broadcast(monkeypatch):
    import multiprocessing as mp

    # as under torchrun, where torch's tcp:// rendezvous would host no store: the group must still form
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")

    from gyre.rollout.weight_group import WeightBroadcaster

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    engines = [_TPEngine(2, ctx, out), _TPEngine(1, ctx, out)]
    sender = WeightBroadcaster(engines, "127.0.0.1", free_port(), group_name="wg", tp_sizes=[2, 1], timeout_s=60)
    try:
        assert [e.seen for e in engines] == [(1, 4), (3, 4)]
        sender.group.broadcast(torch.tensor([1.0, 2.0, 3.0]))
        got = sorted(out.get(timeout=60) for _ in range(3))
        assert got == [(1, [1.0, 2.0, 3.0]), (2, [1.0, 2.0, 3.0]), (3, [1.0, 2.0, 3.0])]
    finally:
        for e in engines:
            for p in e.procs:
                p.join(30)
        from gyre.rollout.weight_group import close_weight_group

        close_weight_group(sender.group)
    with pytest.raises(ValueError, match="2 TP sizes for 1 engines"):
        WeightBroadcaster(engines[:1], "127.0.0.1", free_port(), tp_sizes=[2, 1])


@pytest.mark.slow  # engine processes
def test_a_multi_node_cells_client_broadcasts_its_buckets_to_the_engine(tmp_path, tiny_model_dir):
    """The client of a cell spanning nodes (no CUDA IPC across nodes): a role switch's bucketed load
    goes over a weight-update group it opens itself; the engine then serves what an engine loaded by
    value serves, and the cell's engine launcher hands this client out for ``nnodes`` > 1."""
    from gyre.rollout.client.engine_client import EngineClient
    from gyre.rollout.embedded.config import EngineConfig
    from gyre.rollout.embedded.model_runner import read_weights
    from gyre.rollout.embedded.server import EngineServer
    from gyre.rollout.sglang_driver.engine import SGLangCellEngine
    from gyre.rollout.sglang_driver.weights import SGLangGroupClient, SGLangTensorClient
    from gyre.rollout.weights import push_weight_buckets

    launcher = [sys.executable, "-m", "gyre.rollout.embedded.serve"]
    cell = SGLangCellEngine(tiny_model_dir, device="cpu", tp_size=1, nnodes=2, launcher=launcher,
                            startup_timeout=120, log_path=tmp_path / "engine.log").start()
    ref = EngineServer(EngineConfig(model_dir=str(tiny_model_dir))).start()
    try:
        client = cell.client(timeout=120)
        assert isinstance(client, SGLangGroupClient) and client.tp_size == 1
        assert isinstance(SGLangCellEngine(tiny_model_dir, device="cpu", tp_size=4, port=1).client(), SGLangTensorClient)
        g = torch.Generator().manual_seed(9)
        new = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in read_weights(tiny_model_dir).items()}
        names = sorted(new)
        buckets = [{n: new[n] for n in names[i:i + 6]} for i in range(0, len(names), 6)]
        client.pause_generation("abort")  # as a role switch leaves it
        assert push_weight_buckets(client, iter(buckets), "11", live=False) == len(names)
        client.continue_generation()
        EngineClient(ref.url, timeout=120).update_weights_from_tensor(new, weight_version="11")
        greedy = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
        got = client.generate([3, 1, 4, 1, 5], greedy)
        assert got.weight_version == "11"
        assert got.output_ids == EngineClient(ref.url, timeout=120).generate([3, 1, 4, 1, 5], greedy).output_ids
        client.close()
        assert client.broadcaster is None
    finally:
        cell.stop()
        ref.stop()
