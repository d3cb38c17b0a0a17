"""Request bodies read by orjson where it reads them as the standard library does, else by the standard library."""

import gzip
import json
import random

import pytest

from gyre.proxy.api import common
from gyre.proxy.api.common import decode_json
from gyre.proxy.errors import ProxyError

BIG = 2**64 + 12345


def _parsers(monkeypatch):
    """Counts which parser produced each value."""
    seen = []
    real = common._orjson_value

    def spy(raw):
        v = real(raw)
        seen.append("stdlib" if v is common._NOT_PARSED else "orjson")
        return v

    monkeypatch.setattr(common, "_orjson_value", spy)
    return seen


@pytest.mark.parametrize("raw, parser", [
    (b'{"messages": [{"role": "user", "content": "hi \\u00e9 \\ud83d\\ude00"}], "max_tokens": 5}', "orjson"),
    (b'\xef\xbb\xbf{"a": [1, 2.5, -0.0, null, true]}', "orjson"),                  # a UTF-8 BOM
    (b'{"a": 1, "a": 2}', "orjson"),                                                # the last key wins in both
    (b'{"x": 18446744073709551615, "y": -9223372036854775808}', "orjson"),          # 64-bit ints stay ints
    (b'{"input": {"n": %d}}' % BIG, "stdlib"),                                      # beyond 64 bits: exact
    (b'{"input": {"n": -%d}}' % BIG, "stdlib"),
    (b'{"t": NaN, "u": Infinity}', "stdlib"),
    (b'{"t": 1e400}', "stdlib"),
    (b'{"s": "\\ud800"}', "stdlib"),                                                # a lone surrogate escape
    (b'{"f": 1e19}', "stdlib"),                                                     # a large float: same value
])
def test_each_body_reads_as_the_standard_library_reads_it(monkeypatch, raw, parser):
    seen = _parsers(monkeypatch)
    want = json.loads(raw.decode("utf-8-sig"))
    got = decode_json(raw, "")
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)    # NaN == NaN as text
    assert seen == [parser]


def test_big_integers_in_a_tool_input_survive_exactly():
    body = {"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {"id": BIG, "neg": -BIG, "ok": 7}}]}]}
    got = decode_json(json.dumps(body).encode(), "")
    assert got == body and type(got["messages"][0]["content"][0]["input"]["id"]) is int


def test_floats_parse_to_the_same_value():
    rnd = random.Random(3)
    xs = [rnd.uniform(-1, 1) * 10 ** rnd.randint(-300, 18) for _ in range(5000)]
    raw = json.dumps({"xs": xs, "short": [float(f"{x:.7g}") for x in xs]}).encode()
    assert decode_json(raw, "") == json.loads(raw)


def test_gzip_bodies_take_the_same_path(monkeypatch):
    seen = _parsers(monkeypatch)
    assert decode_json(gzip.compress(b'{"a": [1, 2]}'), "gzip") == {"a": [1, 2]}
    assert seen == ["orjson"]


@pytest.mark.parametrize("raw, message", [
    (b'{"model": "m", "messages": [', "request body is not valid JSON: JSONDecodeError"),
    (b'{"a": "\xff"}', "request body is not valid UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "request body is not valid JSON: RecursionError"),
    (b"", "request body is not valid JSON: JSONDecodeError"),
])
def test_malformed_bodies_get_the_standard_librarys_400(raw, message):
    with pytest.raises(ProxyError) as ei:
        decode_json(raw, "")
    assert ei.value.status == 400 and message in str(ei.value)
