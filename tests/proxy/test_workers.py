"""Rank 0's proxy as worker processes (gyre/proxy/workers.py): two real worker processes on
127.0.0.1 in front of a real embedded engine, against the same calls through one in-process
proxy (the single-process reference)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from gyre.proxy.engines import ClientEngine
from gyre.proxy.server import ProxyConfig, ProxyServer
from gyre.proxy.workers import ProxyWorkers, WorkerSpec, worker_index
from gyre.rollout.client.async_client import AsyncEngineClient
from gyre.trajectory.store import TrajectoryStore

CONFIG = dict(model_name="gyre-policy", default_max_tokens=6, max_tokens_cap=6, max_context_tokens=4096,
              default_sampling={"temperature": 0.0})
IDS = [f"a0-g0000-e{i:05d}" for i in range(6)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from gyre.rollout.embedded.config import EngineConfig
    from gyre.rollout.embedded.server import EngineServer

    server = EngineServer(EngineConfig(model_dir=str(tiny_model_dir))).start()
    yield server
    server.stop()


def _conversation(base_url: str, api_key: str, n: int) -> list[str]:
    """Two turns of one execution through the Chat Completions API; the assistant's replies."""
    msgs = [{"role": "user", "content": f"Task {n}: list the files."}]
    replies = []
    with httpx.Client(timeout=120) as c:
        for turn in range(2):
            r = c.post(base_url + "/v1/chat/completions", headers={"authorization": f"Bearer {api_key}"},
                       json={"model": "gyre-policy", "messages": msgs})
            assert r.status_code == 200, r.text
            reply = r.json()["choices"][0]["message"]["content"] or ""
            replies.append(reply)
            msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"Turn {turn + 1} done."}]
    return replies


def _paths(tree) -> list[tuple]:
    """Every leaf's path: tokens, provenance, training mask and behaviour log-probs (records' timings
    and request ids differ between two proxies; these must not)."""
    return [(tree.path_tokens(n).tolist(), tree.path_provenance(n).tolist(), tree.path_output_mask(n).tolist(),
             [round(float(x), 4) for x in tree.path_logprobs(n)]) for n in sorted(tree.leaves())]


@pytest.mark.slow  # proxy worker processes
def test_two_workers_record_what_one_in_process_proxy_records(tiny_model_dir, engine, tmp_path, local_renderer):
    assert {worker_index(i, 2) for i in IDS} == {0, 1}               # both workers own executions
    spec = WorkerSpec(str(tiny_model_dir), str(tmp_path / "records"), ProxyConfig(**CONFIG))
    workers = ProxyWorkers(spec, 2, spec_path=tmp_path / "spec.pickle", log_dir=tmp_path)
    workers.add_engine(ClientEngine(AsyncEngineClient(engine.url), "engine-0"))
    ref = ProxyServer(local_renderer, store=TrajectoryStore(tmp_path / "ref", fsync_every=0),
                      config=ProxyConfig(**CONFIG))
    ref.add_engine(ClientEngine(AsyncEngineClient(engine.url), "engine-0"))
    workers.start()
    ref.start()
    pids = workers.pids
    try:
        assert len(set(workers.urls)) == 2
        for n, sid in enumerate(IDS):
            ex = workers.register_execution(sid, task_id="t", harness="command", engine_id="engine-0")
            assert ex.base_url == workers.url_for(sid) == workers.urls[worker_index(sid, 2)]
            other = workers.urls[1 - ex.worker]                      # the other worker does not know the key
            r = httpx.post(other + "/v1/chat/completions", headers={"authorization": f"Bearer {ex.api_key}"},
                           json={"model": "gyre-policy", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 401
            rex = ref.register_execution(sid, task_id="t", harness="command", engine_id="engine-0")
            assert _conversation(ex.base_url, ex.api_key, n) == _conversation(ref.url, rex.api_key, n)
            got, want = workers.counters(sid), ref.counters(sid)
            assert got["calls"] == want["calls"] == 2
            assert (got["input_tokens"], got["output_tokens"]) == (want["input_tokens"], want["output_tokens"])
            tree = workers.tree(sid)                                 # rebuilt on this side, digest-checked
            assert len(tree.records) == 2 and _paths(tree) == _paths(ref.tree(sid))
        assert workers.abort_engine("engine-0") == 0                 # nothing in flight at either worker
        closed = workers.close_execution(IDS[0])
        assert closed.calls == 2 and closed.delivered == 2
        with pytest.raises(KeyError):
            workers.counters("a0-g0000-e09999")
        with pytest.raises(ValueError, match="already registered"):
            workers.register_execution(IDS[1], engine_id="engine-0")
    finally:
        workers.stop()
        ref.stop()
    assert sorted(p.name for p in (tmp_path / "records").iterdir()) == [f"{i}.jsonl" for i in IDS]
    for pid in pids:                                                  # the workers exited with their stdin
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow  # proxy worker processes
def test_a_dead_worker_is_an_error_at_the_next_call(tiny_model_dir, engine, tmp_path):
    spec = WorkerSpec(str(tiny_model_dir), str(tmp_path / "records"), ProxyConfig(**CONFIG))
    workers = ProxyWorkers(spec, 2, spec_path=tmp_path / "spec.pickle")
    workers.add_engine(ClientEngine(AsyncEngineClient(engine.url), "engine-0"))
    workers.start()
    try:
        sid = IDS[0]
        workers.register_execution(sid, engine_id="engine-0")
        victim = workers.pids[worker_index(sid, 2)]
        os.kill(victim, signal.SIGKILL)
        for _ in range(200):                                          # until it is a zombie (sockets closed)
            if open(f"/proc/{victim}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match="proxy worker"):
            workers.counters(sid)
        with pytest.raises(RuntimeError, match="before they start"):
            workers.add_engine(ClientEngine(AsyncEngineClient(engine.url), "engine-1"))
    finally:
        workers.stop()
