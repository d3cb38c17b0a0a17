"""Cell layout and the leader's orders (a real in-process store; no process group)."""

import threading

import pytest
import torch.distributed as dist

from gyre.runtime.cell_group import CellGroup, CellLayout
from gyre.training.prefix_groups import prefix_group_ranks


def test_layout_of_3_cells_of_2_ranks():
    layouts = [CellLayout(r, 3, 2) for r in range(6)]
    assert [(x.cell, x.shard, x.is_leader) for x in layouts] == [
        (0, 0, True), (0, 1, False), (1, 0, True), (1, 1, False), (2, 0, True), (2, 1, False)]
    assert layouts[3].ranks == [2, 3] and layouts[3].leader == 2 and layouts[0].leaders() == [0, 2, 4]
    # the prefix group of shard s joins shard s of cells 0..k: the same offsets as the layout
    for k, shard_sets in prefix_group_ranks(3, 2).items():
        for s, ranks in enumerate(shard_sets):
            assert [(x.cell, x.shard) for x in (layouts[r] for r in ranks)] == [(c, s) for c in range(k + 1)]


def test_orders_reach_every_other_rank_in_order():
    store = dist.HashStore()
    leader = CellGroup(CellLayout(3, 2, 3), store)  # cell 1 of 3-rank cells: ranks 3, 4, 5
    others = [CellGroup(CellLayout(r, 2, 3), store) for r in (4, 5)]
    got = {4: [], 5: []}

    def follow(g):
        while (o := g.next_order(timeout_s=10))[0] != "stop":
            got[g.layout.rank].append(o)

    threads = [threading.Thread(target=follow, args=(g,)) for g in others]
    for t in threads:
        t.start()
    leader.order("train", 7, True)
    leader.order("item", b"\x00payload")
    leader.order("stop")
    for t in threads:
        t.join(10)
    assert got[4] == got[5] == [("train", (7, True)), ("item", (b"\x00payload",))]
    assert not any(store.check([k]) for k in ("cellorder/1/0", "cellorder/1/0/read"))  # read by both: deleted
    leader.order("restore")
    assert others[0].next_order(timeout_s=5) == ("restore", ())
    assert store.check(["cellorder/1/3"])  # stored once, kept until the last rank has read it
    assert others[1].next_order(timeout_s=5) == ("restore", ()) and not store.check(["cellorder/1/3"])
    with pytest.raises(TimeoutError, match="cell 1 shard 1: no order from the leader within 0.05s"):
        others[0].next_order(timeout_s=0.05)


def test_a_cell_of_one_rank_needs_no_store_and_no_collective():
    g = CellGroup.alone(4)
    assert g.is_leader and g.size == 1 and g.layout.cell == 4
    g.order("anything", 1)  # nobody to tell
    assert g.agree_min_max(3) == (3, 3) and g.agree_all(False) is False and g.share("x") == "x"
