"""torchrun worker (3 ranks = 3 cells of one rank): streaming training with dynamic membership.

The core (cell 0) queues the step's micro-steps, processes them and, after it has processed
``--join1`` of them, asks satellite 1 to join; satellite 2 is asked after ``--join2`` (-1 = never).
Satellites pull the core's Mooncake snapshot, claim micro-steps, and take part in the gradient
sum over the prefix group.  Rank 0 then recomputes the same steps in a single process and writes
the max parameter difference, per-cell claim counts and exactly-once checks to ``--out``.

``--backend raw``: a hand-written per-token-weighted loss on the HF model (AdamW);
``--backend megatron``: the main job's training replica, :class:`gyre.training.megatron_step.MegatronTrainStep`
(Megatron DDP ``main_grad`` buffers, Megatron's optimizer), on GSPO micro-steps packed from the
recorded traces (tests/data/traces) and grouped into work items as the controller queues them.
"""

import argparse
import gc
import json
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.training helpers

import torch
import torch.distributed as dist

from gyre.embedded_model import ensure_tiny_model, load_hf_model
from gyre.runtime.cell_worker import Snapshot
from gyre.training.prefix_groups import PrefixGroups
from gyre.training.streaming import MicroStepStream, consume_stream, reduce_and_update
from gyre.training.weight_snapshot import MooncakeSnapshotClient, MooncakeSnapshotServer, flat_numel

EXECUTIONS = 6
MICRO_STEPS = 8


def make_batch(step: int):
    """8 micro-steps holding rows of 6 executions; weights 1/L_i * A_i fixed at packing."""
    g = torch.Generator().manual_seed(100 + step)
    rows = []
    for i in range(EXECUTIONS):
        adv = float(torch.randn(1, generator=g))
        for _ in range(1 + i % 3):
            t = int(torch.randint(12, 24, (1,), generator=g))
            ids = torch.randint(0, 4000, (t,), generator=g)
            mask = torch.rand(t, generator=g) < 0.5
            mask[0] = False
            rows.append({"exec": i, "ids": ids, "mask": mask, "adv": adv})
    targets = {}
    for r in rows:
        targets[r["exec"]] = targets.get(r["exec"], 0) + int(r["mask"].sum())
    for r in rows:
        r["w"] = r["mask"].float() * r["adv"] / max(targets[r["exec"]], 1)
    return [rows[j::MICRO_STEPS] for j in range(MICRO_STEPS)]


