"""SIGKILL of the launcher leaves no sandbox behind: the bwrap sandbox's processes die with it (the
kernel, --die-with-parent), and a reaper removes its cgroup, the podman container (which runs
detached) and the backends' state directories within seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre.sandbox.bwrap import bwrap_unavailable_reason
from gyre.sandbox.podman import TEST_IMAGE, PodmanBackend
from gyre.sandbox.spec import Environment
from tests.processes import alive

ROOT = Path(__file__).resolve().parents[2]


def test_sigkill_of_the_launcher_leaves_nothing(tmp_path):
    names = []
    if bwrap_unavailable_reason() is None:
        names.append("bwrap")
    podman = PodmanBackend()
    if podman.unavailable_reason(Environment("image", TEST_IMAGE)) is None:
        names.append("podman")
    if not names:
        pytest.skip("neither bwrap nor podman runs here (bash tools/setup_sandbox.sh)")
    label = f"killed{os.getpid()}"
    child = subprocess.Popen([sys.executable, str(ROOT / "tests" / "sandbox" / "launcher_child.py"), label, *names],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        report = json.loads(child.stdout.readline())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert sorted(report) == sorted(names)

    def leftovers() -> list[str]:
        out = []
        for name, r in report.items():
            if alive(r["host_pid"]):
                out.append(f"{name} host process {r['host_pid']}")
            out += [f"{name} cgroup {d}" for d in r["cgroup"] if Path(d).exists()]
            if Path(r["state_dir"]).exists():
                out.append(f"{name} state dir {r['state_dir']}")
        if "podman" in report:
            ids = podman.cli(["ps", "-aq", "--filter", f"label=gyre.run={label}"]).stdout.split()
            out += [f"container {i}" for i in ids]
        return out

    deadline = time.monotonic() + 30
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers() == []
