"""Process safety: ranks die with their launcher, children die with their rank, one job per run dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gyre.process_guard import RunDirectoryLock, RunDirectoryLockedError
from tests.processes import alive, descendants, wait_until

ROOT = Path(__file__).resolve().parents[1]


# A "rank": starts a tracked child process group (like a harness), reports both pids, then blocks.
RANK = textwrap.dedent("""
    import os, subprocess, sys, time
    sys.path.insert(0, {root!r})
    from gyre.process_guard import die_with_parent, exit_on_termination, track_process_group
    if {with_parent}:
        die_with_parent()
    exit_on_termination()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    track_process_group(child.pid)
    print(os.getpid(), child.pid, flush=True)
    if {stuck}:  # the main thread stuck where no Python signal handler runs (like a collective)
        import signal
        signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM}})
        time.sleep(600)
    while True:
        time.sleep(0.05)
""")


def start_rank(with_parent: bool) -> tuple[subprocess.Popen, int, int]:
    p = subprocess.Popen([sys.executable, "-c", RANK.format(root=str(ROOT), with_parent=with_parent, stuck=False)],
                         stdout=subprocess.PIPE, text=True)
    rank, child = map(int, p.stdout.readline().split())
    return p, rank, child


def test_sigterm_kills_the_tracked_groups_and_ends_the_rank():
    p, rank, child = start_rank(with_parent=False)
    assert alive(child)
    os.kill(rank, signal.SIGTERM)
    assert p.wait(timeout=20) == 128 + signal.SIGTERM
    assert wait_until(lambda: not alive(child)), "the harness-like child outlived its rank"


@pytest.mark.parametrize("stuck", [False, True], ids=["python", "stuck-in-native-code"])
def test_a_rank_dies_with_its_launcher_even_after_sigkill(stuck):
    # launcher -> rank (die_with_parent) -> child group; SIGKILL the launcher
    rank_code = RANK.format(root=str(ROOT), with_parent=True, stuck=stuck)
    launcher = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import subprocess, sys
            p = subprocess.Popen([sys.executable, "-c", {rank_code!r}],
                                 stdout=subprocess.PIPE, text=True)
            print(p.stdout.readline().strip(), flush=True)
            p.wait()
        """)], stdout=subprocess.PIPE, text=True)
    rank, child = map(int, launcher.stdout.readline().split())
    assert alive(rank) and alive(child)
    launcher.kill()
    launcher.wait()
    assert wait_until(lambda: not alive(rank)), "the rank outlived its SIGKILLed launcher"
    assert wait_until(lambda: not alive(child)), "the rank's child outlived it"


def test_one_job_per_run_directory(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from gyre.process_guard import RunDirectoryLock
        lock = RunDirectoryLock({str(tmp_path / "run")!r}).acquire()
        print("held", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = RunDirectoryLock(tmp_path / "run")
        assert not lock.is_free()
        with pytest.raises(RunDirectoryLockedError, match="is in use by another job"):
            lock.acquire()
    finally:
        holder.kill()
        holder.wait()
    assert lock.is_free()  # released when its holder died, however it died
    lock.acquire().release()


def test_ranks_checking_the_run_directory_at_once_do_not_see_each_other(tmp_path):
    """Every rank checks the lock before the job starts; one rank's check must not make another's
    fail (a check that took the lock itself did, under load)."""
    import fcntl
    import os

    lock = RunDirectoryLock(tmp_path / "run")
    lock.acquire().release()  # the lock file exists, nobody holds it
    fd = os.open(lock.path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # another rank in the middle of its check
        assert lock.is_free() and RunDirectoryLock(tmp_path / "run").is_free()
    finally:
        os.close(fd)
    assert RunDirectoryLock(tmp_path / "fresh").is_free()  # no lock file yet
    assert not (tmp_path / "fresh").exists()  # checking creates nothing


def test_a_failing_job_exits_at_once_with_its_children(tmp_path):
    """pretrain_gyre.main on a rank whose job raises: a traceback, exit 1 at once (not after its
    worker threads or harnesses), and the process groups it started die with it."""
    script = textwrap.dedent(f"""
        import subprocess, sys, threading, time
        sys.path.insert(0, {str(ROOT)!r})
        import pretrain_gyre
        import gyre.runtime.pretrain as pretrain
        from gyre.process_guard import track_process_group

        def failing_job(args):
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
            track_process_group(child.pid)
            print(child.pid, flush=True)
            threading.Thread(target=time.sleep, args=(120,)).start()  # a non-daemon worker thread
            raise RuntimeError("cell 1 failed to carry out switch_to_training: boom")

        pretrain.pretrain = failing_job
        sys.exit(pretrain_gyre.main(["--config", {str(ROOT / "examples" / "cpu_tiny.yaml")!r},
                                     "--run-dir", {str(tmp_path / "run")!r}, "--no-progress"]))
    """)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "WORLD_SIZE": "3"})
    assert p.returncode == 1 and time.monotonic() - t0 < 60
    assert "RuntimeError: cell 1 failed to carry out switch_to_training: boom" in p.stderr
    child = int(p.stdout.split()[0])
    assert wait_until(lambda: not alive(child))


def test_a_child_being_started_when_the_rank_ends_dies_with_it():
    """SIGTERM reaches the rank while another thread is starting a harness (forked, not yet
    registered: on a loaded machine the start takes a while); the child must not outlive it."""
    script = textwrap.dedent(f"""
        import os, sys, threading, time
        sys.path.insert(0, {str(ROOT)!r})
        from gyre.process_guard import exit_on_termination, popen_process_group
        exit_on_termination()
        slow_start = lambda: time.sleep(2.0)  # in the child, between fork and exec
        threading.Thread(target=popen_process_group, daemon=True,
                         args=([sys.executable, "-c", "import time; time.sleep(120)"],),
                         kwargs=dict(preexec_fn=slow_start)).start()
        time.sleep(0.5)
        print(os.getpid(), flush=True)
        while True:
            time.sleep(0.05)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        rank = int(p.stdout.readline())
        (child,) = descendants(rank)  # forked, still starting
        os.kill(rank, signal.SIGTERM)
        assert p.wait(timeout=20) == 128 + signal.SIGTERM
        assert wait_until(lambda: not alive(child)), "a child started as its rank ended outlived it"
    finally:
        p.kill()
        p.wait()
        for pid in descendants(p.pid):
            os.kill(pid, signal.SIGKILL)
