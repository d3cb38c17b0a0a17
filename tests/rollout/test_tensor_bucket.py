"""Flattened weight buckets shared by memory handle (``load_format="flattened_bucket"``)."""

import base64
import io
import pickle
import sys

import pytest
import torch

from gyre.rollout.tensor_bucket import LOAD_FORMAT, FlatBucket, engine_rank_payloads, load_payload


def _named():
    g = torch.Generator().manual_seed(3)
    return {"a.weight": torch.randn(3, 5, generator=g), "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
            "c.count": torch.tensor([1, -2, 3], dtype=torch.int64), "d.scalar": torch.tensor(2.5)}


def test_pack_unpack_round_trip_keeps_names_shapes_dtypes_and_values():
    named = _named()
    bucket = FlatBucket.pack(named)
    assert bucket.flat.dtype == torch.uint8
    assert [m[3] for m in bucket.meta] == [0, 64, 80, 112]  # 16-byte aligned starts
    assert bucket.nbytes == 116
    out = bucket.unpack()
    assert [n for n, _ in out] == list(named)
    for n, t in out:
        assert t.dtype == named[n].dtype and t.shape == named[n].shape and torch.equal(t, named[n])


def test_a_payload_opens_into_copies_of_the_tensors():
    named = _named()
    bucket = FlatBucket.pack(named)
    loaded = dict(load_payload(bucket.serialize()))
    assert all(torch.equal(loaded[n], named[n]) for n in named)
    bucket.flat.zero_()  # the sender may reuse its buffer once the engine has loaded
    assert torch.equal(loaded["a.weight"], named["a.weight"])


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


def test_a_payload_referencing_anything_but_torch_is_refused():
    raw = base64.b64encode(pickle.dumps({"flat": _Evil(), "meta": []})).decode()
    with pytest.raises(ValueError, match="may not reference posix.system"):
        load_payload(raw)
    with pytest.raises(ValueError, match="not a flattened_bucket payload"):
        load_payload("not base64!")


def test_bad_entries_and_mixed_devices_are_refused():
    bucket = FlatBucket.pack({"w": torch.ones(4)})
    with pytest.raises(ValueError, match="bad bucket entry"):
        FlatBucket(bucket.flat, [("w", (4,), "float32", 0, 32)]).unpack()  # past the end
    with pytest.raises(ValueError, match="bad bucket entry"):
        FlatBucket(bucket.flat, [("w", (4,), "no_such_dtype", 0, 16)]).unpack()
    with pytest.raises(ValueError, match="empty bucket"):
        FlatBucket.pack({})
    with pytest.raises(TypeError):
        FlatBucket.pack({"w": [1.0]})


def test_engine_rank_payloads_give_each_rank_its_shard_or_the_leaders():
    assert engine_rank_payloads(["p0", "p1"], 2) == ["p0", "p1"]
    assert engine_rank_payloads(["p0", None], 2) == ["p0", "p0"]
    assert engine_rank_payloads(["p0"], 4) == ["p0"] * 4
    assert engine_rank_payloads(["p0", "p1", "p2", "p3"], 2) == ["p0", "p1"]
    with pytest.raises(ValueError, match="leader"):
        engine_rank_payloads([None, "p1"], 2)
    with pytest.raises(ValueError, match=">= 1"):
        engine_rank_payloads(["p0"], 0)


@pytest.mark.slow  # an engine process
def test_an_engine_process_loads_a_bucket_by_handle(tmp_path, tiny_model_dir):
    """A separate engine process opens the shared-memory payloads and then generates exactly what an
    engine loaded with the same weights by value does."""
    from gyre.rollout.client.engine_client import EngineClient
    from gyre.rollout.client.messages import EngineError
    from gyre.rollout.embedded.config import EngineConfig
    from gyre.rollout.embedded.model_runner import read_weights
    from gyre.rollout.embedded.server import EngineServer
    from gyre.rollout.sglang_driver.engine import SGLangEngine

    proc = SGLangEngine(tiny_model_dir, launcher=[sys.executable, "-m", "gyre.rollout.embedded.serve"],
                        startup_timeout=120, log_path=tmp_path / "engine.log").start()
    ref = EngineServer(EngineConfig(model_dir=str(tiny_model_dir))).start()
    try:
        client, ref_client = EngineClient(proc.url, timeout=120), EngineClient(ref.url, timeout=120)
        greedy = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
        prompt = [17, 23, 99, 512, 7]
        before = client.generate(prompt, greedy).output_ids
        g = torch.Generator().manual_seed(0)
        new = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in read_weights(tiny_model_dir).items()}
        names = sorted(new)
        halves = [FlatBucket.pack({n: new[n] for n in names[:4]}), FlatBucket.pack({n: new[n] for n in names[4:]})]
        for i, b in enumerate(halves):
            client.update_weights_from_tensor(serialized_named_tensors=engine_rank_payloads([b.serialize()], 2),
                                              load_format=LOAD_FORMAT, weight_version="v2",
                                              flush_cache=i == len(halves) - 1)
        ref_client.update_weights_from_tensor(new, weight_version="v2")
        after, expected = client.generate(prompt, greedy), ref_client.generate(prompt, greedy)
        assert after.weight_version == "v2"
        assert after.output_ids == expected.output_ids != before
        buf = io.BytesIO()
        pickle.dump({"flat": _Evil(), "meta": []}, buf)
        with pytest.raises(EngineError, match="may not reference"):
            client.update_weights_from_tensor(serialized_named_tensors=[base64.b64encode(buf.getvalue()).decode()],
                                              load_format=LOAD_FORMAT, weight_version="v3")
        assert client.get_weight_version() == "v2"
    finally:
        proc.stop()
        ref.stop()


