"""SandboxProcess: own process group, streamed log, time limit (SIGTERM group, then SIGKILL),
cancel, exit status; with isolation also escaped processes die and masks hide paths."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from gyre.sandbox.process import SandboxProcess, isolation_supported
from tests.processes import alive

MODES = [pytest.param(False, id="plain"),
         pytest.param(True, id="isolated", marks=pytest.mark.skipif(not isolation_supported(),
                                                                       reason="mount/pid namespaces unavailable"))]


def proc(tmp_path: Path, script: str, isolate: bool, **kw) -> SandboxProcess:
    own = tmp_path / "run" / "executions" / "e1"
    (own / "workspace").mkdir(parents=True, exist_ok=True)
    return SandboxProcess(["bash", "-c", script], cwd=own / "workspace", env={"PATH": os.environ["PATH"]},
                          log_path=own / "harness.log", isolate=isolate, own_dir=own,
                          masks=[tmp_path / "run"] if isolate else [], **kw)


def wait_for(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


@pytest.mark.parametrize("isolate", MODES)
def test_exit_status_and_streamed_log(tmp_path, isolate):
    p = proc(tmp_path, 'echo started; echo to-stderr >&2; while [ ! -e go ]; do sleep 0.05; done; echo bye; exit 3',
             isolate)
    p.start()
    wait_for(lambda: "started" in p.log_path.read_text())  # the log streams while it runs
    (p.cwd / "go").touch()
    ex = p.wait(30)
    assert (ex.returncode, ex.timed_out, ex.cancelled, ex.isolation_failed) == (3, False, False, False)
    log = p.log_path.read_text()
    assert "started" in log and "to-stderr" in log and "bye" in log
    assert p.wait(30) is ex  # idempotent


@pytest.mark.parametrize("isolate", MODES)
def test_timeout_kills_the_whole_group(tmp_path, isolate):
    # ignores SIGTERM; leaves a background process that also ignores it
    p = proc(tmp_path, "trap '' TERM; (trap '' TERM; sleep 60) & echo $! > bg.pid; echo ready; sleep 60", isolate,
             kill_grace_s=0.5)
    p.start()
    wait_for(lambda: (p.cwd / "bg.pid").exists() and "ready" in p.log_path.read_text())
    t0 = time.monotonic()
    ex = p.wait(1.0)
    assert ex.timed_out and ex.returncode is None and not ex.cancelled
    assert time.monotonic() - t0 < 10
    if not isolate:  # pids inside a pid namespace are not ours to check
        pid = int((p.cwd / "bg.pid").read_text())
        wait_for(lambda: not alive(pid), 5)  # SIGKILL was sent to the group; delivery is asynchronous


def test_background_leftovers_killed_at_normal_exit(tmp_path):
    p = proc(tmp_path, "sleep 60 & echo $! > bg.pid; exit 0", False)
    p.start()
    assert p.wait(30).returncode == 0
    pid = int((p.cwd / "bg.pid").read_text())
    wait_for(lambda: not alive(pid), 5)


@pytest.mark.skipif(not isolation_supported(), reason="mount/pid namespaces unavailable")
def test_isolated_escapees_die_and_paths_are_masked(tmp_path):
    other = tmp_path / "run" / "executions" / "e0" / "workspace"
    other.mkdir(parents=True)
    (other / "secret.txt").write_text("other execution's work")
    hidden = tmp_path / "hidden_tests"
    hidden.mkdir()
    (hidden / "test_x.py").write_text("secret test")
    marker = tmp_path / "escapee-alive"
    p = SandboxProcess(["bash", "-c",
                        f"setsid bash -c 'sleep 2; touch {marker}' & "
                        f"ls {other} > seen_other.txt 2>&1; ls {hidden} > seen_hidden.txt 2>&1; "
                        "ls /proc | grep -c '^[0-9]' > nprocs.txt; exit 0"],
                       cwd=tmp_path / "run" / "executions" / "e1" / "workspace", env={"PATH": os.environ["PATH"]},
                       log_path=tmp_path / "run" / "executions" / "e1" / "harness.log", isolate=True,
                       own_dir=tmp_path / "run" / "executions" / "e1", masks=[tmp_path / "run", hidden])
    p.cwd.mkdir(parents=True)
    p.start()
    assert p.wait(30).returncode == 0
    ws = p.cwd
    assert "No such file" in (ws / "seen_other.txt").read_text()   # the run directory is masked
    assert (ws / "seen_hidden.txt").read_text() == ""               # a hidden directory looks empty
    assert int((ws / "nprocs.txt").read_text()) < 10                # its own /proc: a handful of processes
    time.sleep(2.5)
    assert not marker.exists()                                  # the setsid escapee died with the namespace
    assert (other / "secret.txt").exists() and (hidden / "test_x.py").exists()  # masks change nothing outside


@pytest.mark.skipif(not isolation_supported(), reason="mount/pid namespaces unavailable")
def test_isolated_private_tmp(tmp_path):
    name = f"/tmp/gyre-private-{os.getpid()}-{time.monotonic_ns()}"
    p = proc(tmp_path, f"touch {name} && ls {name} > ok.txt", True, private_tmp="16m")
    p.start()
    assert p.wait(30).returncode == 0
    assert (p.cwd / "ok.txt").read_text().strip() == name and not Path(name).exists()


@pytest.mark.parametrize("isolate", MODES)
def test_cancel_from_another_thread(tmp_path, isolate):
    p = proc(tmp_path, "echo ready; sleep 60", isolate, kill_grace_s=1)
    p.start()
    flag = threading.Event()
    threading.Timer(0.5, flag.set).start()
    ex = p.wait(60, cancel=flag.is_set)
    assert ex.cancelled and not ex.timed_out and ex.returncode is None and ex.duration_s < 10


def test_command_not_found(tmp_path):
    p = SandboxProcess(["/no/such/harness"], cwd=tmp_path, env={"PATH": "/usr/bin"}, log_path=tmp_path / "log")
    with pytest.raises(FileNotFoundError, match="not found"):
        p.start()


def test_python_child_sees_only_given_env(tmp_path):
    p = SandboxProcess([sys.executable, "-c", "import os,json; print(json.dumps(sorted(os.environ)))"], cwd=tmp_path,
                       env={"PATH": os.environ["PATH"], "ONLY": "1"}, log_path=tmp_path / "log")
    p.start()
    assert p.wait(30).returncode == 0
    keys = p.log_path.read_text().strip().splitlines()[-1]
    assert "ONLY" in keys and "HOME" not in keys


def test_private_tmp_is_skipped_when_the_harness_lives_under_tmp():
    import sys
    from pathlib import Path

    from gyre.harness.base import _needs_shared_tmp

    assert _needs_shared_tmp(["/tmp/some-clone/.venv/bin/python", "-m", "x"]) is True
    under_tmp = Path("/tmp").resolve() in Path(sys.prefix).resolve().parents
    assert _needs_shared_tmp(["/usr/bin/env"]) is (under_tmp or Path("/tmp").resolve() in Path(__file__).resolve().parents)
