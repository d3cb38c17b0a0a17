"""KV payloads between two real embedded engines: export, import, a cache hit that gives the same
tokens and log-probs as recomputing, and payloads that must be refused."""

from __future__ import annotations

import threading

import pytest
import torch

from gyre.rollout.client.engine_client import EngineClient
from gyre.rollout.client.messages import EngineError
from gyre.rollout.embedded.config import EngineConfig
from gyre.rollout.embedded.kv_transfer import (KVPayloadError, MooncakeKVStage, check_fits, decode_kv_payload,
                                               encode_kv_payload, kv_layout)
from gyre.rollout.embedded.server import EngineServer
from gyre.transfer_engine import TransferEngineError
from tests.processes import wait_until

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
PROMPT = [17 + 7 * i % 3000 for i in range(40)]  # ids of the tiny model's vocabulary


def test_payload_round_trip_and_refusals():
    layout = kv_layout(2, 2, 4, torch.float32)
    kv = torch.randn(2, 2, 2, 3, 4)
    p = decode_kv_payload(encode_kv_payload(kv, [5, 6, 7], "v3", layout))
    assert p.token_ids == [5, 6, 7] and p.weight_version == "v3" and p.layout == layout and torch.equal(p.kv, kv)
    check_fits(p, "v3", layout)
    with pytest.raises(KVPayloadError, match="KV payload of weight version 'v3'; this engine serves 'v4'"):
        check_fits(p, "v4", layout)
    with pytest.raises(KVPayloadError, match="does not match this engine's"):
        check_fits(p, "v3", kv_layout(2, 2, 8, torch.float32))
    with pytest.raises(KVPayloadError, match="KV covers 3 tokens, not 2"):
        encode_kv_payload(kv, [5, 6], "v3", layout)
    with pytest.raises(KVPayloadError, match="not a KV payload"):
        decode_kv_payload(b"\x00\x01garbage")
    data = encode_kv_payload(kv, [5, 6, 7], "v3", layout)
    with pytest.raises(KVPayloadError, match="not a KV payload"):
        decode_kv_payload(data[:-10])  # truncated
    lying = encode_kv_payload(kv, [5, 6, 7], "v3", kv_layout(2, 2, 4, torch.float16))
    with pytest.raises(KVPayloadError, match="does not match its layout"):
        decode_kv_payload(lying)


@pytest.fixture
def engines(tiny_model_dir):
    servers = [EngineServer(EngineConfig(model_dir=str(tiny_model_dir), max_running_requests=2)).start()
               for _ in range(2)]
    yield [EngineClient(s.url, timeout=120.0) for s in servers]
    for s in servers:
        s.stop()


def prefill_tokens(client: EngineClient) -> int:
    return client.get_server_info()["internal_states"][0]["num_prefill_tokens"]


def test_an_imported_prefix_is_a_cache_hit_with_the_recompute_path_s_output(engines):
    a, b = engines
    first = a.generate(PROMPT, GREEDY)
    context = PROMPT + first.output_ids  # the next call of the execution: everything so far
    m, payload = a.export_kv(context)
    assert m == len(context) - 1  # everything but the last sampled token went through the model
    assert b.export_kv(context) == (0, None)  # B holds nothing of it
    assert b.import_kv(payload) == {"success": True, "imported_tokens": m, "tokens": m, "bytes": len(payload)}
    before = prefill_tokens(b)
    hit = b.generate(context, GREEDY)
    assert hit.cached_tokens == m and prefill_tokens(b) == before  # nothing recomputed
    b.flush_cache()
    recomputed = b.generate(context, GREEDY)
    assert recomputed.cached_tokens == 0 and prefill_tokens(b) == before + m
    assert hit.output_ids == recomputed.output_ids
    diff = max(abs(x - y) for x, y in zip(hit.output_logprobs, recomputed.output_logprobs))
    assert diff < 1e-4, diff


