"""Checkpoint retention (``--keep-checkpoints``): which iterations go, against a brute-force
statement of the rule, and the writer deleting them on disk once a newer save is complete."""

import itertools
import json
import random

from gyre.runtime.checkpointing import CheckpointWriter, ControllerState, checkpoints_to_delete, find_checkpoint


def _reference(complete, incomplete, newest, keep):
    if keep == 0:
        return []
    older_complete = sorted(i for i in complete if i < newest)
    kept = set(older_complete[max(0, len(older_complete) - (keep - 1)):])
    return sorted(i for i in set(complete) | set(incomplete) if i < newest and i not in kept)


def test_checkpoints_to_delete_matches_the_rule_on_random_histories():
    r = random.Random(0)
    for _ in range(2000):
        its = r.sample(range(1, 40), r.randint(1, 12))
        newest = r.choice(its)
        complete = [i for i in its if i == newest or r.random() < 0.7]
        incomplete = [i for i in its if i not in complete]
        keep = r.randint(0, 5)
        got = checkpoints_to_delete(complete, incomplete, newest=newest, keep=keep)
        assert got == _reference(complete, incomplete, newest, keep)
        assert newest not in got and all(i < newest for i in got)
        if keep:
            assert len([i for i in complete if i <= newest and i not in got]) == min(keep, len({*complete} & {*range(newest + 1)}))


def test_examples():
    assert checkpoints_to_delete([2, 4, 6], [], newest=6, keep=0) == []
    assert checkpoints_to_delete([2, 4, 6], [], newest=6, keep=1) == [2, 4]
    assert checkpoints_to_delete([2, 4, 6], [5], newest=6, keep=2) == [2, 5]
    assert checkpoints_to_delete([2, 4, 6, 8], [9], newest=6, keep=1) == [2, 4]  # newer ones stay


def _save(writer: CheckpointWriter, it: int) -> None:
    d = writer.request(it, ControllerState(iteration=it))
    from pathlib import Path

    Path(d).mkdir(parents=True)
    (Path(d) / "optimizer.pt").write_bytes(b"x" * 10)
    writer.complete(d)


def test_the_writer_keeps_the_newest_complete_checkpoints_on_disk(tmp_path):
    writer = CheckpointWriter(tmp_path, keep=2)
    root = tmp_path / "checkpoints"
    _save(writer, 2)
    (root / "iter_0000003").mkdir()  # a save cut short
    _save(writer, 4)
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000002", "iter_0000004"]
    _save(writer, 6)
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000004", "iter_0000006"]
    assert find_checkpoint(tmp_path) == root / "iter_0000006"
    assert json.loads((root / "iter_0000006" / "controller.json").read_text())["iteration"] == 6
    everything = CheckpointWriter(tmp_path / "all")
    for it in itertools.chain(range(1, 5)):
        _save(everything, it)
    assert len(list((tmp_path / "all" / "checkpoints").glob("iter_*"))) == 4
