"""The generated small-sum family: seeded, disjoint splits that cover it, commuted problems on one
side, the committed files equal to the generator's output, and the last-integer rule on known replies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre.evaluation import EvaluationTarget
from gyre.tasks import arithmetic, load_tasks
from gyre.tasks.rules import last_integer

ROOT = Path(__file__).resolve().parents[2]
ARITH = ROOT / "examples" / "tasks" / "arith"


def test_problems_are_the_whole_family():
    ps = arithmetic.problems()
    assert len(ps) == 200 and len(set(ps)) == 200
    assert min(ps) == (0, 0) and max(ps) == (19, 9)


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_splits_are_disjoint_cover_and_keep_commuted_pairs_together(seed):
    s = arithmetic.splits(seed)
    train, held = set(s["train"]), set(s["heldout"])
    assert not train & held
    assert train | held == set(arithmetic.problems())
    assert 64 <= len(held) <= 65  # a last group of two commuted problems may add one
    for a, b in held:
        assert (b, a) not in train
    assert arithmetic.splits(seed) == s  # the same seed, the same splits


def test_seeds_give_different_splits():
    assert arithmetic.splits(0)["heldout"] != arithmetic.splits(1)["heldout"]


def test_heldout_size_is_checked():
    with pytest.raises(ValueError):
        arithmetic.splits(0, heldout_size=0)
    with pytest.raises(ValueError):
        arithmetic.splits(0, heldout_size=200)
    with pytest.raises(ValueError):
        arithmetic.tasks("test", 0)
    assert len(arithmetic.splits(0, heldout_size=8)["heldout"]) in (8, 9)


def test_committed_files_equal_the_generator(tmp_path):
    for split in ("train", "heldout"):
        want = [json.dumps(t) for t in arithmetic.tasks(split, 0)]
        assert (ARITH / f"{split}.tasks.jsonl").read_text().splitlines() == want
    out = arithmetic.write_tasks(tmp_path / "x" / "h.jsonl", "heldout", 0)
    assert out.read_text() == (ARITH / "heldout.tasks.jsonl").read_text()


@pytest.mark.parametrize("text, value", [
    ("7 + 5 = 12.", 12), ("The answer is 11.", 11), ("12", 12), ("2-8 = -6", -6), ("no number", None),
    ("", None), ("1,000", 0), ("x=3\n\nThis is 4", 4),
])
def test_last_integer(text, value):
    assert last_integer(text) == value


def score(task, tmp_path: Path, reply) -> float:
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    ev = task.build_evaluator(eval_root=tmp_path / "eval")
    meta = {**task.metadata} if reply is None else {**task.metadata, "final_message": reply}
    a = ev.evaluate(EvaluationTarget("x-1", ws, "ref", metadata=meta))
    assert a.valid, a.details
    return a.score


def test_rule_scores_known_replies(tmp_path):
    res = load_tasks(ARITH / "heldout.tasks.jsonl")
    assert not res.problems and len(res.tasks) == 64
    task = next(t for t in res.tasks if t.id == "arith-add-0-3")
    assert task.instruction == "What is 0+3? Reply with only the number." and task.metadata["answer"] == "3"
    assert score(task, tmp_path, "0 + 3 = 3") == 1.0
    assert score(task, tmp_path, "3") == 1.0
    assert score(task, tmp_path, "The answer is 0.") == 0.0  # the last integer counts, not any
    assert score(task, tmp_path, "3 is wrong, it is 4") == 0.0
    assert score(task, tmp_path, "three") == 0.0
    assert score(task, tmp_path, None) == 0.0  # the harness said nothing


def test_rule_without_an_integer_answer_is_unresolved():
    from types import SimpleNamespace

    from gyre.evaluation import Unresolved
    from gyre.tasks.rules import final_message_last_number

    def result(meta):
        return SimpleNamespace(target=SimpleNamespace(metadata=meta))

    assert final_message_last_number(result({"answer": "12", "final_message": "7 + 5 = 12"}))[0] == 1.0
    for meta in ({"final_message": "12"}, {"answer": "twelve", "final_message": "12"}):
        with pytest.raises(Unresolved):
            final_message_last_number(result(meta))