class RawReplica:
    """A ``transformers`` model with a hand-written per-token-weighted loss, AdamW on the core."""

    def __init__(self, rank: int, traces: str | None):
        torch.manual_seed(0)
        self.model = load_hf_model(ensure_tiny_model("local"))
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-15, weight_decay=0.01) \
            if rank == 0 else None

    def batch(self, step: int) -> list:
        return make_batch(step)

    def process(self, payload) -> float:
        """Accumulate one micro-step's gradient; returns its share of the normaliser (none here)."""
        for r in payload:
            ids = r["ids"][None].long()
            logits = self.model(ids).logits[0, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            (-(r["w"][1:] * logp).sum()).backward()
        return 0.0

    def grads(self):
        return None  # p.grad

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def update(self, _summed) -> float:
        for p in self.params:
            p.grad /= EXECUTIONS
        n = float(torch.nn.utils.clip_grad_norm_(self.params, 1.0))
        self.opt.step()
        return n

    def reference(self, steps: int, init, ref: "RawReplica") -> torch.Tensor:
        """The same steps in this process alone on the replica ``ref``, from ``init``."""
        with torch.no_grad():
            for p, q in zip(ref.params, init):
                p.copy_(q)
        for step in range(steps):
            for ms in ref.batch(step):
                ref.process(ms)
            ref.update(None)
            ref.zero_grad()
        return torch.cat([p.detach().reshape(-1) for p in ref.params])


class MegatronReplica:
    """The main job's Megatron training replica (:class:`gyre.training.megatron_step.MegatronTrainStep`) on
    micro-steps packed from the recorded traces, in work items as the controller queues them."""

    def __init__(self, rank: int, traces: str | None):
        from gyre.training.megatron_step import build_megatron_train_step
        from gyre.training.step import AdamConfig

        self.traces = traces
        self.hf = load_hf_model(ensure_tiny_model("local"))
        self.step = build_megatron_train_step(self.hf, adam=AdamConfig(lr=1e-4))
        self.params = self.step.params

    def batch(self, step: int) -> list:
        """8 executions shaped like the recorded traces, one row per micro-step (budget = the longest
        row), so every execution is split and takes the forward-only log-ratio pass; one work item
        per execution."""
        import numpy as np

        from gyre.buffer.packing import PackingConfig, pack_rows
        from gyre.buffer.work_items import encode_work_item, work_items
        from gyre.testing.trace_trees import trace_shaped_rows
        from tests.training.test_step import TRACES, with_behaviour_near_policy

        rng = np.random.default_rng(10 + step)
        rows = []
        for e in range(MICRO_STEPS):
            rows += trace_shaped_rows(Path(self.traces) / TRACES[e % len(TRACES)], rng,
                                      advantage=float(rng.normal()), scale=1 / 192, execution_id=f"ex-{e}")
        rows = with_behaviour_near_policy(self.hf, rows, seed=10 + step)
        packed = pack_rows(rows, PackingConfig(max(r.num_tokens for r in rows), "pad", tree=True))
        return [encode_work_item(item) for item in work_items(packed.micro_steps)]

    def process(self, payload) -> float:
        from gyre.buffer.work_items import decode_work_item
        from gyre.training.step import apply_log_ratio_sums

        items = decode_work_item(payload)
        apply_log_ratio_sums(items, self.step.precompute_log_ratio_sums(items)[0])
        normaliser, _ = self.step.accumulate(items)
        return float(normaliser)

    def grads(self):
        return self.step.grad_tensors()

    def zero_grad(self) -> None:
        self.step.zero_grad()

    def update(self, summed) -> float:
        return self.step.optimizer_step(int(round(summed[0])))

    def reference(self, steps: int, init, ref: "MegatronReplica") -> torch.Tensor:
        with torch.no_grad():
            for p, q in zip(ref.params, init):
                p.copy_(q)
        for step in range(steps):
            ref.zero_grad()
            normaliser = sum(ref.process(item) for item in ref.batch(step))
            ref.update([normaliser])
        return torch.cat([p.detach().reshape(-1) for p in ref.params])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--join1", type=int, nargs="+", required=True, help="per step: micro-steps before cell 1 joins")
    p.add_argument("--join2", type=int, nargs="+", required=True, help="per step: ... cell 2 (-1 never)")
    p.add_argument("--kill-cell", type=int, default=-1, help="this cell exits mid-micro-step in the last step")
    p.add_argument("--backend", choices=("raw", "megatron"), default="raw",
                   help="raw: a hand-written loss on the HF model; megatron: the main job's MegatronTrainStep")
    p.add_argument("--traces", help="the trace directory, tests/data/traces (for --backend megatron)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    steps = len(a.join1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))  # rank 0 recomputes the reference while the others wait
    rank = dist.get_rank()
    num_cells = dist.get_world_size()
    groups = PrefixGroups.build(num_cells, 1)
    port_box = [None]
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, num_cells, is_master=True, wait_for_workers=False)
        port_box = [store.port]
    dist.broadcast_object_list(port_box, src=0)
    if rank != 0:
        store = dist.TCPStore("127.0.0.1", port_box[0], num_cells, is_master=False)
    stream = MicroStepStream(store, num_cells, lease_s=1.0)
    live = [c for c in range(num_cells) if c != a.kill_cell]
    live_group = dist.new_group(live)

    if a.backend == "megatron":
        from gyre.training.megatron_model import initialize_megatron_cpu

        initialize_megatron_cpu(1, 1, seed=1234)  # every rank: Megatron's groups, then none of ours
    kind = MegatronReplica if a.backend == "megatron" else RawReplica
    replica = kind(rank, a.traces)
    reference = kind(rank, a.traces)  # built on every rank: Megatron's optimizer build is a collective
    params = replica.params
    init = [p.detach().clone() for p in params]
    normaliser = [0.0]

    def fn(payload):
        normaliser[0] += replica.process(payload)
        return 0.0

    server = MooncakeSnapshotServer(flat_numel(params)) if rank == 0 else None
    handle_box = [server.handle if server else None]
    dist.broadcast_object_list(handle_box, src=0)
    snapshot = Snapshot(client=MooncakeSnapshotClient(handle_box[0])) if rank != 0 else None

    report = {"rank": rank, "steps": []}
    for step in range(steps):
        if rank == 0:
            server.publish(params, version=step)
            batch = replica.batch(step)
            join_at = {1: a.join1[step], 2: a.join2[step]}

            def maybe_join(done_here):
                # the core pauses until the satellite has registered, so the join lands after exactly
                # `at` of the core's micro-steps whatever the machine load (polling: the coordinator
                # thread shares this store client, and a blocking wait would starve it)
                for c, at in join_at.items():
                    if at >= 0 and done_here == at:
                        stream.request_join(step, c)
                        deadline = time.monotonic() + 60
                        while not stream._has(f"s/{step}/joined/{c}") and time.monotonic() < deadline:
                            time.sleep(0.01)

            maybe_join(0)
            replica.zero_grad()
            normaliser[0] = 0.0
            box = {}
            th = threading.Thread(target=lambda: box.update(ledger=stream.coordinate(step, batch)), daemon=True)
            th.start()
            count, loss_sum = consume_stream(stream, step, 0, fn, on_processed=lambda c: (time.sleep(0.05), maybe_join(c)),
                                             heartbeat_s=0.2)
            th.join()
            ledger = box["ledger"]
            k = stream.wait_window(step)
            norm, _ = reduce_and_update(params, k, groups, [normaliser[0]], replica.update, grads=replica.grads())
            replica.zero_grad()
            by = [ledger.finished_by[(m, g)] for m, g in sorted(ledger.generation.items())]
            report["steps"].append({"k": k, "processed_here": count, "by": by, "grad_norm": norm,
                                    "requeued": len(ledger.requeued), "excluded_from": ledger.excluded_from})
        else:
            joined = stream.wait_join_request(step, rank)
            count = 0
            if joined and rank > 1:
                store.wait([f"s/{step}/joined/{rank - 1}"], timedelta(seconds=60))
            # a late join request can arrive after the core closed the window and published the
            # next version: exact=step then gives None and this cell sits the step out (CellWorker
            # does the same); a plain pull would raise on the newer version
            if joined and snapshot.pull(params, exact=step) is None:
                joined = False
            replica.zero_grad()
            normaliser[0] = 0.0
            if joined:
                stream.register_joined(step, rank)
                dying = rank == a.kill_cell and step == steps - 1

                def step_fn(payload):
                    if dying:  # die mid-micro-step, holding the claim of this one
                        import os
                        os._exit(0)
                    return fn(payload)

                count, _ = consume_stream(stream, step, rank, step_fn, heartbeat_s=0.2)
            k = stream.wait_window(step)
            if joined and rank <= k:
                reduce_and_update(params, k, groups, [normaliser[0]], None, grads=replica.grads())
            replica.zero_grad()
            report["steps"].append({"joined": joined, "processed_here": count, "k": k})

    flat = torch.cat([p.detach().reshape(-1) for p in params])
    reports = [None] * len(live)
    dist.all_gather_object(reports, report, group=live_group)
    # satellites that took part in the last step hold the core's parameters
    flats = [torch.zeros_like(flat) for _ in live]
    dist.all_gather(flats, flat, group=live_group)
    if rank == 0:
        ref_flat = replica.reference(steps, init, reference)
        out = {"reports": reports, "max_diff_vs_single": float((flat - ref_flat).abs().max()),
               "max_change": float((flat - torch.cat([q.reshape(-1) for q in init])).abs().max()),
               "satellite_diff_last_step": [float((f - flat).abs().max()) for f in flats]}
        with open(a.out, "w") as fh:
            json.dump(out, fh)
    dist.barrier(group=live_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.freeze()  # the collections at exit skip what lived until now (seconds with Torch loaded)
