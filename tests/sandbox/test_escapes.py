"""Escape attempts from inside a bwrap and a podman execution, made as the policy would make them
(a harness process running tests/sandbox/escape_attempts.py through the real launcher): every attempt
on the run directory, checkpoints, another execution's workspace and key, rank 0's processes, an
engine port, the TCPStore and the network fails. Then the limits: a fork bomb, a memory bomb and a
disk fill each end their own execution as crashed with the reason, while an ordinary execution
beside them completes."""

from __future__ import annotations

import json
import secrets
import socket
import sys
import threading
from pathlib import Path

import pytest

from gyre.evaluation import TerminationStatus
from gyre.harness import CommandHarness, ProxyEndpoint
from gyre.sandbox import Environment, Limits
from gyre.sandbox.podman import TEST_IMAGE
from gyre.tasks import validate_task

ATTEMPTS = Path(__file__).with_name("escape_attempts.py").read_text()
SANDBOXES = ("bwrap", "podman")


@pytest.fixture
def sandboxing(backend):
    if backend.name not in SANDBOXES:
        pytest.skip(f"escape tests cover {', '.join(SANDBOXES)} ({backend.name} is covered by the conformance suite)")
    return backend


def make_task(tmp_path: Path, backend, tid: str, files: dict[str, str] | None = None):
    raw = {"id": tid, "instruction": "escape", "evaluator": {"type": "executable", "command": "true"},
           "workspace": {"files": files or {"README": "x\n"}}}
    task = validate_task(raw, source="test", task_dir=tmp_path)
    assert not isinstance(task, list), task
    if backend.name == "podman":
        import dataclasses
        task = dataclasses.replace(task, environment=Environment("image", TEST_IMAGE))
    return task


def test_escape_attempts_fail(tmp_path, sandboxing):
    import torch.distributed as dist

    backend = sandboxing
    run = tmp_path / "run"
    (run / "checkpoints" / "iter_1").mkdir(parents=True)
    checkpoint = run / "checkpoints" / "iter_1" / "model.bin"
    checkpoint.write_text("weights\n")
    (run / "records").mkdir()
    (run / "records" / "e.jsonl").write_text("{}\n")
    engine = socket.socket()
    engine.bind(("127.0.0.1", 0))
    engine.listen(8)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    other_key = f"sk-other-{secrets.token_hex(16)}"  # made here: no file holds it
    other = CommandHarness([sys.executable, "-c", "import time, pathlib; pathlib.Path('secret.txt').write_text("
                            "'other'); time.sleep(120)"], backend=backend, kill_grace_s=0.5)
    other_task = make_task(tmp_path, backend, "other")
    started = threading.Event()
    other_result = {}

    def run_other():
        other_result["r"] = other.run(other_task, run, "other-0", ProxyEndpoint("http://127.0.0.1:9", other_key),
                                      timeout_s=120, on_launch=lambda r: (other_result.update(run=r), started.set()))
        started.set()

    t = threading.Thread(target=run_other)
    t.start()
    assert started.wait(60) and "run" in other_result, other_result
    other_ws = run / "executions" / "other-0" / "workspace"
    own = run / "executions" / "escape-0"
    targets = {"run_dir": str(run), "checkpoint": str(checkpoint), "other_workspace": str(other_ws),
               "execution_json": str(own / "execution.json"), "launcher_pid": __import__("os").getpid(),
               "engine_port": engine.getsockname()[1], "tcpstore_port": store.port, "other_key_reversed": other_key[::-1]}
    task = make_task(tmp_path, backend, "escape", {"attempts.py": ATTEMPTS, "targets.json": json.dumps(targets)})
    h = CommandHarness([sys.executable, "attempts.py", "targets.json", "results.json"], backend=backend,
                       limits=Limits(pids=256, memory_bytes=512 << 20))
    try:
        res = h.run(task, run, "escape-0", ProxyEndpoint("http://127.0.0.1:9", "sk-escape-key"), timeout_s=120)
    finally:
        other_result["run"].cancel()
        t.join(60)
        engine.close()
    assert res.termination is TerminationStatus.COMPLETED, (res.error, res.dirs.log_path.read_text())
    results = json.loads((own / "workspace" / "results.json").read_text())
    assert len(results) == 13
    escaped = {name: detail for name, (ok, detail) in results.items() if ok}
    assert escaped == {}, escaped
    assert checkpoint.read_text() == "weights\n" and not (run / "evil.txt").exists()
    assert not (other_ws / "evil.txt").exists()
    assert json.loads((own / "execution.json").read_text())["task_id"] == "escape"
    assert other_result["r"].termination is TerminationStatus.CANCELLED


BOMBS = {
    "fork": ("import os, time\nn = 0\ntry:\n    while n < 2000:\n        if os.fork() == 0:\n"
             "            time.sleep(60); os._exit(0)\n        n += 1\nexcept OSError as exc:\n"
             "    print('fork failed after', n, exc, flush=True); raise SystemExit(1)\n", "process limit"),
    "memory": ("chunks = []\nfor i in range(1024):\n    chunks.append(bytearray(1 << 20))\nprint('allocated 1 GiB')\n",
               "memory limit"),
    "disk": ("import time\nwith open('fill.bin', 'wb') as f:\n    for i in range(300):\n"
             "        f.write(b'x' * (1 << 20)); f.flush(); time.sleep(0.02)\n", "workspace size limit"),
}


def test_bombs_end_their_own_execution_only(tmp_path, sandboxing):
    backend = sandboxing
    run = tmp_path / "run"
    limits = Limits(pids=64, memory_bytes=256 << 20, workspace_bytes=32 << 20)
    results = {}

    def launch(name, script):
        task = make_task(tmp_path, backend, name, {"bomb.py": script})
        h = CommandHarness([sys.executable, "bomb.py"], backend=backend, limits=limits, kill_grace_s=0.5)
        results[name] = h.run(task, run, f"{name}-0", ProxyEndpoint("http://127.0.0.1:9", f"sk-{name}"),
                              timeout_s=60)

    script = "import pathlib, time\ntime.sleep(3)\npathlib.Path('done.txt').write_text('ok')\n"
    threads = [threading.Thread(target=launch, args=(name, s)) for name, (s, _) in BOMBS.items()]
    threads.append(threading.Thread(target=launch, args=("ordinary", script)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for name, (_, reason) in BOMBS.items():
        r = results[name]
        assert r.termination is TerminationStatus.CRASHED and reason in r.error, (name, r.error, r.exit_code,
                                                                                  r.dirs.log_path.read_text()[-500:])
    assert results["disk"].workspace is None
    ok = results["ordinary"]
    assert ok.termination is TerminationStatus.COMPLETED and (ok.workspace.path / "done.txt").read_text() == "ok"
