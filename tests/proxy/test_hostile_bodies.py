"""Hostile request bodies against rank 0's proxy (hypothesis; cases in ``tests/hostile_cases.py``).

A real :class:`~gyre.proxy.server.ProxyServer` on 127.0.0.1 in this process, in front of two
stand-in SGLang engines (``bench/proxy.py --serve engine``, their own processes: the proxy builds
and sends real ``/generate`` requests through :class:`~gyre.proxy.engines.ClientEngine`), one
answering at once, one after 0.6 s (for the retry phases). Its limits are small so that the cases
stay fast: a 256 KiB body cap, nesting 128 deep, 1,000 messages, 64 tools, 128 tool results.

For every API (Anthropic, Chat, Responses, Anthropic ``count_tokens``), streamed and not, and every
class (compression, sizes, depth, numbers, unencodable text, many small parts, client retries), each
example checks :func:`tests.hostile_cases.problems` (the promised status, never a 5xx, an answer within
10 s, the API's error shape, a whole 200 answer, exactly one delivered record for an answered call of
a fresh execution, none otherwise), and that the peak RSS of this process (the proxy's) grew by at
most twice the body cap plus slack. Beside every class, another execution makes small valid calls
in a thread; none may fail, and their p99 latency over the class stays within 1 s.

``GYRE_HYPOTHESIS_SCALE`` scales the example counts; examples are derandomized.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.proxy.server import ProxyConfig, ProxyServer
from tests.hostile_cases import (BAD_NUMBERS, ECHOED_FIELDS, LONE_SURROGATES, MODEL_APIS, NUMERIC_FIELDS, Case,
                                 compression_case, depth_case, headers_for, many_case, number_case, problems,
                                 rss_growth, rss_mark, send, size_case, surrogate_case, valid, wait_until)
from tests.proxy.conftest import hypothesis_examples

ROOT = Path(__file__).resolve().parents[2]
CAP = 256 << 10
LIMITS = {"max_body_bytes": CAP, "max_json_depth": 128, "max_messages": 1000, "max_tools": 64,
          "max_tool_results": 128}
RSS_SLACK = 24 << 20
ANSWER_S = 10.0
OTHERS_P99_S = 1.0
SLOW_S = 0.6
APIS = list(MODEL_APIS) + ["count_tokens"]


def _config(**kw) -> ProxyConfig:
    """A ProxyConfig with the fields it has (limits not in this version are left out, and their
    properties fail)."""
    have = {f.name for f in dataclasses.fields(ProxyConfig)}
    return ProxyConfig(**{k: v for k, v in kw.items() if k in have})


def _stand_in(decode_ms: float):
    p = subprocess.Popen([sys.executable, str(ROOT / "bench" / "proxy.py"), "--serve", "engine", "--port", "0",
                          "--tokenizer", "local", "--transport-only-engine", "--decode-ms", str(decode_ms)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    return p, json.loads(p.stdout.readline())["url"]


class Others:
    """Small valid Chat calls of another execution, back to back with 50 ms pauses, in a thread."""

    def __init__(self, srv: ProxyServer) -> None:
        self.srv, self.key = srv, srv.register_execution(engine_id="fast").api_key
        self.lat: list[float] = []
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        body = valid("chat", max_tokens=4)
        with httpx.Client(base_url=self.srv.url, timeout=30) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    r = c.post("/v1/chat/completions", json=body, headers=headers_for("chat", self.key))
                    if r.status_code != 200:
                        self.failed.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as exc:
                    self.failed.append(repr(exc))
                self.lat.append(time.monotonic() - t0)
                self._stop.wait(0.05)

    def take(self) -> tuple[list[float], list[str]]:
        lat, failed = self.lat, self.failed
        self.lat, self.failed = [], []
        return lat, failed

    def stop(self) -> None:
        self._stop.set()
        self._t.join(60)


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory):
    from gyre.embedded_model import load_tokenizer
    from gyre.proxy.engines import ClientEngine
    from gyre.proxy.render import ChatRenderer
    from gyre.rollout.engine_client import AsyncEngineClient
    from gyre.trajectory.store import TrajectoryStore

    engines = [_stand_in(0), _stand_in(SLOW_S * 1000)]
    srv = ProxyServer(ChatRenderer(load_tokenizer(tiny_model_dir)),
                      store=TrajectoryStore(tmp_path_factory.mktemp("hostile"), fsync_every=0),
                      config=_config(max_context_tokens=32768, max_tokens_cap=16, retry_timeout_s=3.0, **LIMITS))
    for name, (_, url) in zip(("fast", "slow"), engines):
        srv.add_engine(ClientEngine(AsyncEngineClient(url), name))
    srv.start()
    others = Others(srv)
    assert wait_until(lambda: len(others.lat) >= 3, 30), others.failed  # warm: engines, pools, allocator
    others.take()
    yield srv, others
    others.stop()
    srv.stop()
    for p, _ in engines:
        p.kill()
        p.wait()


def _records(srv: ProxyServer, eid: str) -> list[bool]:
    tree = srv.tree(eid)
    return [r.delivered for r in tree.records]


def _exchange(srv: ProxyServer, case: Case) -> None:
    """Send ``case`` from a fresh execution; assert its answer, its records and the RSS growth."""
    ex = srv.register_execution(engine_id="fast")
    mark = rss_mark()
    ans = send(srv.url, case, ex.api_key, timeout=ANSWER_S)
    if case.send == "declared_closed" or ans.status != 200:  # a call the client left may still be running
        wait_until(lambda: srv.counters(ex.execution_id)["inflight"] == 0, ANSWER_S)
    grew = rss_growth(mark)
    found = problems(case, ans, _records(srv, ex.execution_id))
    if grew > 2 * CAP + RSS_SLACK:
        found.append(f"RSS grew {grew / 2 ** 20:.1f} MiB (bound {(2 * CAP + RSS_SLACK) / 2 ** 20:.1f} MiB)")
    srv.close_execution(ex.execution_id)
    assert not found, found


def _run_class(proxy, strategy, examples: int, check=_exchange) -> None:
    """Run the property over ``strategy``'s cases, then check the other execution's calls."""
    srv, others = proxy
    others.take()

    @settings(max_examples=hypothesis_examples(examples), deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def prop(case):
        check(srv, case)

    prop()
    lat, failed = others.take()
    assert not failed, failed[:3]
    assert lat and float(np.percentile(lat, 99)) <= OTHERS_P99_S, (
        f"other executions' p99 {np.percentile(lat, 99):.2f} s, max {max(lat):.2f} s over {len(lat)} calls")


apis = st.sampled_from(APIS)
streams = st.booleans()


@st.composite
def _compression(draw):
    return compression_case(draw(apis), draw(streams), draw(st.sampled_from(["bomb", "under", "truncated", "mislabelled"])),
                            draw(st.sampled_from([1.05, 4, 256])), draw(st.sampled_from(["gzip", "deflate", "raw-deflate"])), CAP)


@st.composite
def _sizes(draw):
    variant = draw(st.sampled_from(["over", "under", "chunked_over", "chunked_under", "declared_held", "declared_closed"]))
    amount = draw(st.sampled_from({"declared_held": [1, 4096, 3 * CAP, 64 << 20], "declared_closed": [1024, CAP // 2],
                                   "over": [1, 100, 4096, CAP], "chunked_over": [1, 4096, CAP]}.get(variant, [0, 1, 4096])))
    return size_case(draw(apis), draw(streams), variant, amount, CAP)


@st.composite
def _depth(draw):
    depth = draw(st.sampled_from([5, 60, 127, 129, 200, 1100, 100_000]))
    return depth_case(draw(apis), draw(streams), draw(st.sampled_from(["schema", "tool_args", "content_part"])), depth,
                      draw(st.booleans()), LIMITS["max_json_depth"])


@st.composite
def _numbers(draw):
    return number_case(draw(apis), draw(streams), draw(st.sampled_from(NUMERIC_FIELDS + ["tool_args"])),
                       draw(st.sampled_from(BAD_NUMBERS)))


@st.composite
def _unencodable(draw):
    return surrogate_case(draw(apis), draw(streams), draw(st.sampled_from(ECHOED_FIELDS)),
                          draw(st.sampled_from(LONE_SURROGATES)))


@st.composite
def _many(draw):
    kind = draw(st.sampled_from(["messages", "tools", "tool_results", "content_parts"]))
    lim = {"messages": LIMITS["max_messages"], "tools": LIMITS["max_tools"], "tool_results": LIMITS["max_tool_results"],
           "content_parts": 2000}[kind]
    n = draw(st.sampled_from([lim - 2, lim + 1, 3 * lim]))
    return many_case(draw(apis), draw(streams), kind, n, LIMITS)


def test_compressed_bodies(proxy):
    _run_class(proxy, _compression(), 24)


def test_body_sizes(proxy):
    _run_class(proxy, _sizes(), 24)


def test_deep_nesting(proxy):
    _run_class(proxy, _depth(), 20)


def test_unrepresentable_numbers(proxy):
    _run_class(proxy, _numbers(), 20)


def test_unencodable_text(proxy):
    _run_class(proxy, _unencodable(), 20)


def test_many_small_parts(proxy):
    _run_class(proxy, _many(), 16)


# ------------------------------------------------------------------------------ client retries
@st.composite
def _retries(draw):
    api = draw(st.sampled_from(list(MODEL_APIS)))
    stream = draw(streams)
    kind = draw(st.sampled_from(["valid", "valid", "surrogate_stop", "surrogate_content", "big_seed"]))
    if kind == "valid":
        case = Case(api, json.dumps(valid(api, stream)).encode(), "200", "retries", "valid body", stream=stream)
    elif kind == "big_seed":
        case = number_case(api, stream, "seed", str(2 ** 64))
    else:
        case = surrogate_case(api, stream, kind.split("_")[1], "a\ud800")
    return case, draw(st.sampled_from(["in_flight", "after_finished", "after_drop"])), draw(st.sampled_from([1, 2]))


def _retried(srv: ProxyServer, drawn) -> None:
    """One logical call: a first attempt (given up after 0.15 s for ``in_flight`` and ``after_drop``),
    then the same bytes with ``x-stainless-retry-count`` while the first is generating, after it was
    answered, or after the dropped first attempt ended. Every attempt: no 5xx; the last one answered
    within the bound; the execution holds one delivered record if the call was answered, none if not."""
    case, phase, retry = drawn
    ex = srv.register_execution(engine_id="slow")
    mark = rss_mark()
    found = []
    first = send(srv.url, case, ex.api_key, timeout=ANSWER_S, drop_after=None if phase == "after_finished" else 0.15)
    if first.status is not None and first.status >= 500:
        found.append(f"first attempt: status {first.status}: {first.body[:200]!r}")
    if phase == "after_drop":
        wait_until(lambda: srv.counters(ex.execution_id)["inflight"] == 0, ANSWER_S)
    again = send(srv.url, case, ex.api_key, timeout=ANSWER_S, retry=retry)
    wait_until(lambda: srv.counters(ex.execution_id)["inflight"] == 0, ANSWER_S)
    found += [f"{phase} retry: {p}" for p in problems(case, again, _records(srv, ex.execution_id))]
    grew = rss_growth(mark)
    if grew > 2 * CAP + RSS_SLACK:
        found.append(f"RSS grew {grew / 2 ** 20:.1f} MiB")
    srv.close_execution(ex.execution_id)
    assert not found, found


def test_client_retries_at_every_phase(proxy):
    _run_class(proxy, _retries(), 18, check=_retried)
