"""torchrun worker (3 ranks = 3 cells of one rank): streaming training with dynamic membership.

The core (cell 0) queues the step's micro-steps, processes them and, after it has processed
``--join1`` of them, asks satellite 1 to join; satellite 2 is asked after ``--join2`` (-1 = never).
Satellites pull the core's Mooncake snapshot, claim micro-steps, and take part in the gradient
sum over the prefix group.  Rank 0 then recomputes the same steps in a single process and writes
the max parameter difference, per-cell claim counts and exactly-once checks to ``--out``.
"""

import argparse
import json
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from gyre.embedded_model import ensure_tiny_model, load_hf_model
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


def micro_step_fn(model):
    def fn(payload):
        total = 0.0
        for r in payload:
            ids = r["ids"][None].long()
            logits = model(ids).logits[0, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            loss = -(r["w"][1:] * logp).sum()
            loss.backward()
            total += float(loss.detach())
        return total
    return fn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--join1", type=int, nargs="+", required=True, help="per step: micro-steps before cell 1 joins")
    p.add_argument("--join2", type=int, nargs="+", required=True, help="per step: ... cell 2 (-1 never)")
    p.add_argument("--kill-cell", type=int, default=-1, help="this cell exits mid-micro-step in the last step")
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

    torch.manual_seed(0)
    model = load_hf_model(ensure_tiny_model("local"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    init = [p.detach().clone() for p in params]
    fn = micro_step_fn(model)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-15, weight_decay=0.01) if rank == 0 else None
    server = MooncakeSnapshotServer(flat_numel(params)) if rank == 0 else None
    handle_box = [server.handle if server else None]
    dist.broadcast_object_list(handle_box, src=0)
    client = MooncakeSnapshotClient(handle_box[0]) if rank != 0 else None

    report = {"rank": rank, "steps": []}
    for step in range(steps):
        if rank == 0:
            server.publish(params, version=step)
            batch = make_batch(step)
            join_at = {1: a.join1[step], 2: a.join2[step]}

            def maybe_join(done_here):
                for c, at in join_at.items():
                    if at >= 0 and done_here == at:
                        stream.request_join(step, c)

            maybe_join(0)
            box = {}
            th = threading.Thread(target=lambda: box.update(ledger=stream.coordinate(step, batch)), daemon=True)
            th.start()
            count, loss_sum = consume_stream(stream, step, 0, fn, on_processed=lambda c: (time.sleep(0.05), maybe_join(c)),
                                             heartbeat_s=0.2)
            th.join()
            ledger = box["ledger"]
            k = stream.wait_window(step)

            def update(_stats):
                for p_ in params:
                    p_.grad /= EXECUTIONS
                n = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
                opt.step()
                return n

            norm, _ = reduce_and_update(params, k, groups, [float(count)], update)
            by = [ledger.finished_by[(m, g)] for m, g in sorted(ledger.generation.items())]
            report["steps"].append({"k": k, "processed_here": count, "by": by, "grad_norm": norm,
                                    "requeued": len(ledger.requeued), "excluded_from": ledger.excluded_from})
        else:
            joined = stream.wait_join_request(step, rank)
            count = 0
            if joined:
                if rank > 1:
                    store.wait([f"s/{step}/joined/{rank - 1}"], timedelta(seconds=60))
                client.pull(params, expected_version=step)
                stream.register_joined(step, rank)
                dying = rank == a.kill_cell and step == steps - 1

                def die_after_one(c):
                    if dying and c == 1:
                        stream.claim(step, rank)  # hold a claim, never finish it
                        import os
                        os._exit(0)

                count, _ = consume_stream(stream, step, rank, fn, on_processed=die_after_one, heartbeat_s=0.2)
            k = stream.wait_window(step)
            if joined and rank <= k:
                reduce_and_update(params, k, groups, [float(count)], None)
            else:
                for p_ in params:
                    p_.grad = None
            report["steps"].append({"joined": joined, "processed_here": count, "k": k})

    flat = torch.cat([p.detach().reshape(-1) for p in params])
    reports = [None] * len(live)
    dist.all_gather_object(reports, report, group=live_group)
    # satellites that took part in the last step hold the core's parameters
    flats = [torch.zeros_like(flat) for _ in live]
    dist.all_gather(flats, flat, group=live_group)
    if rank == 0:
        ref_model = load_hf_model(ensure_tiny_model("local"))
        ref_model.train()
        ref_params = [p for p in ref_model.parameters() if p.requires_grad]
        with torch.no_grad():
            for p_, q in zip(ref_params, init):
                p_.copy_(q)
        ref_opt = torch.optim.AdamW(ref_params, lr=1e-4, betas=(0.9, 0.95), eps=1e-15, weight_decay=0.01)
        ref_fn = micro_step_fn(ref_model)
        for step in range(steps):
            for ms in make_batch(step):
                ref_fn(ms)
            for p_ in ref_params:
                p_.grad /= EXECUTIONS
            torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        ref_flat = torch.cat([p.detach().reshape(-1) for p in ref_params])
        out = {"reports": reports, "max_diff_vs_single": float((flat - ref_flat).abs().max()),
               "max_change": float((flat - torch.cat([q.reshape(-1) for q in init])).abs().max()),
               "satellite_diff_last_step": [float((f - flat).abs().max()) for f in flats]}
        with open(a.out, "w") as fh:
            json.dump(out, fh)
    dist.barrier(group=live_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
