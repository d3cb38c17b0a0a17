"""Token-id JSON by table lookup: the same list as orjson writes, for every case it takes or declines."""

import json

import numpy as np
import orjson
import pytest

from gyre.rollout.client import token_json
from gyre.rollout.client.messages import json_content
from gyre.rollout.client.token_json import MAX_TABLE, MIN_IDS, decimal_slots, dumps_with_ids, ids_text

OPTS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def test_every_slot_is_the_number_right_aligned_then_a_comma():
    table = decimal_slots(12_345)
    text = table.tobytes().decode()
    slots = [text[i:i + 8] for i in range(0, len(text), 8)]
    assert slots == [f"{i:>7}," for i in range(12_345)]


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32, np.uint64, np.int16])
def test_long_prompts_parse_to_the_same_body(dtype):
    rng = np.random.default_rng(7)
    top = min(np.iinfo(dtype).max, 151_936)
    ids = rng.integers(0, top, 50_000).astype(dtype)
    ids[:4] = [0, 9, 10, top - 1]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 64, "stop": ["\n"]}, "stream": True, "rid": "r-1"}
    raw = dumps_with_ids(body, OPTS)
    assert raw != orjson.dumps(body, option=OPTS)            # the table path wrote it
    assert json.loads(raw) == json.loads(orjson.dumps(body, option=OPTS))
    assert json.loads(raw)["input_ids"] == [int(x) for x in ids]
    view = dumps_with_ids(body, OPTS, buffer=True)              # the same text, not copied into bytes
    assert isinstance(view, memoryview) and view.tobytes() == raw and raw.startswith(b'{"input_ids":  [')


def test_a_body_of_ids_alone_and_the_content_posted():
    ids = np.arange(MIN_IDS, dtype=np.int32)
    assert json.loads(dumps_with_ids({"input_ids": ids})) == {"input_ids": list(range(MIN_IDS))}
    posted = json_content({"input_ids": ids, "rid": "x"})
    assert json.loads(posted["content"]) == {"input_ids": list(range(MIN_IDS)), "rid": "x"}
    assert bytes(json_content({"input_ids": ids, "rid": "x"}, buffer=True)["content"]) == posted["content"]
    assert json_content({"rid": "x"}, buffer=True)["content"] == b'{"rid":"x"}'  # a body without ids
    assert posted["headers"] == {"content-type": "application/json"}


def test_the_table_grows_to_the_largest_id_and_stops_at_its_bound(monkeypatch):
    monkeypatch.setattr(token_json, "_table", np.zeros(0, np.uint64))
    ids = np.full(MIN_IDS, 3, dtype=np.int64)
    ids[-1] = 300_000                                           # needs 2**19 slots
    assert json.loads(b"[" + bytes(ids_text(ids)) + b"]") == [int(x) for x in ids]
    assert len(token_json._table) == 1 << 19
    ids[-1] = MAX_TABLE                                         # one past the widest table
    assert ids_text(ids) is None
    assert len(token_json._table) == 1 << 19


@pytest.mark.parametrize("ids", [
    np.full(MIN_IDS, -1, dtype=np.int64),                       # negative: orjson writes it
    np.full(MIN_IDS, 2**40, dtype=np.int64),                    # beyond the table
    np.arange(MIN_IDS - 1, dtype=np.int64),                     # short
    np.arange(2 * MIN_IDS, dtype=np.int64).reshape(2, MIN_IDS),  # batched
])
def test_bodies_the_table_cannot_write_are_orjson_exactly(ids):
    body = {"input_ids": ids, "rid": "r"}
    assert dumps_with_ids(body, OPTS) == orjson.dumps(body, option=OPTS)


def test_other_bodies_are_orjson_exactly():
    for body in [{"rid": "a"}, [1, 2, 3], {"input_ids": list(range(MIN_IDS))}, {}]:
        assert dumps_with_ids(body, OPTS) == orjson.dumps(body, option=OPTS)


def test_prepare_table_builds_the_table_for_a_vocabulary_ahead_once(monkeypatch):
    monkeypatch.setattr(token_json, "_table", np.zeros(0, np.uint64))
    assert token_json.prepare_table(151_936)                  # Qwen's vocabulary: ids up to 151,935
    table = token_json._table
    assert len(table) == 1 << 18
    ids = np.full(MIN_IDS, 151_935, dtype=np.int64)
    assert json.loads(b"[" + bytes(ids_text(ids)) + b"]") == [151_935] * MIN_IDS
    assert token_json._table is table                         # the call used the table built ahead
    assert token_json.prepare_table(1000) and token_json._table is table  # a narrower one is covered
    assert not token_json.prepare_table(MAX_TABLE + 1)        # wider than the widest table: orjson writes it
    assert token_json._table is table


def test_the_proxy_builds_the_table_for_its_tokenizer_at_its_start(monkeypatch, tiny_model_dir):
    from gyre.embedded_model import load_tokenizer
    from gyre.proxy.render import ChatRenderer
    from gyre.proxy.server import ProxyServer

    monkeypatch.setattr(token_json, "_table", np.zeros(0, np.uint64))
    tok = load_tokenizer(tiny_model_dir)
    ProxyServer(ChatRenderer(tok))
    assert len(token_json._table) >= len(tok) and len(token_json._table) == 1 << max(17, (len(tok) - 1).bit_length())
