"""docs/serving.md's ``bash`` blocks, run as one script: an engine process, serve_rollout in front of
it (``--engine-url``), registration, the reference agent, close, inspect_tree and rows."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from gyre.rollout.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "serving.md"


def page_script(engine_port: int, proxy_port: int, demo_dir: Path) -> str:
    """The page's ``bash`` blocks in order, with its ports, demo directory and interpreter replaced."""
    blocks = re.findall(r"^```bash\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)
    script = "\n".join(blocks)
    assert "127.0.0.1:30000" in script and "127.0.0.1:8000" in script and "/tmp/gyre-demo" in script
    script = re.sub(r"(127\.0\.0\.1:|--port )30000\b", rf"\g<1>{engine_port}", script)
    script = re.sub(r"(127\.0\.0\.1:|--port )8000\b", rf"\g<1>{proxy_port}", script)
    script = script.replace("/tmp/gyre-demo", str(demo_dir)).replace(".venv/bin/python", sys.executable)
    return script


def test_serving_page_runs_as_written(tmp_path):
    demo = tmp_path / "gyre-demo"
    engine_port = free_port()
    script = page_script(engine_port, next(p for p in iter(free_port, None) if p != engine_port), demo)
    assert script.count("tools/serve_rollout.py --engine-url") == 1
    proc = subprocess.Popen(["bash", "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and the servers it started
        out, err = proc.communicate()
        raise AssertionError(f"the page's script did not finish: {err[-3000:]}") from None
    assert proc.returncode == 0, err[-3000:]
    lines = out.splitlines()
    jsons = [json.loads(line) for line in lines if line.startswith("{")]
    registered, closed, stats = jsons[0], jsons[1], jsons[2]
    assert registered == {"execution_id": "demo-1", "api_key": "sk-demo-1", "engine_id": "engine-0"}
    calls = closed["counters"]["calls"]
    assert closed["execution_id"] == "demo-1" and calls >= 1 and closed["counters"]["delivered"] == calls
    assert stats["records"] == calls and stats["trainable_tokens"] == closed["counters"]["output_tokens"] > 0
    rows = [line.split() for line in lines if line.startswith("row ")]
    assert 1 <= len(rows) <= min(5, stats["leaves"])
    assert all(r[1] == "main" and int(r[2]) > int(r[3]) >= 1 and float(r[4]) < 0 for r in rows)
    assert sum(int(r[3]) for r in rows) == stats["trainable_tokens"]
    started = json.loads((demo / "proxy.json").read_text().splitlines()[0])
    assert started["save_dir"] == str(demo / "records") and len(started["engines"]) == 1
    assert (demo / "records" / "demo-1.jsonl").is_file()
