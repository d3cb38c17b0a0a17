"""Weights broadcast from a trainer to engines over a weight-update group (SGLang's
``/init_weights_update_group`` + ``/update_weights_from_distributed``), on gloo: one broadcast
reaches an engine process and an in-process engine, which then serve exactly what an engine loaded
by value serves."""

import sys

import pytest
import torch

from gyre.rollout.sglang_engine import free_port


def test_one_broadcast_updates_every_engine(tmp_path, tiny_model_dir):
    from gyre.rollout.config import EngineConfig
    from gyre.rollout.embedded_server import EngineServer
    from gyre.rollout.engine_client import EngineClient
    from gyre.rollout.engine_messages import EngineError
    from gyre.rollout.model_runner import read_weights
    from gyre.rollout.sglang_engine import SGLangEngine
    from gyre.rollout.weight_group import WeightBroadcaster

    proc = SGLangEngine(tiny_model_dir, launcher=[sys.executable, "-m", "gyre.rollout.serve"],
                        startup_timeout=120, log_path=tmp_path / "engine.log").start()
    local = EngineServer(EngineConfig(model_dir=str(tiny_model_dir))).start()
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
        with pytest.raises(EngineError, match="no weight-update group"):
            clients[1].update_weights_from_distributed(names=["model.norm.weight"], dtypes=["float32"],
                                                       shapes=[[1]], weight_version="x")
    finally:
        proc.stop()
        local.stop()
        ref.stop()


def test_joining_a_group_nobody_hosts_fails_with_a_clear_error(tiny_model_dir):
    from gyre.rollout.config import EngineConfig
    from gyre.rollout.embedded_server import EngineServer
    from gyre.rollout.engine_client import EngineClient
    from gyre.rollout.engine_messages import EngineError
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
