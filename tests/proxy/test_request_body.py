"""Request bodies under limits (gyre/proxy/request_body.py): read, inflated and parsed with caps
that hold before the cost is paid; orjson where it reads as the standard library does and the body
is at most 1/16 of the cap, else the standard library (the same value either way); values that
cannot be represented on the way out refused."""

import asyncio
import gzip
import json
import random
import zlib

import pytest

from gyre.proxy import request_body
from gyre.proxy.errors import ProxyError
from gyre.proxy.messages import ChatRequest, Message
from gyre.proxy.request_body import (ORJSON_MAX_SHARE, RequestLimits, check_body_counts, check_request_counts, decode_json, inflate,
                                     read_body)

BIG = 2**64 + 12345


def _parsers(monkeypatch):
    """Which parser produced each value: orjson's loads is called first, json.loads only on fallback."""
    seen = []
    real_orjson, real_json = request_body.orjson.loads, request_body.json.loads

    def spy_orjson(raw):
        seen.append("orjson")
        return real_orjson(raw)

    def spy_json(text):
        if seen and seen[-1] == "orjson":
            seen[-1] = "stdlib"  # orjson's reading was set aside
        else:
            seen.append("stdlib")  # a body too long for orjson
        return real_json(text)

    monkeypatch.setattr(request_body.orjson, "loads", spy_orjson)
    monkeypatch.setattr(request_body.json, "loads", spy_json)
    return seen


@pytest.mark.parametrize("raw, parser", [
    (b'{"messages": [{"role": "user", "content": "hi \\u00e9 \\ud83d\\ude00"}], "max_tokens": 5}', "orjson"),
    (b'\xef\xbb\xbf{"a": [1, 2.5, -0.0, null, true]}', "orjson"),                  # a UTF-8 BOM
    (b'{"a": 1, "a": 2}', "orjson"),                                                # the last key wins in both
    (b'{"x": 18446744073709551615, "y": -9223372036854775808}', "orjson"),          # 64-bit ints stay ints
    (b'{"input": {"n": %d}}' % BIG, "stdlib"),                                      # beyond 64 bits: exact
    (b'{"input": {"n": -%d}}' % BIG, "stdlib"),
    (b'{"f": 1e19}', "stdlib"),                                                     # a large float: same value
])
def test_each_body_reads_as_the_standard_library_reads_it(monkeypatch, raw, parser):
    want = json.loads(raw.decode("utf-8-sig"))
    seen = _parsers(monkeypatch)
    got = decode_json(raw, "")
    monkeypatch.undo()
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)
    assert seen == [parser]


@pytest.mark.parametrize("raw, message", [
    (b'{"t": NaN}', "non-finite number"),
    (b'{"t": [1, {"u": -Infinity}]}', "non-finite number"),
    (b'{"t": 1e400}', "non-finite number"),
    (b'{"s": "\\ud800"}', "lone surrogate"),
    (b'{"s": ["ok", {"k": "a\\udfffb"}]}', "lone surrogate"),
    (b'{"\\udc00": 1}', "lone surrogate"),
])
def test_values_that_cannot_be_represented_are_refused(raw, message):
    with pytest.raises(ProxyError) as ei:
        decode_json(raw, "")
    assert ei.value.status == 400 and message in ei.value.message


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
    raw = gzip.compress(b'{"a": [1, 2]}')
    seen = _parsers(monkeypatch)
    assert decode_json(raw, "gzip") == {"a": [1, 2]}
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


@pytest.mark.parametrize("depth", [1, 2, 7, 8, 9, 300])
@pytest.mark.parametrize("kind", ["list", "object"])
def test_depth_is_refused_beyond_the_limit_exactly(depth, kind):
    value = 0
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value}
    raw = json.dumps(value).encode()
    limits = RequestLimits(max_json_depth=8)
    if depth <= 8:
        assert decode_json(raw, "", limits) == value
    else:
        with pytest.raises(ProxyError) as ei:
            decode_json(raw, "", limits)
        assert ei.value.status == 400 and "deeper than 8 levels (max_json_depth)" in ei.value.message


def _deflate_raw(data: bytes) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


@pytest.mark.parametrize("encoding, pack", [("gzip", gzip.compress), ("deflate", zlib.compress),
                                            ("deflate", _deflate_raw), ("GZip ", gzip.compress)],
                         ids=["gzip", "zlib", "raw-deflate", "gzip-spelled-oddly"])
def test_inflation_stops_at_the_first_byte_over_the_limit(encoding, pack):
    data = b"a" * 10_000
    assert inflate(pack(data), encoding, 10_000) == data
    bomb = pack(b"\0" * (64 << 20))                       # 64 MB from about 64 KB
    assert len(bomb) < 100_000
    with pytest.raises(ProxyError) as ei:
        inflate(bomb, encoding, 1 << 20)
    assert ei.value.status == 413 and "decoded to more than" in ei.value.message


