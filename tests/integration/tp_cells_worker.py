"""torchrun worker (4 ranks = 2 cells of 2 ranks: ``--tp 2`` or ``--pp 2``): the main job's
streaming step with cells that span ranks, against the single-process HF step.

Every rank runs the main job's pieces: Megatron's parallel state (model-parallel groups = cells,
``order="tp-cp-ep-pp-dp"`` as the main job), the prefix
groups of corresponding shards, a :class:`gyre.runtime.cell_group.CellGroup` per cell, one Mooncake
snapshot per core shard, and :func:`gyre.runtime.pipeline.train_on_stream` (the core's leader in a
thread of rank 0, as in the main job; its follower, rank 1; the satellite's leader, rank 2, which
orders its follower, rank 3, as :class:`gyre.runtime.cell_worker.CellWorker` does).  Rank 0's main
thread plays the controller: it queues each step's work items and asks the satellite to join after
``--join`` of them are done (-1: never).  With ``--kill-step S`` (the last step) both satellite ranks
exit in their first micro-step of step S.

Recorded per step on the core: the summed gradients the core's update applies and the weights
after it (gathered to HF names), and who processed which work item.  After the satellite's last
step (the last one, or the one before ``--kill-step``) the satellite's leader reads the published
snapshot as its engine would (:func:`gyre.runtime.pipeline.read_policy`) and every rank's report so
far is gathered on rank 0.  With ``--tied-control`` the core first accumulates step 0's work items
with the tied word embedding's gradient not summed over the pipeline stages, keeps that gradient and
applies nothing (a negative control).  Rank 0 recomputes every step with
:class:`gyre.training.hf_step.HFTrainStep` in one process and writes the differences to ``--out``.
"""

import argparse
import copy
import gc
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

EXECUTIONS = 6


def batch(hf, step: int) -> list[bytes]:
    """One work item per execution, each execution's rows in micro-steps of the longest row."""
    import numpy as np

    from gyre.buffer.packing import PackingConfig, pack_rows
    from gyre.buffer.work_items import encode_work_item, work_items
    from tests.training.test_step import TRACES, with_behaviour_near_policy
    from gyre.testing.trace_trees import trace_shaped_rows

    rng = np.random.default_rng(20 + step)
    rows = []
    for e in range(EXECUTIONS):
        rows += trace_shaped_rows(ROOT / "tests" / "data" / "traces" / TRACES[e % len(TRACES)], rng,
                                  advantage=float(rng.normal()), scale=1 / 192, execution_id=f"ex-{e}")
    rows = with_behaviour_near_policy(hf, rows, seed=20 + step)
    packed = pack_rows(rows, PackingConfig(max(r.num_tokens for r in rows), "pad", tree=True))
    return [encode_work_item(item) for item in work_items(packed.micro_steps)]


def untied_gradient(train_step, hf) -> dict:
    """Step 0's work items accumulated on this core rank as its cell's micro-steps do (log-ratio
    sums, then ``accumulate``) but with the tied word embedding's gradient not summed over the
    stages: the gradient, in HF names (a collective over the core's ranks).  Nothing is applied;
    the gradient buffers are zeroed afterwards."""
    from gyre.buffer.work_items import decode_work_item
    from gyre.training.step import apply_log_ratio_sums

    train_step._reduce_tied_embedding_grads = lambda params: None
    try:
        train_step.zero_grad()
        for payload in batch(hf, 0):
            items = decode_work_item(payload)
            apply_log_ratio_sums(items, train_step.precompute_log_ratio_sums(items)[0])
            train_step.accumulate(items)
        return {n: g.detach().to("cpu", copy=True)
                for n, g in train_step.hf_named(train_step.grad_tensors()).items()}
    finally:
        del train_step._reduce_tied_embedding_grads  # the class's stage sum again
        train_step.zero_grad()


