"""The execution backend conformance suite: every backend (local, bwrap, podman, docker) runs a
command with its environment and working directory, streams its log, stops it at its limit or on
cancel with everything it started, keeps the workspace after a stop, copies files in and out, reaches
the proxy at its loopback port, hides the masked paths, and leaves nothing behind after teardown."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gyre.sandbox import BackendUnavailable, ProxyTarget
from tests.sandbox.conftest import spec_for

PATH = {"PATH": "/usr/local/bin:/usr/bin:/bin"}


def test_exit_status_environment_working_directory_and_log(backend, layout):
    with backend.create(spec_for(backend, layout)) as sb:
        ex = sb.run(["sh", "-c", 'pwd; echo "FOO=$FOO"; echo to-stderr >&2; echo data > out.txt; exit 3'],
                    env={**PATH, "FOO": "bar baz"}, cwd=layout.workspace, log_path=layout.own / "cmd.log",
                    timeout_s=60)
    assert (ex.returncode, ex.timed_out, ex.cancelled, ex.isolation_failed) == (3, False, False, False)
    log = (layout.own / "cmd.log").read_text()
    assert str(layout.workspace) in log and "FOO=bar baz" in log and "to-stderr" in log
    assert (layout.workspace / "out.txt").read_text() == "data\n"


def test_separate_stderr_file(backend, layout):
    with backend.create(spec_for(backend, layout)) as sb:
        ex = sb.run(["sh", "-c", "echo out; echo err >&2"], env=PATH, cwd=layout.workspace,
                    log_path=layout.own / "out.log", stderr_path=layout.own / "err.log", timeout_s=60)
    assert ex.returncode == 0
    assert (layout.own / "out.log").read_text() == "out\n"
    assert (layout.own / "err.log").read_text() == "err\n"


def test_time_limit_stops_the_command_and_what_it_started(backend, layout):
    with backend.create(spec_for(backend, layout)) as sb:
        t0 = time.monotonic()
        ex = sb.run(["sh", "-c", "trap '' TERM; (trap '' TERM; sleep 300) & echo ready; sleep 300"], env=PATH,
                    cwd=layout.workspace, log_path=layout.own / "cmd.log", timeout_s=2.0, kill_grace_s=0.5)
        assert ex.timed_out and ex.returncode is None
        assert time.monotonic() - t0 < 30
        deadline = time.monotonic() + 15
        while sb.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not sb.alive()


def test_cancel_from_another_thread(backend, layout):
    flag = threading.Event()
    with backend.create(spec_for(backend, layout)) as sb:
        proc = sb.start(["sleep", "300"], env=PATH, cwd=layout.workspace, log_path=layout.own / "cmd.log",
                        kill_grace_s=1.0)
        threading.Timer(1.0, flag.set).start()
        ex = proc.wait(120, cancel=flag.is_set)
    assert ex.cancelled and not ex.timed_out and ex.duration_s < 30


def test_stop_ends_every_process_and_keeps_the_workspace(backend, layout):
    with backend.create(spec_for(backend, layout)) as sb:
        proc = sb.start(["sh", "-c", "echo kept > kept.txt; sleep 300 & sleep 300"], env=PATH, cwd=layout.workspace,
                        log_path=layout.own / "cmd.log")
        deadline = time.monotonic() + 30
        while not (layout.workspace / "kept.txt").exists():
            assert time.monotonic() < deadline, (layout.own / "cmd.log").read_text()
            time.sleep(0.05)
        assert sb.alive()
        sb.stop()
        ex = proc.wait(30)
        assert ex.returncode != 0
        assert not sb.alive()
        assert (layout.workspace / "kept.txt").read_text() == "kept\n"


def test_copy_in_and_out(backend, layout, tmp_path):
    src = tmp_path / "given"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a.txt").write_text("alpha\n")
    with backend.create(spec_for(backend, layout)) as sb:
        sb.copy_in(src, str(layout.workspace / "given"))
        ex = sb.run(["sh", "-c", "cat given/sub/a.txt > made.txt; echo beta >> made.txt"], env=PATH,
                    cwd=layout.workspace, log_path=layout.own / "cmd.log", timeout_s=60)
        assert ex.returncode == 0, (layout.own / "cmd.log").read_text()
        sb.copy_out(str(layout.workspace / "made.txt"), tmp_path / "back" / "made.txt")
    assert (tmp_path / "back" / "made.txt").read_text() == "alpha\nbeta\n"


def test_the_proxy_answers_at_its_loopback_port(backend, layout, http_server):
    spec = spec_for(backend, layout, proxy=ProxyTarget("127.0.0.1", http_server))
    code = (f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{http_server}/', timeout=20)"
            ".read().decode())")
    with backend.create(spec) as sb:
        ex = sb.run([sys.executable, "-c", code], env=PATH, cwd=layout.workspace, log_path=layout.own / "cmd.log",
                    timeout_s=60)
    log = (layout.own / "cmd.log").read_text()
    assert ex.returncode == 0, log
    assert "hello from the proxy" in log


def test_masked_paths_are_hidden(backend, layout):
    if backend.name == "local" and not backend.isolated:
        pytest.skip("local backend without isolation masks nothing (unshare unavailable here)")
    secret = layout.other / "workspace" / "secret.txt"
    with backend.create(spec_for(backend, layout)) as sb:
        ex = sb.run(["sh", "-c", f'cat "{secret}"; ls "{layout.run}/checkpoints"; ls "{layout.workspace}" && echo own-ok'],
                    env=PATH, cwd=layout.workspace, log_path=layout.own / "cmd.log", timeout_s=60)
    log = (layout.own / "cmd.log").read_text()
    assert "other execution's file" not in log and "model.bin" not in log
    assert "own-ok" in log and ex.returncode == 0


def test_teardown_is_idempotent_and_leaves_nothing(backend, layout):
    sb = backend.create(spec_for(backend, layout))
    sb.start(["sleep", "300"], env=PATH, cwd=layout.workspace, log_path=layout.own / "cmd.log")
    deadline = time.monotonic() + 30
    while not sb.alive():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sb.teardown()
    sb.teardown()
    assert not sb.alive()
    with pytest.raises(BackendUnavailable):
        sb.start(["true"], env=PATH, cwd=layout.workspace, log_path=layout.own / "cmd.log")
    if backend.name in ("podman", "docker"):
        names = backend.cli(["ps", "-a", "--format", "{{.Names}}"]).stdout.split()
        assert sb.spec.name not in names
        marker = f"\0-n\0{sb.spec.name}\0".encode()  # no conmon of its exec sessions waits on
        monitors = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if marker in (proc / "cmdline").read_bytes():
                    monitors.append(proc.name)
            except OSError:
                pass
        assert monitors == []
    if getattr(sb, "cgroup", None) is not None:
        assert all(not d.exists() for d in sb.cgroup.dirs)


def test_sweep_removes_what_a_crashed_launcher_left(backend, layout):
    if backend.name == "local":
        pytest.skip("local leaves nothing to sweep: its process groups die with the launcher (gyre.process_guard)")
    label = f"sweep{os.getpid()}"
    sb = backend.create(spec_for(backend, layout, label=label))
    proc = sb.start(["sleep", "300"], env=PATH, cwd=layout.workspace, log_path=layout.own / "cmd.log")
    deadline = time.monotonic() + 30
    while not sb.alive():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # the launcher "crashes": nothing tears the sandbox down, a new launcher sweeps by the run's label
    # (just started: its process may join its cgroup only while the sweep runs, and is killed all the same)
    first = backend.sweep(label)
    assert not proc.wait(30).timed_out  # the sweep ended it, not the wait's own timeout
    assert not sb.alive()
    # a cgroup whose killed process was still this test's unreaped child (a dead launcher's children
    # are reaped by init) is removed by the next sweep; then nothing is left
    assert first + backend.sweep(label) == 1
    assert backend.sweep(label) == 0
    if getattr(sb, "cgroup", None) is not None:
        assert all(not d.exists() for d in sb.cgroup.dirs)
    if backend.name in ("podman", "docker"):
        out = subprocess.run([backend.exe, "ps", "-aq", "--filter", f"label=gyre.run={label}"], capture_output=True,
                             text=True, env=backend.client_env()).stdout
        assert out.strip() == ""
