"""``bench/scale.py --main-job``: rank 0's controller, scheduler and harness supervision at scale.

The main job (``torchrun ... pretrain_gyre.py`` on the embedded CPU default, 3 cells) runs with
hundreds of executions live at once. Each execution is :class:`MinimalHarness`: a bash process
that makes ``GYRE_SCALE_CALLS`` Chat Completions calls with curl (8 new tokens each, a short pause
between them), writes how many were answered to ``calls_answered.txt`` and a random 0/1 to
``answer.txt``, which the task's check scores (exit code), so groups have reward variance and
every step trains. The engines are the cells' embedded engines on the tiny model; the calls are
short, so the engine work is small next to rank 0's own.

While the job runs this module samples rank 0 (the torchrun child with ``RANK=0``) from ``/proc``
every half second: threads, file descriptors, RSS, and the executions open at the proxy
(``GET /gyre/executions``). At the end it reads the run directory: steps completed
(``summary.json``), executions and their statuses (``executions.jsonl``), model calls the harnesses
saw answered against the records on disk (``records_lost``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import free_port
from gyre.harness.command import CommandHarness

ROOT = Path(__file__).resolve().parents[1]

HARNESS_SCRIPT = r"""set -u
ok=0
for i in $(seq 1 "$GYRE_SCALE_CALLS"); do
  body=$(printf '{"model":"%s","max_tokens":8,"messages":[{"role":"user","content":"%s Step %d."}]}' \
         "$GYRE_MODEL" "$GYRE_INSTRUCTION" "$i")
  if curl -sf -m 600 -o /dev/null "$OPENAI_BASE_URL/chat/completions" -H "Authorization: Bearer $OPENAI_API_KEY" \
       -H "content-type: application/json" -d "$body"; then ok=$((ok + 1)); fi
  sleep "$((GYRE_SCALE_PAUSE_S + RANDOM % 3)).$((RANDOM % 10))"
