"""A launcher the fleet tests SIGKILL: joins the cluster at argv[1], runs argv[3] executions of a
harness that sleeps, with run directory argv[2]; prints one line once every harness runs.

Usage: python tests/fleet/launcher_child.py ADDRESS RUN_DIR N
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from pathlib import Path

import ray

from gyre.fleet.launcher import FleetLauncher
from gyre.harness import CommandHarness, ProxyEndpoint
from gyre.harness.roles import RoleRules
from gyre.tasks import TaskSpec, WorkspaceSpec


def main() -> None:
    address, run_dir, n = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    ray.init(address=address, log_to_driver=False)
    task_dir = run_dir.parent / "task"
    task_dir.mkdir(parents=True, exist_ok=True)
    task = TaskSpec("sleepy", "sleep", WorkspaceSpec(files=(("a.txt", "a"),)), {"type": "executable",
                    "command": ["true"], "scoring": "exit_code"}, task_dir=task_dir)
    factory = functools.partial(CommandHarness, [sys.executable, "-c", "import time; time.sleep(600)"],
                                isolation="off")
    launcher = FleetLauncher(factory, name="command", roles=RoleRules("command"), run_dir=run_dir)
    launcher.pool.wait_for_slots(n, timeout_s=120)
    for i in range(n):
        threading.Thread(target=launcher.run, args=(task, run_dir, f"e{i}", ProxyEndpoint("http://127.0.0.1:9", "k")),
                         daemon=True).start()
    while any(not (run_dir / "executions" / f"e{i}").exists() for i in range(n)) or \
            len(launcher.pool.counts()) and launcher.pool.counts()["busy"] < n:
        time.sleep(0.05)
    print(json.dumps({"busy": launcher.pool.counts()["busy"]}), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
