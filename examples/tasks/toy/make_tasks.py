"""Generate the toy task sets (deterministic). Run from anywhere:

    python examples/tasks/toy/make_tasks.py            # rewrites the three task files below
    python examples/tasks/toy/make_tasks.py --warmstart 300 > sums.jsonl   # other sums, for SFT

tasks.jsonl: "What is a+b? Write the result to answer.txt" -- the correct answer is one
write_file tool call; reward 1 when answer.txt holds the sum (check_answer.py, exit code).
largest.tasks.jsonl: "What is the largest of d1 d2 d3 d4 d5? Write the result to answer.txt" for
five digits of which one is 9 (the toy-learning set of examples/cpu_toy_learning.yaml); the
warm-start (``tools/warmstart.py --builtin toy-largest``) answers with a random listed digit, so
RL starts near 1/5; the reward rises as the tiny policy learns to answer 9 (what it learns, in
examples/cpu_toy_learning.yaml's header).
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


def largest_instruction(digits) -> str:
    return "What is the largest of " + " ".join(map(str, digits)) + "? Write the result to answer.txt"


def largest_lists() -> list[list[int]]:
    """The 8 RL lists of ``largest.tasks.jsonl``: four digits in 1..8 and one 9 at a random place."""
    rng = random.Random(TRAIN_SEED)
    out: list[list[int]] = []
    while len(out) < N_TRAIN:
        digits = [rng.randint(1, 8) for _ in range(4)]
        digits.insert(rng.randrange(5), 9)
        if digits not in out:
            out.append(digits)
    return out


def answer_task(task_id: str, instruction_: str, answer: str) -> dict:
    return {
        "id": task_id,
        "instruction": instruction_,
        "evaluator": {"type": "executable", "command": ["{python}", "{task_dir}/check_answer.py", "answer.txt",
                                                        answer], "scoring": "exit_code", "timeout_s": 30},
        "hidden": ["."],
        "timeout_s": 120,
        "metadata": {"set": "toy", "answer": answer},
    }


def sum_task(a: int, b: int) -> dict:
    return answer_task(f"toy-add-{a}-{b}", instruction(a, b), str(a + b))


def largest_task(digits: list[int]) -> dict:
    return answer_task("toy-largest-" + "".join(map(str, digits)), largest_instruction(digits), str(max(digits)))


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
    with open(HERE / "largest.tasks.jsonl", "w") as f:
        for digits in largest_lists():
            f.write(json.dumps(largest_task(digits)) + "\n")
    with open(HERE / "reply.tasks.jsonl", "w") as f:
        for w in WORDS:
            f.write(json.dumps(reply_task(w)) + "\n")
    print(f"wrote tasks.jsonl, largest.tasks.jsonl and reply.tasks.jsonl in {HERE}", file=sys.stderr)


if __name__ == "__main__":
    main()
