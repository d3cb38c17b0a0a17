"""A slot's guard kills the processes carrying its token once the slot's process is gone, and removes
its directory; processes without the token are left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gyre.fleet.guard import marked_processes
from tests.processes import alive, wait_until

ROOT = Path(__file__).resolve().parents[2]
SLOT = """
import os, subprocess, sys, time
from gyre.fleet.guard import TOKEN_VAR, start_guard
os.environ[TOKEN_VAR] = sys.argv[1]
start_guard(sys.argv[1], remove=(sys.argv[2],))
kids = [subprocess.Popen(["sleep", "600"], start_new_session=True) for _ in range(2)]
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(600)
"""


def test_the_guard_kills_marked_processes_and_removes_the_directory(tmp_path):
    token = f"test{os.getpid()}"
    slot_dir = tmp_path / "slot"
    slot_dir.mkdir()
    bystander = subprocess.Popen(["sleep", "600"])
    slot = subprocess.Popen([sys.executable, "-c", SLOT, token, str(slot_dir)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        kids = [int(p) for p in slot.stdout.readline().split()]
        # its children inherit the token (one listing of /proc can miss a pid while processes come
        # and go on a busy machine, so the scan is repeated)
        assert wait_until(lambda: sorted(marked_processes(token)) == sorted(kids), timeout=10), marked_processes(token)
        slot.kill()
        slot.wait()
        assert wait_until(lambda: not any(alive(p) for p in kids) and not slot_dir.exists(), timeout=20)
        assert marked_processes(token) == [] and alive(bystander.pid)
    finally:
        bystander.kill()
        bystander.wait()
        for p in marked_processes(token):
            os.kill(p, 9)
