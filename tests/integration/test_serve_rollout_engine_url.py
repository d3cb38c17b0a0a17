"""``tools/serve_rollout.py --engine-url``: the proxy alone in front of an engine started as its own
process, driven by the reference agent (a real process); refused start-ups exit 2 with one line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from gyre.embedded_model import load_tokenizer
from gyre.rollout.embedded.serve import EmbeddedEngineProcess
from gyre.rollout.ports import free_port
from gyre.trajectory.store import TrajectoryStore

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVE = [sys.executable, "tools/serve_rollout.py"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _start_serve(args, timeout=240):
    proc = subprocess.Popen(SERVE + args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, start_new_session=True)
    box: dict[str, str] = {}
    t = threading.Thread(target=lambda: box.setdefault("line", proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    try:
        return proc, json.loads(box.get("line", ""))
    except ValueError:
        proc.kill()
        pytest.fail(f"serve_rollout did not start: {proc.stderr.read()[-2000:]}")


def test_engine_url_records_a_reference_agent_run(tiny_model_dir, tmp_path):
    save = tmp_path / "records"
    with EmbeddedEngineProcess(str(tiny_model_dir), extra_args=["--weight-version", "7", "--num-threads", "1"],
                               env=ENV) as engine:
        # no --model-dir: the tokenizer comes from the engine's /model_info model_path
        proc, info = _start_serve(["--engine-url", engine.url, "--port", "0", "--save-dir", str(save),
                                   "--rollout-max-new-tokens", "24", "--log-level", "WARNING"])
        try:
            base = info["base_url"]
            assert info["engines"] == [engine.url] and info["save_dir"] == str(save)
            assert httpx.get(base + "/health").json()["engines"] == ["engine-0"]
            r = httpx.post(base + "/gyre/executions", json={"task_id": "demo", "harness": "reference",
                                                            "execution_id": "demo-1", "api_key": "sk-demo-1"})
            assert r.status_code == 200
            assert r.json() == {"execution_id": "demo-1", "api_key": "sk-demo-1", "engine_id": "engine-0"}
            instruction = "Print the word banana."
            agent = subprocess.run(
                [sys.executable, "-m", "gyre.harness.reference_agent", "--base-url", base + "/v1",
                 "--instruction", instruction, "--workdir", str(tmp_path), "--max-turns", "2", "--max-tokens", "24"],
                cwd=ROOT, env=dict(ENV, GYRE_API_KEY="sk-demo-1"), capture_output=True, text=True, timeout=300)
            assert agent.returncode in (0, 3), agent.stderr[-2000:]
            calls = int(re.search(r"model_calls=(\d+)", agent.stderr).group(1))
            assert calls >= 1
            closed = httpx.post(base + "/gyre/executions/demo-1/close")
            assert closed.status_code == 200
            counters = closed.json()["counters"]
            assert counters["calls"] == counters["delivered"] == calls and counters["output_tokens"] > 0
            # the key stops working once closed
            assert httpx.post(base + "/v1/chat/completions", headers={"Authorization": "Bearer sk-demo-1"},
                              json={"model": "m", "messages": [{"role": "user", "content": "x"}]}).status_code == 401
        finally:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(60)
        assert rc == 0
        assert engine.proc.poll() is None  # the proxy does not stop an engine it did not start
    records = TrajectoryStore(save).read_records("demo-1")
    assert len(records) == calls
    tok = load_tokenizer(tiny_model_dir)
    assert instruction in tok.decode(records[0].input_ids.tolist())
    for rec in records:
        assert rec.engine_id == "engine-0" and rec.policy_version == 7 and rec.role == "main" and rec.delivered
        n = len(rec.output_ids)
        assert 1 <= n <= 24 and len(rec.output_logprobs) == n and all(lp <= 0 for lp in rec.output_logprobs)
    tree = TrajectoryStore(save).load_tree("demo-1")
    assert len(tree.records) == calls and len(tree.leaves()) >= 1
    inspect = subprocess.run([sys.executable, "tools/inspect_tree.py", str(save / "demo-1.jsonl"), "--json"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert inspect.returncode == 0, inspect.stderr
    stats = json.loads(inspect.stdout)
    assert stats["records"] == calls and stats["trainable_tokens"] == sum(len(r.output_ids) for r in records)


def _refused(args, env=None):
    p = subprocess.run(SERVE + ["--port", "0"] + args, cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=env or ENV)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and p.stdout == "", (p.returncode, p.stderr)
    assert lines[0].startswith("serve_rollout: error: ")
    return lines[0]


def test_dead_engine_url_exits_2_with_one_line():
    port = free_port()  # nothing listens there
    line = _refused(["--engine-url", f"http://127.0.0.1:{port}", "--engine-check-timeout-s", "2"])
    assert f"http://127.0.0.1:{port} does not answer GET /health" in line


def test_engine_url_that_answers_non_200(tmp_path):
    import http.server

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(503)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        line = _refused(["--engine-url", f"http://127.0.0.1:{srv.server_port}"])
    finally:
        srv.shutdown()
    assert line.endswith("answered GET /health with status 503")


@pytest.mark.parametrize("args, says", [
    (["--backend", "gpu"], "argument --backend: gpu serves from SGLang"),
    (["--rollout-engine", "sglang"], "argument --rollout-engine: sglang needs --backend gpu"),
    (["--rollout-engine", "sglang", "--backend", "gpu"], "argument --rollout-engine: sglang is not importable"),
    (["--engine-url", "127.0.0.1:30000"], "argument --engine-url: '127.0.0.1:30000': expected http://HOST:PORT"),
    (["--engine-url", "http://127.0.0.1:30000", "--num-engines", "2"], "argument --num-engines: not allowed"),
])
def test_unsupported_combinations_exit_2(args, says):
    import importlib.util

    if "is not importable" in says and importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is importable here")
    assert says in _refused(args)


def test_gpu_backend_without_cuda_exits_2(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")  # an importable "sglang": the CUDA check decides
    env = dict(ENV, PYTHONPATH=str(tmp_path))
    line = _refused(["--rollout-engine", "sglang", "--backend", "gpu"], env=env)
    assert line == "serve_rollout: error: argument --backend: gpu, but CUDA is not available on this machine"


def test_help_lists_its_own_flags_first():
    out = subprocess.run(SERVE + ["--help"], cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
    groups = re.findall(r"^([a-z][^\n]*):$", out.split("\n\n", 2)[2], flags=re.M)
    assert groups[:4] == ["options", "serve_rollout: proxy", "serve_rollout: engines", "model"]
    assert out.index("--engine-url URL") < out.index("--model-dir MODEL_DIR") < out.index("--lr LR")