def test_the_sglang_cell_client_sends_one_payload_per_engine_rank(tiny_model_dir):
    """The cell's client for an SGLang server: tensors moved to the cell's device, serialized once per
    engine TP rank, sent with the load format; the engine then serves the pushed weights."""
    from gyre.rollout.client.engine_client import EngineClient
    from gyre.rollout.embedded.config import EngineConfig
    from gyre.rollout.embedded.model_runner import read_weights
    from gyre.rollout.embedded.server import EngineServer
    from gyre.rollout.sglang_driver.weights import SGLangTensorClient

    sent = []

    def serialize(pairs, tp_size):
        sent.append((tp_size, [n for n, _ in pairs], {t.device.type for _, t in pairs}))
        return engine_rank_payloads([FlatBucket.pack(pairs).serialize()], tp_size)

    server = EngineServer(EngineConfig(model_dir=str(tiny_model_dir))).start()
    ref = EngineServer(EngineConfig(model_dir=str(tiny_model_dir))).start()
    try:
        inner = EngineClient(server.url, timeout=120)
        client = SGLangTensorClient(inner, "cpu", 4, serialize=serialize, load_format=LOAD_FORMAT)
        g = torch.Generator().manual_seed(1)
        new = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in read_weights(tiny_model_dir).items()}
        names = sorted(new)
        buckets = [{n: new[n] for n in names[i:i + 5]} for i in range(0, len(names), 5)]
        for i, b in enumerate(buckets):  # the embedded engine's bucket order (an SGLang server's: test_sglang_engine)
            client.update_weights_from_tensor(b, weight_version="7", flush_cache=i == len(buckets) - 1)
        assert [s[0] for s in sent] == [4] * len(buckets) and [s[1] for s in sent] == [sorted(b) for b in buckets]
        assert all(s[2] == {"cpu"} for s in sent)
        EngineClient(ref.url, timeout=120).update_weights_from_tensor(new, weight_version="7")
        greedy = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
        got = client.generate([5, 6, 7, 8], greedy)  # any other call goes to the engine client
        assert got.weight_version == "7"
        assert got.output_ids == EngineClient(ref.url, timeout=120).generate([5, 6, 7, 8], greedy).output_ids
    finally:
        server.stop()
        ref.stop()


def test_an_embedded_servers_own_client_pushes_weights_by_shared_memory(tiny_model_dir):
    """``EngineServer.client()`` sends ``named_tensors`` as one shared-memory bucket (a few KB of
    request for the whole model) and the engine then generates exactly what an engine loaded by value
    does; a client without the option sends the bytes."""
    import httpx

    from gyre.rollout.client.engine_client import EngineClient
    from gyre.rollout.embedded.config import EngineConfig
    from gyre.rollout.embedded.model_runner import read_weights
    from gyre.rollout.embedded.server import EngineServer

    bodies: list[tuple[str, int]] = []

    class Recording(httpx.HTTPTransport):
        def handle_request(self, request):
            if request.url.path == "/update_weights_from_tensor":
                request.read()
                bodies.append((request.url.path, len(request.content)))
            return super().handle_request(request)

    server = EngineServer(EngineConfig(model_dir=str(tiny_model_dir))).start()
    ref = EngineServer(EngineConfig(model_dir=str(tiny_model_dir))).start()
    try:
        assert server.client().shared_memory_weights
        client = EngineClient(server.url, timeout=120, transport=Recording(), shared_memory_weights=True)
        by_value = EngineClient(ref.url, timeout=120, transport=Recording())
        g = torch.Generator().manual_seed(3)
        new = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in read_weights(tiny_model_dir).items()}
        model_bytes = sum(t.numel() * t.element_size() for t in new.values())
        greedy = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
        prompt = [17, 23, 99, 512, 7]
        before = client.generate(prompt, greedy).output_ids
        client.update_weights_from_tensor(new, weight_version="v2")
        by_value.update_weights_from_tensor(new, weight_version="v2")
        after, expected = client.generate(prompt, greedy), by_value.generate(prompt, greedy)
        assert after.weight_version == "v2"
        assert after.output_ids == expected.output_ids != before
        (_, shm_body), (_, value_body) = bodies
        assert shm_body < 64 << 10 < model_bytes < value_body
    finally:
        server.stop()
        ref.stop()