def test_inflation_of_a_bomb_allocates_about_the_limit_only():
    import tracemalloc

    bomb = gzip.compress(b"\0" * (256 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(ProxyError):
            inflate(bomb, "gzip", 4 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # not the 256 MB the body holds; about the limit, plus one step's output and one input step
    assert peak < 2 * (4 << 20)


def test_inflation_reads_members_and_streams_longer_than_a_step():
    """Incompressible members of several input steps each, back to back, and the same cut short at
    every step boundary and within a step: read whole, or refused as truncated (400)."""
    import os

    from gyre.proxy.request_body import INFLATE_STEP_BYTES

    parts = [os.urandom(3 * INFLATE_STEP_BYTES + 17), os.urandom(INFLATE_STEP_BYTES), b"x" * 5]
    raw = b"".join(gzip.compress(p) for p in parts) + b"\0" * 3
    assert inflate(raw, "gzip", 1 << 20) == b"".join(parts)
    one = zlib.compress(parts[0])
    assert inflate(one, "deflate", 1 << 20) == parts[0]
    for cut in (INFLATE_STEP_BYTES, 2 * INFLATE_STEP_BYTES, 2 * INFLATE_STEP_BYTES + 5, len(one) - 1):
        with pytest.raises(ProxyError) as ei:
            inflate(one[:cut], "deflate", 1 << 20)
        assert ei.value.status == 400


def test_gzip_with_two_members_and_padding_reads_whole():
    raw = gzip.compress(b'{"a": ') + gzip.compress(b'[1, 2]}') + b"\0\0"
    assert decode_json(raw, "gzip") == {"a": [1, 2]}


@pytest.mark.parametrize("raw, encoding, status", [
    (gzip.compress(b'{"a": 1}')[:-9], "gzip", 400),           # truncated
    (b"not compressed", "gzip", 400),
    (b"not compressed", "deflate", 400),
    (b"{}", "br", 415),
], ids=["truncated-gzip", "not-gzip", "not-deflate", "brotli"])
def test_corrupt_or_unknown_encodings(raw, encoding, status):
    with pytest.raises(ProxyError) as ei:
        decode_json(raw, encoding)
    assert ei.value.status == status


class _Request:
    """What read_body uses of a Starlette request: headers and stream()."""

    def __init__(self, chunks, declared):
        self.headers = {} if declared is None else {"content-length": str(declared)}
        self._chunks = chunks
        self.read = 0

    async def stream(self):
        for c in self._chunks:
            self.read += 1
            yield c
        yield b""


@pytest.mark.parametrize("declared_delta", [0, -7, 5, None], ids=["as-declared", "longer", "shorter", "chunked"])
def test_read_body_returns_the_bytes_received(declared_delta):
    data = bytes(range(256)) * 5000
    chunks = [data[i:i + 65_536] for i in range(0, len(data), 65_536)]
    declared = None if declared_delta is None else len(data) + declared_delta
    assert asyncio.run(read_body(_Request(chunks, declared), len(data) + 5)) == data


def test_read_body_refuses_a_declared_length_over_the_cap_before_reading():
    req = _Request([b"x" * 100], 1 << 40)
    with pytest.raises(ProxyError) as ei:
        asyncio.run(read_body(req, 1 << 20))
    assert ei.value.status == 413 and "Content-Length says 1099511627776 bytes" in ei.value.message
    assert req.read == 0


@pytest.mark.parametrize("declared", [None, 10])
def test_read_body_stops_at_the_first_chunk_over_the_cap(declared):
    req = _Request([b"x" * 1000] * 100, declared)
    with pytest.raises(ProxyError) as ei:
        asyncio.run(read_body(req, 2500))
    assert ei.value.status == 413 and req.read == 3


def test_read_body_refuses_a_malformed_length():
    with pytest.raises(ProxyError) as ei:
        asyncio.run(read_body(_Request([b"{}"], "12x"), 100))
    assert ei.value.status == 400


def _req(roles, tools=0):
    return ChatRequest(api="chat", messages=[Message(role=r, content="x") for r in roles],
                       tools=[{"type": "function", "function": {"name": f"t{i}"}} for i in range(tools)])


def test_counts_are_refused_beyond_each_limit_exactly():
    lim = RequestLimits(max_messages=6, max_tools=2, max_tool_results=3)
    check_request_counts(_req(["user", "assistant", "tool", "tool", "tool", "assistant"], tools=2), lim)
    for req, what in [(_req(["user"] * 7), "too many messages: 7 > 6"),
                      (_req(["user"], tools=3), "too many tools: 3 > 2"),
                      (_req(["user", "assistant", "tool", "tool", "tool", "tool"]), "too many tool results")]:
        with pytest.raises(ProxyError) as ei:
            check_request_counts(req, lim)
        assert ei.value.status == 400 and what in ei.value.message
    # results of different turns do not add up
    check_request_counts(_req(["tool", "tool", "tool", "assistant", "tool", "tool", "tool"]), RequestLimits(max_tool_results=3))


def test_body_counts_are_refused_before_normalisation():
    lim = RequestLimits(max_messages=3, max_tools=1)
    check_body_counts({"messages": [{}] * 3, "tools": [{}]}, lim)
    check_body_counts([1, 2, 3, 4], lim)                    # not an object: normalisation refuses it
    for body, what in [({"messages": [{}] * 4}, "too many messages: 4 > 3"), ({"input": [{}] * 4}, "too many input: 4 > 3"),
                       ({"tools": [{}] * 2}, "too many tools: 2 > 1")]:
        with pytest.raises(ProxyError) as ei:
            check_body_counts(body, lim)
        assert ei.value.status == 400 and what in ei.value.message


def _json_value(rnd: random.Random, depth: int = 0):
    """A random JSON value: nested containers, unicode and escaped text, ints of every size, floats."""
    kind = rnd.randrange(9 if depth < 4 else 5)
    if kind == 0:
        return rnd.choice([None, True, False])
    if kind == 1:
        return rnd.choice([0, -1, 2**63 - 1, -2**63, 2**64 - 1, BIG, -BIG, rnd.randint(-10**30, 10**30)])
    if kind == 2:
        return rnd.choice([0.0, -0.0, 1e19, 2.0**63, 1e-300, rnd.uniform(-1, 1) * 10 ** rnd.randint(-300, 300)])
    if kind in (3, 4):
        return "".join(rnd.choice(["a", " ", "\n", '"', "\\", "\u00e9", "\U0001f600", "\x00", "\u2028"])
                       for _ in range(rnd.randrange(12)))
    if kind in (5, 6):
        return [_json_value(rnd, depth + 1) for _ in range(rnd.randrange(5))]
    return {f"k{rnd.randrange(6)}": _json_value(rnd, depth + 1) for _ in range(rnd.randrange(5))}


def _decoded(raw: bytes, max_body_bytes: int):
    """``decode_json``'s value (as text that tells ints from floats) or its refusal."""
    try:
        return json.dumps(decode_json(raw, "", RequestLimits(max_body_bytes=max_body_bytes)), sort_keys=True)
    except ProxyError as exc:
        return (exc.status, exc.message)


def test_orjson_parses_only_bodies_of_at_most_a_sixteenth_of_the_cap(monkeypatch):
    raw = b'{"a": [1, 2.5, "x"]}'
    seen = _parsers(monkeypatch)
    for cap, parser in ((len(raw) * ORJSON_MAX_SHARE, "orjson"), (len(raw) * ORJSON_MAX_SHARE - 1, "stdlib"),
                        (len(raw), "stdlib")):
        seen.clear()
        assert decode_json(raw, "", RequestLimits(max_body_bytes=cap)) == {"a": [1, 2.5, "x"]}
        assert seen == [parser], cap


def test_both_parsers_give_the_same_value_or_the_same_refusal():
    rnd = random.Random(11)
    bodies = [json.dumps({"v": _json_value(rnd)}, ensure_ascii=rnd.random() < 0.5).encode() for _ in range(400)]
    bodies += [b'\xef\xbb\xbf{"a": 1}', b'{"t": NaN}', b'{"t": 1e400}', b'{"s": "\\ud800"}', b'{"a": 1, "a": 2}',
               b'{"a": "\xff"}', b'{"a": [1, 2', b"[" * 200 + b"]" * 200, b'{"x": -0.0, "y": 1E+2}', b"  7  "]
    for raw in bodies:
        by_orjson = _decoded(raw, len(raw) * ORJSON_MAX_SHARE)
        assert by_orjson == _decoded(raw, len(raw)), raw[:200]
    assert sum(isinstance(_decoded(raw, len(raw)), str) for raw in bodies) > 400  # most were read, not refused


def test_a_consumed_body_is_emptied_once_decoded_and_not_held_beside_its_value():
    import tracemalloc

    text = "[" * 100_000 + "1" + "]" * 100_000
    body = json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
    limits = RequestLimits(max_body_bytes=256 << 10)
    assert len(body) > (256 << 10) // ORJSON_MAX_SHARE  # read by the standard library

    def peak(consume: bool) -> tuple[int, bytearray, object]:
        tracemalloc.start()
        raw = bytearray(body)  # traced, as a body read by the server is
        try:
            value = decode_json(raw, "", limits, consume=consume)
            return tracemalloc.get_traced_memory()[1], raw, value
        finally:
            tracemalloc.stop()

    kept_peak, kept, value = peak(False)
    assert kept == body and value["messages"][0]["content"] == text
    freed_peak, emptied, value = peak(True)
    assert emptied == bytearray() and value["messages"][0]["content"] == text
    assert freed_peak < kept_peak - len(body) // 2, (freed_peak, kept_peak)  # the body's text went with it
    raw = bytearray(body)
    view = memoryview(raw)  # a body still viewed elsewhere is left as it is
    assert decode_json(raw, "", limits, consume=True)["messages"][0]["content"] == text and raw == body
    view.release()
