"""``bench/chaos.py``'s process-level sections: engines killed under load (``engine_kills``) and
training ranks killed and resumed (``rank_kills``); see ``bench/chaos.py`` for what they report."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from bench.common import free_port
from chaos_common import CLIENT_TIMEOUT_S, ENV, PATHS, ROOT, _headers, _log

# -------------------------------------------------------------------------------- engine kills
def _start_engine(model: str, port: int, timeout: float = 300.0):
    from gyre.rollout.embedded.serve import EmbeddedEngineProcess

    return EmbeddedEngineProcess(model, port=port, env=ENV, extra_args=[
        "--num-threads", "1", "--max-running-requests", "8"]).start(timeout=timeout)


def _chat_call(c, key: str, text: str, stream: bool) -> tuple[bool, str]:
    """One Chat call; (ok, why-not). ok: 200 and, streamed, ``[DONE]`` without an error line."""
    import httpx

    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 48, "ignore_eos": True,
            "stream": stream}
    try:
        if not stream:
            r = c.post(PATHS["chat"], json=body, headers=_headers("chat", key))
            if r.status_code != 200:
                return False, f"status {r.status_code}"
            r.json()["choices"][0]
            return True, ""
        with c.stream("POST", PATHS["chat"], json=body, headers=_headers("chat", key)) as r:
            if r.status_code != 200:
                r.read()
                return False, f"status {r.status_code}"
            done = False
            for line in r.iter_lines():
                if line.startswith("data:"):
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                    elif '"error"' in data and data.startswith('{"error"'):
                        return False, "error event"
            return (True, "") if done else (False, "stream without [DONE]")
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        return False, type(exc).__name__


def section_engine_kills(kills: int, seed: int, workers: int = 4) -> dict:
    import httpx
    from gyre.embedded_model import ensure_tiny_model
    from gyre.trajectory.store import TrajectoryStore

    r = random.Random(seed)
    model = str(ensure_tiny_model("local"))
    save = Path(tempfile.mkdtemp(prefix="chaos-kill-"))
    ports = [free_port(), free_port()]
    engines = [_start_engine(model, p) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    proxy = subprocess.Popen([sys.executable, str(ROOT / "tools" / "serve_rollout.py"), "--engine-url", urls[0],
                              "--engine-url", urls[1], "--port", "0", "--save-dir", str(save),
                              "--rollout-max-new-tokens", "64", "--log-level", "ERROR"],
                             cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             start_new_session=True)
    box: dict[str, str] = {}
    t = threading.Thread(target=lambda: box.setdefault("line", proxy.stdout.readline()), daemon=True)
    t.start()
    t.join(300)
    base = json.loads(box["line"])["base_url"]
    names = httpx.get(base + "/health").json()["engines"]  # engine-0, engine-1 in --engine-url order
    stop = threading.Event()
    lock = threading.Lock()
    stats = {"harness_errors": 0, "calls": 0, "inflight": 0, "retries": 0, "reroutes": 0}
    why: Counter = Counter()
    per_ex: dict[str, list[int]] = {}  # execution id -> [requests sent, 200 answers]
    deadline = time.monotonic() + max(300, kills * 60)

    def client(w: int):
        with httpx.Client(base_url=base, timeout=CLIENT_TIMEOUT_S) as c:
            for n_ex in range(100000):
                if stop.is_set() or time.monotonic() > deadline:
                    return
                eid = f"w{w}-{n_ex}"
                key = c.post("/gyre/executions", json={"execution_id": eid, "task_id": "chaos"}).json()["api_key"]
                per_ex[eid] = [0, 0]
                for k in range(4):
                    with lock:
                        stats["inflight"] += 1
                    ok, reason = _chat_call(c, key, f"execution {eid} call {k}", stream=bool((w + k) % 2))
                    with lock:
                        stats["inflight"] -= 1
                        stats["calls"] += 1
                        per_ex[eid][0] += 1
                        per_ex[eid][1] += ok
                        if not ok:
                            stats["harness_errors"] += 1
                            why[reason] += 1
                counters = c.post(f"/gyre/executions/{eid}/close").json().get("counters", {})
                with lock:
                    stats["retries"] += counters.get("retries", 0)
                    stats["reroutes"] += counters.get("reroutes", 0)

    threads = [threading.Thread(target=client, args=(w,), daemon=True) for w in range(workers)]
    for th in threads:
        th.start()
    done_kills = 0
    restart_s: list[float] = []
    try:
        with httpx.Client(base_url=base, timeout=CLIENT_TIMEOUT_S) as admin:
            for k in range(kills):
                if time.monotonic() > deadline:
                    break
                for _ in range(100):  # wait (bounded) for calls in flight
                    if stats["inflight"] >= 2:
                        break
                    time.sleep(0.05)
                time.sleep(r.uniform(0.05, 0.6))
                i = k % 2
                os.killpg(engines[i].proc.pid, signal.SIGKILL)
                engines[i].proc.wait(30)
                done_kills += 1
                for e in admin.get("/gyre/executions").json()["executions"]:
                    if not e["closed"] and e["engine_id"] == names[i]:
                        admin.post("/gyre/routes", json={"execution_id": e["execution_id"], "engine_id": names[1 - i]})
                t0 = time.monotonic()
                engines[i] = _start_engine(model, ports[i])
                restart_s.append(time.monotonic() - t0)
                _log(f"engine kill {done_kills}/{kills}: calls {stats['calls']}, errors {stats['harness_errors']}")
    finally:
        stop.set()
        for th in threads:
            th.join(120)
        proxy.send_signal(signal.SIGTERM)
        try:
            proxy.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proxy.pid, signal.SIGKILL)
        for e in engines:
            if e.proc is not None and e.proc.poll() is None:
                os.killpg(e.proc.pid, signal.SIGKILL)
    store = TrajectoryStore(save)
    lost = dup = 0
    for eid, (sent, ok) in per_ex.items():
        try:
            recs = store.read_records(eid)
        except FileNotFoundError:
            recs = []
        lost += max(0, ok - sum(bool(x.delivered) for x in recs))
        dup += max(0, len(recs) - sent)
    return {"engine_kills": done_kills, "harness_errors": stats["harness_errors"], "records_lost": lost,
            "records_duplicated": dup, "kill_calls": stats["calls"],
            "kill_proxy_retries": stats["retries"], "kill_proxy_reroutes": stats["reroutes"], "kill_errors_by_kind": dict(why),
            "engine_restart_s_max": round(max(restart_s, default=0.0), 1)}


# ---------------------------------------------------------------------------------- rank kills
def _torchrun(run: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
            str(ROOT / "pretrain_gyre.py"), "--config", str(ROOT / "examples" / "cpu_tiny.yaml"), "--run-dir", str(run),
            "--no-progress", *extra]


def _pids_of_ranks(launcher: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(launcher), "-f", "pretrain_gyre.py"], capture_output=True, text=True)
    return sorted(int(p) for p in out.stdout.split())


def section_rank_kills(kills: int, seed: int, train_steps: int) -> dict:
    from gyre.metrics import read_metrics

    r = random.Random(seed)
    run = Path(tempfile.mkdtemp(prefix="chaos-rank-")) / "run"
    tracker = run / "checkpoints" / "latest_checkpointed_iteration.txt"
    steps = ["--train-steps", str(train_steps), "--save-interval", "1"]
    done_kills = 0
    attempts_failed = 0
    last_resume_at = 0
    log = run.parent / "job.log"
    for k in range(kills + 1):
        resume = ["--load", str(run)] if k > 0 else []
        have = int(tracker.read_text()) if tracker.exists() else 0
        if k < kills and have >= train_steps - 1:
            break  # nothing left to kill in
        with open(log, "a") as f:
            proc = subprocess.Popen(_torchrun(run, *steps, *resume), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                                    stderr=f, start_new_session=True)
        if k > 0:
            last_resume_at = len((run / "executions.jsonl").read_text().splitlines())
        if k == kills:
            try:
                rc = proc.wait(1800)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = -9
            attempts_failed += rc != 0
            break
        # kill after this checkpoint, before the last, leaving a step for each kill still to come
        target = r.randint(have + 1, max(have + 1, train_steps - 1 - (kills - 1 - k)))
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline and proc.poll() is None:
            if tracker.exists() and tracker.read_text().strip() and int(tracker.read_text()) >= target:
                break
            time.sleep(0.2)
        time.sleep(r.uniform(0, 5))
        pids = _pids_of_ranks(proc.pid)
        if proc.poll() is None and pids:
            os.kill(r.choice(pids), signal.SIGKILL)
            done_kills += 1
        try:
            proc.wait(180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        _log(f"rank kill {done_kills}/{kills} after checkpoint {tracker.read_text().strip() if tracker.exists() else '-'}")
    # ---- the promises, from the final history
    events = [json.loads(x) for x in (run / "executions.jsonl").read_text().splitlines() if x.strip()]
    # an execution trained at two different steps (a step trained again after a kill, before its
    # checkpoint was written, shows in steps_repeated instead)
    steps_of: dict[str, set[int]] = {}
    for e in events:
        if e["event"] == "trained":
            steps_of.setdefault(e["execution_id"], set()).add(e["step"])
    trained_twice = sum(1 for v in steps_of.values() if len(v) > 1)
    # finished before the last resume: closed with an outcome in a killed attempt
    killed_part = events[:last_resume_at]
    finished = {e["execution_id"] for e in killed_part if e["event"] == "closed"
                and e.get("status") in ("completed", "timeout") and e.get("outcome") != "excluded"}
    carried = {e["execution_id"] for e in events[last_resume_at:] if e["event"] == "carried_over"}
    final = int(tracker.read_text()) if tracker.exists() else 0
    trained_final: set[str] = set()
    if final:
        ck = json.loads((run / "checkpoints" / f"iter_{final:07d}" / "controller.json").read_text())
        trained_final = set(ck.get("trained", []))
    finished_lost = len(finished - trained_final - carried)
    rows, _ = read_metrics(run / "metrics.jsonl")
    per_step = Counter(row["step"] for row in rows)
    steps_repeated = sum(n - 1 for n in per_step.values())
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    return {"rank_kills": done_kills, "finished_lost": finished_lost, "trained_twice": trained_twice,
            "steps_repeated": steps_repeated, "rank_final_checkpoint": final,
            "rank_attempts": summary.get("attempts", 0), "rank_final_attempt_failed": attempts_failed,
            "rank_finished": len(finished), "rank_carried_over": len(carried), "rank_run_dir": str(run)}
