"""SIGKILL of the launcher (the Ray driver) leaves nothing on any node: Ray ends the driver's slot
actors, and each slot's guard kills what the slot started and removes its directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fleet.test_fleet_pipeline import fleet_processes
from tests.processes import wait_until

ROOT = Path(__file__).resolve().parents[2]
ray = pytest.importorskip("ray", reason="ray is not installed")
pytestmark = pytest.mark.slow  # a three-node Ray cluster and a main job


def processes_named(prefix: str) -> list[int]:
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cmdline.read_bytes().replace(b"\0", b" ").startswith(prefix.encode()):
                out.append(int(cmdline.parent.name))
        except OSError:
            pass
    return out


def guards() -> list[int]:
    out = []
    for p in processes_named(sys.executable):
        try:
            if b"gyre.fleet.guard" in Path(f"/proc/{p}/cmdline").read_bytes():
                out.append(p)
        except OSError:
            pass
    return out


def test_sigkill_of_the_launcher_leaves_no_process_on_any_node(cluster, tmp_path):
    fleet_dir = Path(os.environ["GYRE_FLEET_DIR"])
    child = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fleet" / "launcher_child.py"), cluster.address,
                              str(tmp_path / "run"), "6"], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        report = json.loads(child.stdout.readline())
        assert report == {"busy": 6}
        # every slot runs a harness: six marked processes, six slot actors, six guards, six slot directories
        # (each count is re-read until it holds: one /proc listing can miss a pid on a busy machine)
        assert wait_until(lambda: len(fleet_processes()) == 6, timeout=60), fleet_processes()
        assert wait_until(lambda: len(processes_named("ray::SlotActor")) == 6, timeout=30), \
            processes_named("ray::SlotActor")
        assert wait_until(lambda: len(list(fleet_dir.glob("*/slot-*"))) == 6 and len(guards()) == 6, timeout=30), \
            (list(fleet_dir.glob("*/slot-*")), guards())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)

    def leftovers() -> list[str]:
        return ([f"harness {p}" for p in fleet_processes()] + [f"actor {p}" for p in processes_named("ray::SlotActor")]
                + [f"guard {p}" for p in guards()] + [f"dir {d}" for d in fleet_dir.glob("*/slot-*")])

    assert wait_until(lambda: not leftovers(), timeout=60), [x[-40:] for x in leftovers()]
    assert len(cluster.list_all_nodes()) == 3 and all(n.remaining_processes_alive() for n in cluster.list_all_nodes())  # the nodes live on
