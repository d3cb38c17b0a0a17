"""A launcher for tests/sandbox/test_launcher_killed.py: makes one sandbox per backend named on the
command line, starts ``sleep 300`` in each, prints one JSON line of what to look for, then waits
to be killed."""

import json
import sys
import tempfile
import time
from pathlib import Path

from gyre.sandbox import Environment, Limits, SandboxSpec, make_backend
from gyre.sandbox.podman import TEST_IMAGE

label, names = sys.argv[1], sys.argv[2:]
report = {}
for name in names:
    backend = make_backend(name)
    own = Path(tempfile.mkdtemp(prefix="gyre-killed-"))
    env = Environment("image", TEST_IMAGE) if name == "podman" else Environment()
    sb = backend.create(SandboxSpec(name=f"gyre-{label}-h-{name}", run_label=label, environment=env, writable=(own,),
                                    limits=Limits(pids=64, memory_bytes=256 << 20)))
    proc = sb.start(["sleep", "300"], env={"PATH": "/usr/bin:/bin"}, cwd=own, log_path=own / "log")
    while not sb.alive():
        time.sleep(0.05)
    report[name] = {"host_pid": proc.pid, "state_dir": str(backend.state_dir),
                    "cgroup": [str(d) for d in getattr(sb, "cgroup", None).dirs] if getattr(sb, "cgroup", None) else []}
print(json.dumps(report), flush=True)
time.sleep(600)