done
echo "$ok" > calls_answered.txt
echo $((RANDOM % 2)) > answer.txt
"""


class MinimalHarness(CommandHarness):
    """A bash + curl harness making ``GYRE_SCALE_CALLS`` calls (module docstring)."""

    name = "scale-minimal"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(["bash", "-c", HARNESS_SCRIPT], **kwargs)

    def build_command(self, ctx):
        spec = super().build_command(ctx)
        spec.env["GYRE_SCALE_CALLS"] = os.environ.get("GYRE_SCALE_CALLS", "3")
        spec.env["GYRE_SCALE_PAUSE_S"] = os.environ.get("GYRE_SCALE_PAUSE_S", "1")
        return spec


def write_tasks(root: Path, n_tasks: int) -> Path:
    """A task set of ``n_tasks`` tasks scored by ``answer.txt`` (exit code)."""
    tasks = ["tasks:"]
    for i in range(n_tasks):
        tasks += [f"  - id: scale-{i:03d}",
                  f"    instruction: \"Answer question {i} with 0 or 1.\"",
                  "    evaluator:",
                  "      type: executable",
                  "      command: [\"bash\", \"-c\", \"test \\\"$(cat answer.txt 2>/dev/null)\\\" = 1\"]",
                  "      scoring: exit_code",
                  "      timeout_s: 60"]
    root.mkdir(parents=True, exist_ok=True)
    (root / "tasks.yaml").write_text("\n".join(tasks) + "\n")
    return root


def _rank0_pid(launcher: int) -> int | None:
    """The launcher's descendant whose environment has ``RANK=0`` (the main job's rank 0)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != launcher:
                continue
            env = (d / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if b"RANK=0" in env:
            return int(d.name)
    return None


def _proc(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    f = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    f = {k: (v.split() or ["0"])[0] for k, v in f.items()}
    return {"threads": int(f["Threads"]), "rss_bytes": int(f["VmRSS"]) * 1024,
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def _open_executions(url: str) -> int:
    with urllib.request.urlopen(url + "/gyre/executions", timeout=5) as r:
        body = json.loads(r.read())
    rows = body.get("executions", body) if isinstance(body, dict) else body
    return sum(1 for e in rows if not e.get("closed"))


def run_main_job(*, executions: int, steps: int, calls: int, pause_s: int, n_samples: int, cells: int, work: Path,
                 timeout_s: float) -> dict[str, Any]:
    """Run the main job with ``executions`` live at once; return its figures (module docstring)."""
    groups = max(1, -(-executions // n_samples))
    per_cell = -(-executions // max(1, cells - 1))  # every cell but one serving keeps them all live
    tasks = write_tasks(work / "tasks", max(8, groups))
    run_dir, port = work / "run", free_port()
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cells), "pretrain_gyre.py",
            "--config", "examples/cpu_tiny.yaml", "--num-cells", str(cells), "--tasks", str(tasks),
            "--harness", "scale_main_job:MinimalHarness", "--harness-isolation", "off",
            "--n-samples-per-prompt", str(n_samples), "--global-batch-groups", str(groups),
            "--rollout-concurrency-per-cell", str(per_cell), "--rollout-max-new-tokens", "8",
            "--train-steps", str(steps), "--save-interval", "0", "--execution-timeout-s", str(int(timeout_s)),
            "--proxy-port", str(port), "--run-dir", str(run_dir)]
    env = dict(os.environ, GYRE_SCALE_CALLS=str(calls), GYRE_SCALE_PAUSE_S=str(pause_s), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]))
    log = open(work / "main_job.log", "wb")
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    samples: list[dict[str, int]] = []
    rank0 = None
    try:
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout_s:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(60)
                break
            time.sleep(0.25)
            rank0 = rank0 or _rank0_pid(proc.pid)
            if rank0 is None:
                continue
            try:
                s = _proc(rank0)
                s["open_executions"] = _open_executions(f"http://127.0.0.1:{port}")
            except (OSError, ValueError, KeyError):
                continue
            samples.append(s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    wall = time.monotonic() - t0
    return summarise(run_dir, samples, proc.returncode, wall, executions)


def summarise(run_dir: Path, samples: list[dict[str, int]], rc: int | None, wall: float,
              executions: int) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    rows = [json.loads(line) for line in (run_dir / "executions.jsonl").read_text().splitlines() if line.strip()] \
        if (run_dir / "executions.jsonl").exists() else []
    closed = [r for r in rows if r.get("event") == "closed"]
    launched = sorted(r["t"] for r in rows if r.get("event") == "launched")
    statuses: dict[str, int] = {}
    for r in closed:
        statuses[str(r.get("status"))] = statuses.get(str(r.get("status")), 0) + 1
    answered = 0
    for f in (run_dir / "executions").glob("*/workspace/calls_answered.txt"):
        answered += int(f.read_text().strip() or 0)
    records = 0
    for f in (run_dir / "records").glob("*.jsonl"):
        records += sum(1 for line in f.read_text().splitlines() if '"call_index"' in line)
    peak = lambda k: max((s[k] for s in samples), default=0)  # noqa: E731
    return {"main_job_rc": rc, "wall_s": round(wall, 1), "executions_target": executions,
            "steps_completed": summary.get("steps"), "executions_trained": summary.get("executions_trained"),
            "tokens_trained": summary.get("tokens_trained"), "time_per_phase_s": summary.get("time_per_phase_s"),
            "executions_closed": len(closed), "statuses": statuses,
            "calls_counted_at_close": sum(int(r.get("calls") or 0) for r in closed),
            "max_live_executions": peak("open_executions"),
            "launch_s_first_n": round(launched[min(executions, len(launched)) - 1] - launched[0], 1) if launched else None,
            "calls_answered": answered, "records": records, "records_lost": answered - records,
            "rank0_threads_max": peak("threads"), "rank0_fds_max": peak("fds"),
            "rank0_rss_mb_max": round(peak("rss_bytes") / 2**20, 1), "samples": len(samples)}


if __name__ == "__main__":  # a quick manual run
    import tempfile
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 24
    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(run_main_job(executions=n, steps=2, calls=3, pause_s=1, n_samples=8, cells=3, work=Path(d),
                                      timeout_s=1800), indent=1))
