"""torchrun worker (3 ranks = 3 cells): prefix groups, gloo and Mooncake weight snapshots across processes."""

import argparse
import gc
import json
from datetime import timedelta

import torch
import torch.distributed as dist

from gyre.training.prefix_groups import PrefixGroups
from gyre.training.weight_snapshot import (MooncakeSnapshotClient, MooncakeSnapshotServer, flat_numel,
                                           gloo_broadcast_snapshot)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = PrefixGroups.build(world, 1)
    rec = {"rank": rank}
    # all-reduce over participants {0..1}: only ranks 0 and 1 take part, rank 2 is elsewhere
    if groups.group(1) is not None:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=groups.group(1))
        rec["sum_prefix_1"] = float(t)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=groups.group(2))
    rec["sum_prefix_2"] = float(t)
    rec["members_1"] = groups.members(1)

    g = torch.Generator().manual_seed(rank)
    params = [torch.randn(5, 3, generator=g), torch.randn(11, generator=g)]
    core_params = [x.clone() for x in params] if rank == 0 else None
    # gloo fallback among {0, 1}
    if groups.group(1) is not None:
        rec["gloo_version"] = gloo_broadcast_snapshot(params, version=3, src=0, group=groups.group(1))
    # Mooncake: core publishes, satellites pull with one-sided reads
    handle = None
    if rank == 0:
        server = MooncakeSnapshotServer(flat_numel(params))
        server.publish(params, version=4)
        handle = server.handle
    box = [handle]
    dist.broadcast_object_list(box, src=0)
    if rank != 0:
        client = MooncakeSnapshotClient(box[0])
        rec["mooncake_version"] = client.pull(params, expected_version=4)
    flat = torch.cat([x.flatten() for x in params])
    ref = torch.zeros_like(flat)
    if rank == 0:
        ref.copy_(torch.cat([x.flatten() for x in core_params]))
    dist.broadcast(ref, src=0)
    rec["equal_to_core"] = bool(torch.equal(flat, ref))
    dist.barrier()  # keep the core's server alive until every pull is done
    out = [None] * world
    dist.all_gather_object(out, rec)
    if rank == 0:
        with open(a.out, "w") as fh:
            json.dump(out, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.freeze()  # the collections at exit skip what lived until now (seconds with Torch loaded)