def satellite_reads(snapshot, train_step, params, cg, rank: int, at_least: int, report: dict) -> dict:
    """The satellite serves what the core published last: reads it whole and in buckets as its
    engine would (every satellite rank takes part), records what it got in ``report``; returns the
    HF-named weights."""
    from gyre.runtime import pipeline

    scratch = [torch.empty_like(q) for q in params]
    version, published = pipeline.read_policy(snapshot, train_step, scratch, at_least=at_least, cell_group=cg)
    published = {n: w.cpu() for n, w in published.items()}
    report["published_version"] = version
    # as the engine gets it: in buckets (64 KiB: several), gathered unit by unit on the leader
    v2, buckets = pipeline.policy_buckets(snapshot, train_step, scratch, at_least=at_least,
                                         bucket_bytes=64 << 10, cell_group=cg)
    got = [{n: t.cpu() for n, t in b.items()} for b in buckets]
    report["buckets"] = len(got)
    if rank == 2:
        merged = {n: t for b in got for n, t in b.items()}
        assert v2 == version and sorted(merged) == sorted(published), (v2, sorted(set(published) - set(merged)))
        report["bucket_diff"] = max(float((merged[n] - published[n]).abs().max()) for n in published)
        report["bucket_max_bytes"] = max(sum(t.numel() * t.element_size() for t in b.values()) for b in got)
        # the colocated push: each bucket flattened, shared by handle, one payload per engine TP rank
        from gyre.rollout.tensor_bucket import FlatBucket, engine_rank_payloads, load_payload

        flats = [FlatBucket.pack(b) for b in got]  # (CPU copies: a handle opened in-process)
        per_rank = [engine_rank_payloads([f.serialize(), None], engine_tp_size=2) for f in flats]
        report["payloads_per_bucket"] = sorted({len(p) for p in per_rank})
        for r in range(2):
            pushed = {n: t for p in per_rank for n, t in load_payload(p[r])}
            assert sorted(pushed) == sorted(published)
            report[f"payload_diff_rank{r}"] = max(float((pushed[n] - published[n]).abs().max()) for n in published)
    return published


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--join", type=int, nargs="+", required=True, help="per step: items done before cell 1 joins")
    p.add_argument("--kill-step", type=int, default=-1, help="the last step (not 0): the satellite dies in it")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--tied-control", action="store_true",
                   help="negative control: also step 0's gradient without the tied embedding's stage sum (PP > 1)")
    p.add_argument("--device", default="cpu", help="cuda: every rank's Megatron replica on GPU 0 (gloo over CUDA "
                                                      "tensors; the GPU check), the HF reference on CPU")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    steps = len(a.join)
    if a.kill_step >= 0:
        assert a.kill_step == steps - 1 > 0, "the kill step is the last step, after at least one other"
    read_after = a.kill_step - 1 if a.kill_step >= 0 else steps - 1  # the satellite's last step

    from gyre.buffer.work_items import decode_work_item
    from gyre.embedded_model import ensure_tiny_model, load_hf_model
    from gyre.runtime import pipeline
    from gyre.runtime.cell_group import CellGroup
    from gyre.runtime.cell_worker import Snapshot
    from gyre.training.hf_step import HFTrainStep
    from gyre.training.megatron_model import initialize_megatron_cpu
    from gyre.training.megatron_step import build_megatron_train_step
    from gyre.training.prefix_groups import PrefixGroups
    from gyre.training.step import apply_log_ratio_sums
    from gyre.training.streaming import MicroStepStream
    from gyre.training.weight_snapshot import MooncakeSnapshotClient, MooncakeSnapshotServer, flat_numel

    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    num_cells, per_cell = 2, a.tp * a.pp
    assert world == num_cells * per_cell
    if a.device == "cuda":
        torch.cuda.set_device(0)
    initialize_megatron_cpu(a.tp, a.pp, seed=1234, order="tp-cp-ep-pp-dp", cpu=a.device == "cpu")
    box = [None]
    if rank == 0:
        master = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        box = [master.port]
    dist.broadcast_object_list(box, src=0)

    def client():
        return dist.TCPStore("127.0.0.1", box[0], world, is_master=False)

    groups = PrefixGroups.build(num_cells, per_cell)
    cg = CellGroup.build(rank, num_cells, per_cell, client())
    cell, shard = cg.layout.cell, cg.layout.shard
    core_group = dist.new_group([0, 1])
    torch.manual_seed(0)
    hf = load_hf_model(ensure_tiny_model("local"))
    train_step = build_megatron_train_step(hf)
    params = train_step.params
    init_hf = {n: p.detach().clone() for n, p in hf.named_parameters()}
    untied = untied_gradient(train_step, hf) if a.tied_control and cell == 0 else None

    if cell == 0:
        server = MooncakeSnapshotServer(flat_numel(params))
        server.publish(params, version=0)
        snapshot = Snapshot(server=server)
        handle = server.handle
    else:
        handle = None
    handles = [None] * world
    dist.all_gather_object(handles, handle)
    if cell != 0:
        snapshot = Snapshot(client=MooncakeSnapshotClient(handles[shard]))

    dying = {"on": False}
    accumulate = train_step.accumulate

    def maybe_die(items):
        if dying["on"]:
            os._exit(0)  # mid-micro-step, the leader holding the claim
        return accumulate(items)

    train_step.accumulate = maybe_die
    recorded: list[dict] = []
    update = train_step.optimizer_step

    def recording_update(normaliser):  # the core's update: record the summed gradients it applies
        grads = train_step.hf_named(train_step.grad_tensors())  # a TP collective: both core ranks are here
        recorded.append({"normaliser": int(normaliser), "grads": {n: g.cpu() for n, g in grads.items()}})
        return update(normaliser)

    train_step.optimizer_step = recording_update
    stream = MicroStepStream(client(), num_cells, lease_s=1.0)
    report: dict = {"rank": rank, "steps": []}
    weights_after: list[dict] = []
    reports: list = [None] * world
    published = None
    for step in range(steps):
        if cell == 1:
            if rank == 2:
                asked = stream.wait_join_request(step, 1)
                dying["on"] = asked and step == a.kill_step
                cg.order("train", step, dying["on"])
                done = pipeline.train_on_stream(step, 1, train_step, stream, groups, snapshot, cg)
            else:
                name, (s, die) = cg.next_order()
                assert (name, s) == ("train", step)
                dying["on"] = die
                done = pipeline.train_on_stream(step, 1, train_step, stream, groups, snapshot, cg)
            report["steps"].append({"reply": type(done).__name__ if done is not None else None,
                                    "count": getattr(done, "micro_steps_here", None),
                                    "reason": getattr(done, "reason", None)})
        elif rank == 1:
            pipeline.train_on_stream(step, 0, train_step, stream, groups, snapshot, cg)
        else:
            result: dict = {}
            core_stream = MicroStepStream(client(), num_cells, lease_s=1.0)
            core = threading.Thread(target=lambda: result.update(done=pipeline.train_on_stream(
                step, 0, train_step, core_stream, groups, snapshot, cg)))
            core.start()
            coord = stream.coordinator(step)
            payloads = batch(hf, step)
            join_at = a.join[step]

            def join_now():
                stream.request_join(step, 1)
                deadline = time.monotonic() + 120
                while not stream.has_joined(step, 1) and time.monotonic() < deadline:
                    coord.poll()
                    time.sleep(0.01)

            if join_at == 0:
                join_now()
            for i, payload in enumerate(payloads):
                coord.add(payload)
                if i + 1 == join_at:
                    while len(coord.ledger.done()) < join_at:
                        coord.poll()
                        time.sleep(0.01)
                    join_now()
            k = coord.close(timeout_s=float("inf"))
            core.join()
            done = result["done"]
            ledger = coord.ledger
            report["steps"].append({
                "k": k, "count": done.micro_steps_here, "items": len(payloads),
                "by": [ledger.finished_by[(m, g)] for m, g in sorted(ledger.generation.items())],
                "requeued": len(ledger.requeued), "excluded_from": ledger.excluded_from})
        if cell == 0:
            weights_after.append({n: w.cpu() for n, w in train_step.hf_named([q.detach() for q in params]).items()})
        if step == read_after:  # the satellite reads the published snapshot; every report so far to rank 0
            if cell == 1:
                published = satellite_reads(snapshot, train_step, params, cg, rank, step + 1, report)
            dist.all_gather_object(reports, {**report, "steps": list(report["steps"]),
                                             "published": published if rank == 2 else None})
    live = core_group if a.kill_step >= 0 else None  # after a kill only the core is left
    if a.kill_step >= 0:  # the core's reports through the kill step, the satellite's from before it
        core_reports = [None, None]
        dist.all_gather_object(core_reports, report, group=core_group)
        reports[:2] = core_reports
    if rank == 0:
        ref = HFTrainStep(copy.deepcopy(hf))
        with torch.no_grad():
            for n, q in ref.model.named_parameters():
                q.copy_(init_hf[n])
        out = {"reports": [{k: v for k, v in r.items() if k != "published"} for r in reports], "steps": []}
        for step in range(steps):
            micro = [m for payload in batch(hf, step) for m in decode_work_item(payload)]
            sums, _ = ref.precompute_log_ratio_sums(micro)
            apply_log_ratio_sums(micro, sums)
            ref.zero_grad()
            n_ref, _ = ref.forward_backward(micro)
            g_ref = {n: q.grad.detach().clone() for n, q in ref.model.named_parameters()}
            scale = max(float(g.abs().max()) for g in g_ref.values())
            ref.optimizer_step(n_ref)
            w_ref = {n: q.detach().clone() for n, q in ref.model.named_parameters()}
            got = recorded[step]
            out["steps"].append({
                "normaliser": got["normaliser"], "ref_normaliser": int(n_ref), "grad_scale": scale,
                "grad_diff": max(float((got["grads"][n] - g_ref[n]).abs().max()) for n in got["grads"]),
                "weight_diff": max(float((weights_after[step][n] - w_ref[n]).abs().max())
                                   for n in weights_after[step]),
                "weight_change": max(float((weights_after[step][n] - init_hf[n]).abs().max())
                                     for n in weights_after[step])})
            if step == 0 and untied is not None:
                out["untied_grad_diff"] = max(float((untied[n] - g_ref[n]).abs().max()) for n in untied)
            if step == read_after:
                pub = reports[2]["published"]
                out["published_diff"] = max(float((pub[n] - w_ref[n]).abs().max()) for n in pub)
        Path(a.out).write_text(json.dumps(out))
    dist.barrier(group=live)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    gc.freeze()  # the collections at exit skip what lived until now (seconds with Torch loaded)
