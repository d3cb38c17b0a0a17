"""Generate the toy task sets (deterministic). Run from anywhere:

    python examples/tasks/toy/make_tasks.py            # rewrites tasks.jsonl and reply.tasks.jsonl
    python examples/tasks/toy/make_tasks.py --warmstart 300 > sums.jsonl   # other sums, for SFT

tasks.jsonl: "What is a+b? Write the result to answer.txt" -- the correct answer is one
write_file tool call; reward 1 when answer.txt holds the sum (check_answer.py, exit code).
reply.tasks.jsonl: "Reply with exactly the word: W" -- the correct answer is a short fixed
final reply; reward 1 when the harness's final message is W (gyre.tasks.rules).
--warmstart N prints N {"a", "b", "answer", "instruction"} sums disjoint from tasks.jsonl.
"""
import argparse
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN_SEED, N_TRAIN = 20261130, 8
WORDS = ["apple", "river", "stone", "cloud"]


def instruction(a: int, b: int) -> str:
    return f"What is {a}+{b}? Write the result to answer.txt"


def train_pairs() -> list[tuple[int, int]]:
    rng = random.Random(TRAIN_SEED)
    pairs: list[tuple[int, int]] = []
    while len(pairs) < N_TRAIN:
        p = (rng.randint(1, 9), rng.randint(1, 9))
        if p not in pairs:
            pairs.append(p)
    return pairs


def sum_task(a: int, b: int) -> dict:
    return {
        "id": f"toy-add-{a}-{b}",
        "instruction": instruction(a, b),
        "evaluator": {"type": "executable", "command": ["{python}", "{task_dir}/check_answer.py", "answer.txt",
                                                        str(a + b)], "scoring": "exit_code", "timeout_s": 30},
        "hidden": ["."],
        "timeout_s": 120,
        "metadata": {"set": "toy", "answer": str(a + b)},
    }


def reply_task(word: str) -> dict:
    return {
        "id": f"toy-reply-{word}",
        "instruction": f"Reply with exactly the word: {word}",
        "evaluator": {"type": "executable", "command": ["{python}", "-c", "pass"],
                      "scoring": "gyre.tasks.rules:final_message_equals", "timeout_s": 30},
        "hidden": ["."],
        "timeout_s": 120,
        "metadata": {"set": "toy", "expected_reply": word},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmstart", type=int, default=0, help="print this many other sums instead")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.warmstart:
        rng, train = random.Random(args.seed), set(train_pairs())
        for _ in range(args.warmstart):
            while (p := (rng.randint(1, 9), rng.randint(1, 9))) in train:
                pass
            print(json.dumps({"a": p[0], "b": p[1], "answer": str(p[0] + p[1]), "instruction": instruction(*p)}))
        return
    with open(HERE / "tasks.jsonl", "w") as f:
        for a, b in train_pairs():
            f.write(json.dumps(sum_task(a, b)) + "\n")
    with open(HERE / "reply.tasks.jsonl", "w") as f:
        for w in WORDS:
            f.write(json.dumps(reply_task(w)) + "\n")
    print(f"wrote {HERE / 'tasks.jsonl'} and {HERE / 'reply.tasks.jsonl'}", file=sys.stderr)


if __name__ == "__main__":
    main()
