"""Weight payloads and publication (gyre/rollout/weights.py)."""

import base64

import pytest
import torch

from gyre.rollout.api.sglang_api import ProtocolError
from gyre.rollout.embedded.model_runner import read_weights
from gyre.rollout.weights import (
    bucket_named_tensors,
    deserialize_named_tensors,
    publish_weights,
    push_weight_buckets,
    save_weights_for_disk_update,
    serialize_named_tensors,
)


def test_serialize_round_trip_dict_and_pairs():
    named = {"a": torch.arange(6.0).view(2, 3).t(), "b": torch.ones(2, dtype=torch.bfloat16)}
    back = deserialize_named_tensors([serialize_named_tensors(named), serialize_named_tensors([("c", torch.zeros(1))])])
    assert set(back) == {"a", "b", "c"} and torch.equal(back["a"], named["a"]) and back["b"].dtype == torch.bfloat16
    with pytest.raises(TypeError):
        serialize_named_tensors({"a": [1.0]})


@pytest.mark.parametrize("payload", ["***", base64.b64encode(b"not a torch file").decode()])
def test_bad_payloads_are_protocol_errors(payload):
    with pytest.raises(ProtocolError):
        deserialize_named_tensors([payload])
    with pytest.raises(ProtocolError):
        deserialize_named_tensors([serialize_named_tensors({})], load_format="flattened_bucket")


def test_buckets_respect_the_byte_limit():
    named = {f"t{i}": torch.zeros(10) for i in range(5)}          # 40 bytes each
    buckets = bucket_named_tensors(named, bucket_bytes=100)
    assert [len(b) for b in buckets] == [2, 2, 1]
    assert [n for b in buckets for n, _ in b] == list(named)
    assert len(bucket_named_tensors({"big": torch.zeros(100)}, bucket_bytes=10)) == 1


def test_save_for_disk_update_writes_tied_tensors_once(tmp_path):
    w = torch.randn(4, 3)
    path = save_weights_for_disk_update({"embed.weight": w, "lm_head.weight": w, "norm": torch.ones(3)}, tmp_path / "v1")
    back = read_weights(path)
    assert set(back) == {"embed.weight", "norm"} and torch.equal(back["embed.weight"], w)


def test_publish_weights_calls_every_engine_once():
    calls = []

    class FakeClient:
        def __init__(self, name):
            self.name = name

        def update_weights_from_tensor(self, **kw):
            calls.append((self.name, "tensor", len(kw["serialized_named_tensors"]), kw["weight_version"],
                          kw["abort_all_requests"]))
            return {"success": True}

        def update_weights_from_disk(self, path, **kw):
            calls.append((self.name, "disk", path, kw["weight_version"], kw["abort_all_requests"]))
            return {"success": True}

    clients = [FakeClient("e0"), FakeClient("e1")]
    named = {f"t{i}": torch.zeros(10) for i in range(3)}
    assert publish_weights(clients, weight_version="v7", named_tensors=named, bucket_bytes=40) == [{"success": True}] * 2
    assert calls == [("e0", "tensor", 3, "v7", False), ("e1", "tensor", 3, "v7", False)]
    calls.clear()
    publish_weights(clients, weight_version="v8", model_path="/dev/shm/w", abort_in_flight=True)
    assert calls == [("e0", "disk", "/dev/shm/w", "v8", True), ("e1", "disk", "/dev/shm/w", "v8", True)]
    with pytest.raises(ValueError):
        publish_weights(clients, weight_version="v9")


def test_megatron_shards_publish_into_the_hf_runner(tiny_model_dir):
    """Training side (Megatron TP=2 shards) -> HF names -> payload -> engine runner."""
    from gyre.embedded_model import load_hf_model
    from gyre.rollout.embedded.model_runner import HFModelRunner
    from gyre.training.checkpoint_conversion import hf_to_megatron, megatron_to_hf

    model = load_hf_model(tiny_model_dir)
    sd = {k: v + 0.01 for k, v in model.state_dict().items()}
    shards = {(t, 0): hf_to_megatron(sd, model.config, tp_rank=t, tp_size=2) for t in range(2)}
    named = deserialize_named_tensors([serialize_named_tensors(megatron_to_hf(shards, model.config))])
    runner = HFModelRunner(model, source_dir=tiny_model_dir)
    runner.check_weights(named, require_all=True)
    runner.load_weights(named)
    for k, v in runner.state_dict().items():
        assert torch.equal(v, sd[k]), k


class _RecordingClient:
    def __init__(self, fail_at: int | None = None):
        self.calls, self.fail_at = [], fail_at

    def update_weights_from_tensor(self, named, *, weight_version, flush_cache):
        if len(self.calls) == self.fail_at:
            raise RuntimeError("engine refused")
        self.calls.append((sorted(named), weight_version, flush_cache))


def test_push_weight_buckets_flushes_on_the_last_bucket_only():
    buckets = [{"a": torch.zeros(1)}, {"b": torch.zeros(1), "c": torch.zeros(1)}, {"d": torch.zeros(1)}]
    client = _RecordingClient()
    assert push_weight_buckets(client, iter(buckets), "v3") == 4
    assert client.calls == [(["a"], "v3", False), (["b", "c"], "v3", False), (["d"], "v3", True)]
    one = _RecordingClient()
    assert push_weight_buckets(one, [{"a": torch.zeros(1)}], "v4") == 1 and one.calls == [(["a"], "v4", True)]
    with pytest.raises(ValueError, match="no weights to push"):
        push_weight_buckets(_RecordingClient(), [], "v5")


def test_push_weight_buckets_exhausts_the_producer_when_an_update_fails():
    produced = []

    def producer():  # stands for a gather that other ranks take part in
        for i in range(4):
            produced.append(i)
            yield {f"t{i}": torch.zeros(1)}

    with pytest.raises(RuntimeError, match="engine refused"):
        push_weight_buckets(_RecordingClient(fail_at=1), producer(), "v")
    assert produced == [0, 1, 2, 3]


def test_the_engine_admits_nothing_between_buckets(tiny_model_dir):
    """An update with flush_cache=false holds admission until the one that flushes: a request sent
    between two buckets runs on the whole new weights, as the version it reports says."""
    import threading
    import time

    from gyre.rollout.client.engine_client import EngineClient
    from gyre.rollout.embedded.config import EngineConfig
    from gyre.rollout.embedded.server import EngineServer

    server = EngineServer(EngineConfig(model_dir=str(tiny_model_dir))).start()
    try:
        client = EngineClient(server.url, timeout=120)
        greedy = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
        prompt = [17, 23, 99, 512, 7]
        before = client.generate(prompt, greedy)
        g = torch.Generator().manual_seed(0)
        new = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in read_weights(tiny_model_dir).items()}
        names = sorted(new)
        first, rest = {n: new[n] for n in names[:3]}, {n: new[n] for n in names[3:]}
        client.update_weights_from_tensor(first, weight_version="v2", flush_cache=False)
        box = {}
        waiting = threading.Thread(target=lambda: box.setdefault("r", client.generate(prompt, greedy)))
        waiting.start()
        time.sleep(1.0)
        assert waiting.is_alive()  # held: the model is half updated
        client.update_weights_from_tensor(rest, weight_version="v2", flush_cache=True)
        waiting.join(60)
        held = box["r"]
        after = client.generate(prompt, greedy)
        assert held.weight_version == after.weight_version == "v2"
        assert held.output_ids == after.output_ids != before.output_ids
    finally:
        server.stop()
