"""The Slurm tier: the sbatch scripts of examples/slurm submitted to a real Slurm cluster.

``bash tools/test_slurm.sh`` starts the local two-node cluster of ``tools/setup_slurm.sh`` (nodes n1
and n2 on this machine) and runs these tests against it.  Anywhere without a cluster that answers
(no ``sbatch``, no ``SLURM_CONF`` / ``/etc/slurm/slurm.conf``, or fewer than two usable nodes) every
test here is skipped with one reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def cluster_problem() -> str | None:
    """Why no two-node Slurm cluster is usable from here, or ``None``."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "sbatch/sinfo are not installed"
    conf = os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf"
    if not Path(conf).is_file():
        return f"no Slurm configuration ({conf})"
    try:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 20 s"
    usable = {line.split()[0] for line in r.stdout.splitlines()
              if len(line.split()) == 2 and line.split()[1] in ("idle", "mix", "alloc")}
    if r.returncode != 0 or len(usable) < 2:
        return f"the cluster has {len(usable)} usable node(s): {(r.stderr or r.stdout).strip()[:200]}"
    return None


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    mine = [item for item in items if here in item.path.parents]
    if not mine:
        return
    problem = cluster_problem()
    if problem is None:
        return
    skip = pytest.mark.skip(reason=f"the Slurm tier needs a running two-node cluster (bash tools/test_slurm.sh "
                                   f"starts a local one): {problem}")
    for item in mine:
        item.add_marker(skip)