def test_a_running_request_s_partial_output_is_exported(engines):
    a, _ = engines
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", a.generate(PROMPT, {**GREEDY, "max_new_tokens": 4000})))
    t.start()
    try:
        state = lambda: a.get_server_info()["internal_states"][0]  # noqa: E731
        assert wait_until(lambda: state()["num_running_reqs"] == 1 and state()["num_decode_tokens"] >= 8, 60)
        m, payload = a.export_kv(PROMPT + [7] * 50)  # only the prompt is shared with what runs
        assert m == len(PROMPT) and decode_kv_payload(payload).token_ids == PROMPT
    finally:
        a.abort_all()
        t.join(60)
    partial = PROMPT + box["r"].output_ids  # the aborted request's prompt and partial output
    m, payload = a.export_kv(partial)
    assert m == len(partial) - 1 and len(box["r"].output_ids) >= 8


def test_payloads_of_other_weights_or_malformed_are_refused(engines):
    a, b = engines
    a.generate(PROMPT, GREEDY)
    m, payload = a.export_kv(PROMPT + [0])
    b.update_weight_version("v-other")
    with pytest.raises(EngineError, match="KV payload of weight version 'default'; this engine serves 'v-other'"):
        b.import_kv(payload)
    with pytest.raises(EngineError, match="not a KV payload"):
        b.import_kv(b"not a payload")
    assert b.export_kv(PROMPT + [0]) == (0, None)  # nothing was stored
    with pytest.raises(EngineError, match="input_ids must be a non-empty list of token ids"):
        a.export_kv([])


@pytest.fixture
def mooncake_available():
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda not installed")


def test_mooncake_stage_pins_until_released_or_expired(mooncake_available):
    now = [0.0]
    src, dst = MooncakeKVStage(pin_timeout_s=10.0, clock=lambda: now[0]), MooncakeKVStage()
    data = bytes(range(256)) * 4096
    h1, h2 = src.stage(data), src.stage(data[:1000])
    assert src.pinned == [h1["pin"], h2["pin"]] and h1["nbytes"] == len(data)
    assert dst.fetch(h1) == data and dst.fetch(h2) == data[:1000]
    assert src.release(h1["pin"]) is True and src.release(h1["pin"]) is False
    with pytest.raises(TransferEngineError, match="failed"):
        dst.fetch(h1)  # released memory is not readable any more
    now[0] = 10.0
    assert src.pinned == []  # h2 expired unreleased
    with pytest.raises(KVPayloadError, match="mooncake must be"):
        dst.fetch({"session_id": h2["session_id"], "addr": h2["addr"], "nbytes": 0, "pin": 1})


def test_an_engine_to_engine_mooncake_copy_is_a_cache_hit(engines, mooncake_available):
    a, b = engines
    first = a.generate(PROMPT, GREEDY)
    context = PROMPT + first.output_ids
    m, handle = a.export_kv(context, transport="mooncake")
    assert m == len(context) - 1 and set(handle) == {"session_id", "addr", "nbytes", "pin"}
    reply = b.import_kv(handle)  # B reads the bytes from A's transfer engine
    assert reply == {"success": True, "imported_tokens": m, "tokens": m, "bytes": handle["nbytes"]}
    assert a.release_kv(handle["pin"]) is True and a.release_kv(handle["pin"]) is False
    before = prefill_tokens(b)
    hit = b.generate(context, GREEDY)
    assert hit.cached_tokens == m and prefill_tokens(b) == before
    assert hit.output_ids == a.generate(context, GREEDY).output_ids
    b.flush_cache()
    with pytest.raises(EngineError, match="failed"):
        b.import_kv(handle)  # the source released it: a 400, nothing stored
    assert b.export_kv(context) == (0, None)
    with pytest.raises(EngineError, match="mooncake must be"):
        b.import_kv({"session_id": "x"})
    with pytest.raises(EngineError, match="mooncake must be"):
        b.import_kv({**handle, "addr": -5})
    with pytest.raises(EngineError, match="over the limit"):
        b.import_kv({**handle, "nbytes": 1 << 50})
    with pytest.raises(EngineError, match="failed"):  # nobody listens there: a prompt 400, no hang
        b.import_kv({"session_id": "127.0.0.1:1", "addr": 4096, "nbytes": 10, "pin": 1})
    with pytest.raises(EngineError, match="input_ids must be a non-empty list of token ids"):
        a.export_kv([True, False])
    with pytest.raises(EngineError, match='transport must be "http" or "mooncake"'):
        a.export_kv(context, transport="rdma")
    bad = a._post_kv("/gyre/release_kv", json={"pin": "1"})
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "pin must be an integer"
