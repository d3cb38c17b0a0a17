"""``bench/chaos.py``'s ``hostile`` section: seeded hostile requests of seven classes against a real
:class:`~gyre.proxy.server.ProxyServer` in this process in front of an embedded engine in a process
of its own (``python -m gyre.rollout.embedded.serve``), both on 127.0.0.1, with another execution's small
calls running beside them.

The cases are those of ``tests/proxy/test_hostile_bodies.py`` (``gyre/testing/hostile_cases.py``), drawn
with ``random.Random(seed)`` instead of hypothesis: ``compression`` (gzip / deflate bombs, bodies
inflating to just under the cap, truncated and mislabelled encodings), ``sizes`` (bodies just over
and under the cap, sent whole or chunked; a Content-Length far above the cap with the body held
back; a body cut short), ``depth`` (nesting in tool schemas, tool arguments, content parts),
``numbers`` (NaN, Infinity, 1e400, integers beyond 64 bits in sampling fields and tool arguments),
``unencodable`` (lone surrogates in every string the proxy forwards or echoes), ``many`` (many tiny
messages, tools, tool results, content parts; just under and over the limits) and ``retries``
(the same bytes sent again with ``x-stainless-retry-count`` while the first attempt is in flight,
after it was answered, after its client left). The proxy's body cap is ``--hostile-cap`` bytes.

Reported per class (``hostile_by_class``) and overall: ``hostile_requests``, ``hostile_5xx``,
``hostile_hangs`` (no answer within 30 s), ``hostile_delivery_errors`` (an answered model call
whose fresh execution does not hold exactly one delivered record, or an unanswered one that holds
any), ``hostile_wrong_status`` (a 2xx/4xx other than the one promised), ``hostile_rss_growth_max``
(this process's peak RSS above its level before the request, bytes; ``..._x_cap``: as a multiple of
the cap; the engine's memory is not in it), per class also ``rss_held_max`` (the RSS still above
that level once the call is over and garbage collected: what the execution keeps by design plus what
the allocator keeps for reuse) and ``tree_nbytes_max`` (the token arrays the execution's trajectory
tree keeps by design, :meth:`~gyre.trajectory.tree.TrajectoryTree.nbytes`), and the other
execution's calls:
``hostile_others_p99_s``, ``hostile_others_max_s``, ``hostile_others_failed`` (that execution is
routed to an engine of its own, so its latency is the proxy's doing, not a long hostile prefill's).
``hostile_targets`` holds the figures the proxy promises beside them.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from chaos_common import _engine_process, _in_process_proxy, _log

from gyre.testing.hostile_cases import (BAD_NUMBERS, BOMB_FACTORS, COMPRESSION_VARIANTS, DEPTH_PLACES, DEPTHS, ECHOED_FIELDS,
                                 ENCODINGS, LONE_SURROGATES, MANY_KINDS, MODEL_APIS, NUMERIC_FIELDS, RETRY_KINDS,
                                 RETRY_PHASES, compression_case, depth_case, many_case, many_counts, number_case,
                                 retry_case, size_amounts, size_case, surrogate_case)
from gyre.testing.hostile_exchange import Others, problems, rss_growth, rss_held, rss_mark, send, wait_until

from gyre.proxy.engines import ClientEngine
from gyre.rollout.client.async_client import AsyncEngineClient

CLASSES = ("compression", "sizes", "depth", "numbers", "unencodable", "many", "retries")
HANG_S = 30.0
TARGETS = {"hostile_5xx": 0, "hostile_hangs": 0, "hostile_delivery_errors": 0, "hostile_rss_growth_max_x_cap": 2.0,
           "hostile_others_p99_s": 1.0}


def limits(cap: int) -> dict[str, int]:
    """The proxy limits of the section: the body cap, nesting 128 deep, 1,000 messages, 64 tools and
    128 tool results (small, so that the cases over them stay small)."""
    return {"max_body_bytes": cap, "max_json_depth": 128, "max_messages": 1000, "max_tools": 64,
            "max_tool_results": 128}


def draw(r: random.Random, cls: str, cap: int, lim: dict[str, int]):
    """One case of ``cls``: a Case, or (Case, phase, retry number) for ``retries``."""
    api = r.choice(list(MODEL_APIS) + ["count_tokens"])
    stream = r.random() < 0.5
    if cls == "compression":
        return compression_case(api, stream, r.choice(COMPRESSION_VARIANTS), r.choice(BOMB_FACTORS),
                                r.choice(ENCODINGS), cap)
    if cls == "sizes":
        amounts = size_amounts(cap)
        variant = r.choice(sorted(amounts))
        return size_case(api, stream, variant, r.choice(amounts[variant]), cap)
    if cls == "depth":
        return depth_case(api, stream, r.choice(DEPTH_PLACES), r.choice(DEPTHS), r.random() < 0.5,
                          lim["max_json_depth"])
    if cls == "numbers":
        return number_case(api, stream, r.choice(NUMERIC_FIELDS + ["tool_args"]), r.choice(BAD_NUMBERS))
    if cls == "unencodable":
        return surrogate_case(api, stream, r.choice(ECHOED_FIELDS), r.choice(LONE_SURROGATES))
    if cls == "many":
        kind = r.choice(MANY_KINDS)
        return many_case(api, stream, kind, r.choice(many_counts(kind, lim)), lim)
    api = r.choice(MODEL_APIS)
    case = retry_case(api, stream, r.choice(RETRY_KINDS), max_tokens=48)
    return case, r.choice(RETRY_PHASES), r.choice([1, 2])


#: The engine of the execution whose small calls run beside the hostile ones.
OTHERS_ENGINE = "engine-others"


def _one(srv, drawn, cls: str) -> dict:
    """Send one drawn case from a fresh execution; what it broke."""
    retried = cls == "retries"
    case, phase, retry = drawn if retried else (drawn, None, None)
    ex = srv.register_execution(engine_id="engine-0")
    mark = rss_mark()
    first = None
    if retried:
        first = send(srv.url, case, ex.api_key, timeout=HANG_S, drop_after=None if phase == "after_finished" else 0.02)
        if phase == "after_drop":
            wait_until(lambda: srv.counters(ex.execution_id)["inflight"] == 0, HANG_S)
    ans = send(srv.url, case, ex.api_key, timeout=HANG_S, retry=retry)
    wait_until(lambda: srv.counters(ex.execution_id)["inflight"] == 0, HANG_S)
    grew = rss_growth(mark)
    held = rss_held(mark)
    tree = srv.tree(ex.execution_id)
    records = [r.delivered for r in tree.records]
    kept = tree.nbytes()
    srv.close_execution(ex.execution_id)
    answered = ans.status == 200 and case.api != "count_tokens"
    found = problems(case, ans, None)
    st = ans.status
    return {"status": "hang" if ans.hung else str(st), "what": f"{case!r} {phase or ''}".strip(),
            "5xx": int(st is not None and st >= 500) + int(first is not None and (first.status or 0) >= 500),
            "hang": int(ans.hung),
            "delivery": int((answered and records != [True]) or (not answered and bool(records))),
            "wrong": int(any("expected" in p or "closing event" in p or "error event" in p or "shape" in p
                             or "closed without" in p for p in found)),
            "rss": grew, "held": held, "kept": kept, "problems": found}


def section_hostile(n: int, seed: int, cap: int = 256 << 10) -> dict:
    """``n`` seeded cases of each class (module docstring)."""
    r = random.Random(seed)
    lim = limits(cap)
    tmp = Path(tempfile.mkdtemp(prefix="chaos-hostile-"))
    engine, srv, _ = _in_process_proxy(tmp, cap=48, retry_timeout_s=5.0, max_context=32768, engine_process=True,
                                       **lim)
    # the other execution has an engine of its own: its latency is then the proxy's doing, not a
    # long hostile prefill's on a shared engine
    others_engine = _engine_process()
    srv.add_engine(ClientEngine(AsyncEngineClient(others_engine.url), OTHERS_ENGINE))
    by_class: dict[str, dict] = {}
    examples: list[dict] = []
    all_lat: list[float] = []
    try:
        others = Others(srv.url, srv.register_execution(engine_id=OTHERS_ENGINE).api_key)
        wait_until(lambda: len(others.lat) >= 3, 60)
        others.take()
        # warm the allocator and the engine once, so that the first case's RSS is not the server's start
        send(srv.url, size_case("chat", False, "under", 4096, cap), srv.register_execution(engine_id="engine-0").api_key,
             timeout=HANG_S)
        for cls in CLASSES:
            _log(f"hostile: {cls}")
            t0 = time.monotonic()
            rows = [_one(srv, draw(r, cls, cap, lim), cls) for _ in range(n)]
            lat, failed = others.take()
            all_lat += lat
            statuses = Counter(x["status"] for x in rows)
            by_class[cls] = {
                "requests": len(rows), "status": dict(sorted(statuses.items())),
                "5xx": sum(x["5xx"] for x in rows), "hangs": sum(x["hang"] for x in rows),
                "delivery_errors": sum(x["delivery"] for x in rows), "wrong_status": sum(x["wrong"] for x in rows),
                "rss_growth_max": max(x["rss"] for x in rows),
                "rss_growth_max_x_cap": round(max(x["rss"] for x in rows) / cap, 2),
                "rss_held_max": max(x["held"] for x in rows), "tree_nbytes_max": max(x["kept"] for x in rows),
                "others_calls": len(lat), "others_failed": len(failed),
                "others_p99_s": round(float(np.percentile(lat, 99)), 3) if lat else 0.0,
                "others_max_s": round(max(lat), 3) if lat else 0.0, "seconds": round(time.monotonic() - t0, 1)}
            examples += [{"class": cls, "case": x["what"], "problems": [p[:160] for p in x["problems"]],
                          "rss_growth": x["rss"]} for x in rows
                         if (x["5xx"] or x["hang"] or x["delivery"] or x["wrong"] or x["rss"] > 2 * cap)][:2]
        others.stop()
    finally:
        srv.stop()
        engine.stop()
        others_engine.stop()
    tot = lambda k: sum(c[k] for c in by_class.values())  # noqa: E731
    return {"hostile_cap_bytes": cap, "hostile_requests": tot("requests"), "hostile_5xx": tot("5xx"),
            "hostile_hangs": tot("hangs"), "hostile_delivery_errors": tot("delivery_errors"),
            "hostile_wrong_status": tot("wrong_status"),
            "hostile_rss_growth_max": max(c["rss_growth_max"] for c in by_class.values()),
            "hostile_rss_growth_max_x_cap": max(c["rss_growth_max_x_cap"] for c in by_class.values()),
            "hostile_others_p99_s": round(float(np.percentile(all_lat, 99)), 3) if all_lat else 0.0,
            "hostile_others_max_s": max(c["others_max_s"] for c in by_class.values()),
            "hostile_others_failed": tot("others_failed"), "hostile_targets": TARGETS,
            "hostile_by_class": by_class, "hostile_examples": examples}


__all__ = ["section_hostile", "CLASSES", "TARGETS"]
