"""tools/serve_engine.py: prints {"url": ...} once ready, serves, stops cleanly on SIGTERM/SIGINT."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from gyre.rollout.client.engine_client import EngineClient
from gyre.rollout.embedded.serve import EmbeddedEngineProcess

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "serve_engine.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_serve_engine_prints_url_serves_and_stops_on_sigint(tiny_model_dir):
    proc = subprocess.Popen([sys.executable, str(TOOL), "--model-dir", str(tiny_model_dir), "--num-threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        line = proc.stdout.readline()
        url = json.loads(line)["url"]
        assert url.startswith("http://127.0.0.1:")
        with EngineClient(url, timeout=60) as c:
            assert c.health()
            r = c.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 0})
            assert len(r.output_ids) == 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()


def test_engine_process_with_default_model_stops_on_sigterm():
    proc = EmbeddedEngineProcess(extra_args=["--num-threads", "1"], env=ENV).start()
    try:
        with proc.client() as c:
            assert c.get_model_info()["is_generation"]
    finally:
        assert proc.stop() == 0                                # stop() sends SIGTERM


def test_bad_arguments_exit_2_with_one_line(tmp_path):
    for args in (["--model-dir", str(tmp_path)], ["--port", "-3"], ["--logprob-mode", "truncated"], ["--port", "x"]):
        p = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120, env=ENV)
        assert p.returncode == 2, (args, p.stderr)
        assert p.stdout == "" and len(p.stderr.strip().splitlines()) == 1 and "error" in p.stderr
