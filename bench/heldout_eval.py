"""Held-out evaluation of a model directory through the main job's execution path.

One embedded engine (:class:`gyre.rollout.embedded.server.EngineServer`) serves ``model_dir``; a
:class:`gyre.proxy.server.ProxyServer` with the main job's proxy settings (default sampling
temperature = the evaluation's) fronts it; the run's harness (:func:`gyre.harness.harness_from_args`
of the same flags the main job parses, e.g. the reference agent as its own process) runs each task
attempt, and :func:`gyre.runtime.pipeline.run_execution` assesses it with the task's evaluator.
Nothing is trained.  Temperature 0 is greedy decoding.

    python bench/heldout_eval.py --model-dir DIR --tasks heldout.tasks.jsonl --temperature 0.7 \\
        --attempts 1 --out runs/eval -- --config examples/cpu_smollm2_learning.yaml

prints one JSON object: ``passed``, ``n``, ``pass_rate``, ``temperature`` and ``per_task``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

__all__ = ["evaluate", "main"]


def _proxy(args: argparse.Namespace, model_dir: str, out: Path, temperature: float):
    """The main job's proxy settings (:meth:`ProxyConfig.from_args`) with ``temperature`` as the
    default sampling temperature (0: greedy, which the main job's flags do not allow)."""
    from gyre.embedded_model import load_tokenizer
    from gyre.proxy.config import ProxyConfig
    from gyre.proxy.render import ChatRenderer
    from gyre.proxy.server import ProxyServer
    from gyre.trajectory.store import TrajectoryStore

    config = ProxyConfig.from_args(args, model_dir)
    config = dataclasses.replace(config, default_sampling={**config.default_sampling, "temperature": temperature})
    return ProxyServer(ChatRenderer(load_tokenizer(model_dir)),
                       store=TrajectoryStore(out / "records", fsync_every=0, max_open=1024), config=config)


def evaluate(model_dir: str, tasks_path: str, *, temperature: float, attempts: int, out: Path,
             job_flags: Sequence[str] = (), concurrency: int = 4, seed: int = 0) -> dict[str, Any]:
    """Run every task of ``tasks_path`` ``attempts`` times against ``model_dir``; returns
    ``{"passed", "n", "pass_rate", "not_assessed", "temperature", "wall_s", "per_task": {id: [reward, ...]}}``.

    ``job_flags`` are main-job flags (e.g. ``--config FILE``) that set the harness and the proxy's
    limits.  An attempt that was not assessed counts as a failure and in ``not_assessed`` (by
    status: ``excluded``, the evaluator could not assess it; ``placeholder``, the harness closed
    without assessable work, e.g. its workspace could not be set up).  Every attempt's final reply
    is kept in ``out/replies.jsonl``.

    Raises:
        FileExistsError: ``out`` exists and is not empty (execution ids repeat between evaluations).
        ValueError: the task file has bad tasks or none.
    """
    from gyre.arguments import parse_args
    from gyre.evaluation import AssessmentLog, RewardManager
    from gyre.harness import ProxyEndpoint, harness_from_args
    from gyre.proxy.engines import ClientEngine
    from gyre.rollout.client.async_client import AsyncEngineClient
    from gyre.rollout.embedded.config import EngineConfig
    from gyre.rollout.embedded.server import EngineServer
    from gyre.runtime.config import ControllerConfig
    from gyre.runtime.pipeline import ExecutionKey, run_execution
    from gyre.tasks import load_tasks

    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    args = parse_args([*job_flags, "--model-dir", str(model_dir), "--tasks", str(tasks_path), "--run-dir", str(out),
                       "--seed", str(seed)], prog="heldout_eval")
    cfg = ControllerConfig.from_args(args)
    loaded = load_tasks(tasks_path)
    if loaded.problems or not loaded.tasks:
        raise ValueError(f"{tasks_path}: {len(loaded.problems)} bad tasks, {len(loaded.tasks)} good")
    t0 = time.monotonic()
    harness = harness_from_args(args)
    harness.ensure_installed()
    engine = EngineServer(EngineConfig(model_dir=str(model_dir), max_running_requests=concurrency,
                                       random_seed=seed, weight_version="0")).start()
    proxy = _proxy(args, str(model_dir), out, temperature)
    proxy.add_engine(ClientEngine(AsyncEngineClient(engine.url), "engine-0"))
    proxy.start("127.0.0.1", 0)
    rewards = RewardManager(cfg.retry, AssessmentLog(out / "assessments.jsonl"))
    jobs = [(ExecutionKey(0, i, j), task) for j in range(attempts) for i, task in enumerate(loaded.tasks)]

    def one(job):
        key, task = job
        sid = str(key)
        ex = proxy.register_execution(sid, engine_id="engine-0", task_id=task.id, harness=harness.name,
                                      role_rules=harness.roles)
        fin = run_execution(key, task, harness, proxy, rewards, ProxyEndpoint(proxy.url_for(sid), ex.api_key),
                            run_dir=out, timeout_s=min(task.timeout_s or cfg.execution_timeout_s,
                                                       cfg.execution_timeout_s),
                            on_launch=lambda r: None, evaluators=cfg.evaluation)
        reply = (fin.result.final_message or "") if fin.result is not None else ""
        return task.id, float(fin.outcome.reward or 0.0), fin.outcome.status.value, reply

    try:
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, jobs))
    finally:
        proxy.stop()
        engine.stop()
        harness.close()
    per_task: dict[str, list[float]] = {}
    with open(out / "replies.jsonl", "w") as f:
        for tid, reward, status, reply in results:
            per_task.setdefault(tid, []).append(reward)
            f.write(json.dumps({"task": tid, "reward": reward, "status": status, "reply": reply}) + "\n")
    passed = sum(1 for _, r, _, _ in results if r >= 1.0)
    not_assessed: dict[str, int] = {}
    for _, _, status, _ in results:
        if status != "valid":
            not_assessed[status] = not_assessed.get(status, 0) + 1
    return {"passed": passed, "n": len(results), "pass_rate": passed / len(results),
            "not_assessed": not_assessed, "temperature": temperature,
            "wall_s": round(time.monotonic() - t0, 1), "per_task": per_task}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--tasks", required=True)
    p.add_argument("--temperature", type=float, default=0.7, help="0: greedy.")
    p.add_argument("--attempts", type=int, default=1, help="Attempts per task.")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("job_flags", nargs=argparse.REMAINDER, help="after --: main-job flags (--config FILE ...)")
    a = p.parse_args(argv)
    res = evaluate(a.model_dir, a.tasks, temperature=a.temperature, attempts=a.attempts, out=Path(a.out),
                   job_flags=[x for x in a.job_flags if x != "--"], concurrency=a.concurrency, seed=a.seed)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
