"""Rank 0 of the main job after start-up: the proxy, the standalone pool, the harness, the
metrics sink, cell 0's loop in a thread and the controller in the calling thread
(:func:`run_rank0`, called by :func:`gyre.runtime.pretrain.pretrain`).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def run_rank0(args, store, connect, worker, server, urls, model_dir, ckpt, resume) -> dict[str, Any]:
    """Run the job on rank 0 until the controller ends it; return the controller's summary.

    ``worker`` is cell 0's (its loop runs in a thread here), ``server`` the core's snapshot
    (:class:`~gyre.training.weight_snapshot.CoreSnapshotStamps`), ``urls`` every cell's engine,
    ``ckpt``/``resume`` the checkpoint resumed from and its controller state (``None`` on a fresh
    run).  The proxy, harness, standalone pool and metrics sink are stopped before it returns or
    raises; the run's plots are drawn after a finished run.
    """
    from gyre.harness import harness_from_args
    from gyre.metrics import MetricsSink
    from gyre.proxy.engines import ClientEngine
    from gyre.rollout.client.async_client import AsyncEngineClient
    from gyre.runtime.config import ControllerConfig
    from gyre.runtime.controller import Controller
    from gyre.runtime.plot import plot_run
    from gyre.runtime.progress import progress_bar
    from gyre.runtime.standalone import StandalonePool
    from gyre.tasks import load_tasks
    from gyre.training import control as ctl
    from gyre.training.streaming import MicroStepStream

    run_dir = Path(args.run_dir)
    loaded = load_tasks(args.tasks.split(","))
    tasks = loaded.tasks
    if args.execution_fleet:
        from gyre.fleet.launcher import launcher_from_args

        harness = launcher_from_args(args)  # the same launcher interface; executions run on the fleet's nodes
    else:
        harness = harness_from_args(args)
    harness.ensure_installed()
    harness.sweep(run_dir)  # sandboxes an earlier, crashed attempt of this run directory left
    proxy = rank0_proxy(args, model_dir, run_dir, harness)
    for c, url in enumerate(urls):  # an SGLang engine's requests each get a seed (ClientEngine)
        proxy.add_engine(ClientEngine(AsyncEngineClient(url), f"engine-{c}"))
    start_step = resume.iteration if resume else 0
    standalone = standalone_pool(args, connect, worker, server, model_dir, start_step, proxy)
    proxy.start(args.proxy_host, args.proxy_port)
    wandb = None
    if args.wandb_project:
        wandb = {"project": args.wandb_project, "name": args.wandb_exp_name, "dir": args.wandb_save_dir or str(run_dir),
                 "mode": args.wandb_mode, "config": json.loads((run_dir / "args.json").read_text())}
    sink = MetricsSink(run_dir, tensorboard_dir=args.tensorboard_dir, wandb=wandb)
    sink.event("run_start", start_step=start_step, placement=args.placement, proxy=proxy.url,
               proxy_workers=proxy.urls if args.proxy_workers > 1 else [proxy.url],
               engines={f"engine-{c}": url for c, url in enumerate(urls)}, resumed_from=str(ckpt) if ckpt else None)
    cell0 = threading.Thread(target=worker.run, name="gyre-cell0", daemon=True)
    cell0.start()
    controller = Controller(ControllerConfig.from_args(args), proxy, ctl.ControlChannel(store, "rank0"),
                            MicroStepStream(store, args.num_cells), harness, tasks, server, sink, resume=resume,
                            standalone=standalone)
    controller.acct.tasks_skipped = loaded.skipped
    progress = progress_bar(args, start_step)
    try:
        summary = controller.run(progress=progress.update if progress else None)
        if isinstance(standalone, StandalonePool):
            sink.event("standalone_engines", engines=standalone.server_info(), t=controller.now())
        cell0.join(timeout=120)  # it stopped on Shutdown (after a failure nothing waits for it)
    finally:
        if progress:
            progress.close(controller.sched.steps_done)
        proxy.stop()
        harness.close()
        if isinstance(standalone, StandalonePool):
            standalone.stop()
        sink.close()
    try:
        plot_run(run_dir)
    except Exception as exc:  # a plot must not fail a finished run
        logger.warning("run plots failed: %s", exc)
    return summary


def rank0_proxy(args, model_dir, run_dir: Path, harness):
    """Rank 0's proxy: a :class:`ProxyServer` in this process, or ``--proxy-workers`` K > 1
    processes (:class:`gyre.proxy.workers.ProxyWorkers`) with the same configuration."""
    from gyre.embedded_model import load_tokenizer
    from gyre.proxy.render import ChatRenderer
    from gyre.proxy.config import ProxyConfig
    from gyre.proxy.server import ProxyServer
    from gyre.proxy.workers import ProxyWorkers, WorkerSpec
    from gyre.trajectory.store import TrajectoryStore

    config = ProxyConfig.from_args(args, model_dir)
    if args.proxy_workers > 1:
        spec = WorkerSpec(str(model_dir), str(run_dir / "records"), config, role_rules=harness.roles)
        return ProxyWorkers(spec, args.proxy_workers, spec_path=run_dir / "proxy_workers" / "spec.pickle",
                            log_dir=run_dir / "proxy_workers")
    return ProxyServer(ChatRenderer(load_tokenizer(model_dir)),
                       store=TrajectoryStore(run_dir / "records", fsync_every=0, max_open=1024), config=config)


def standalone_pool(args, connect, worker, server, model_dir, version: int, proxy):
    """The standalone pool (``--standalone-engines K``): ``K`` engines on this rank serving
    ``version``, registered with ``proxy``, reading the core's snapshot over Mooncake and replying
    on their own store client.  Without the flag: a :class:`StandaloneRoutes` of cells only."""
    from gyre.proxy.engines import ClientEngine
    from gyre.rollout.client.async_client import AsyncEngineClient
    from gyre.runtime.cell_worker import Snapshot
    from gyre.runtime.standalone import StandalonePool, StandaloneRoutes
    from gyre.training import control as ctl
    from gyre.training.weight_snapshot import MooncakeSnapshotClient

    if not args.standalone_engines:
        return StandaloneRoutes()
    pool = StandalonePool.start(args.standalone_engines, model_dir, concurrency=args.standalone_concurrency,
                                seed=args.seed, num_cells=args.num_cells,
                                snapshot=Snapshot(client=MooncakeSnapshotClient(server.handle, host=server.host)),
                                train_step=worker.train_step, shapes=worker.shapes,
                                channel=ctl.ControlChannel(connect(), "standalone"),
                                version=version)
    for eid, url in zip(pool.engine_ids, pool.urls):
        proxy.add_engine(ClientEngine(AsyncEngineClient(url), eid))
    return pool
