#!/usr/bin/env python
"""Supervised format warm-start: train a model on chat examples and save it as an HF directory.

    python tools/warmstart.py --out DIR [--model-dir SRC] [--examples FILE.jsonl | --builtin tool-loop]
                              [--builtin toy-sums --exclude-tasks examples/tasks/toy/tasks.jsonl]
                              [--builtin toy-largest --exclude-tasks examples/tasks/toy/largest.tasks.jsonl]
                              [--steps 200] [--lr 1e-3] [--seed 0]

Without --model-dir the embedded tiny Qwen3 (local tokenizer) is the start.  Examples are JSONL
objects ``{"messages": [...], "tools": [...]}`` rendered with the model's chat template; the loss
covers assistant tokens only.  Prints the loss at start and end and, last, ``{"model_dir": "DIR"}``.
Errors exit 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from gyre.training.warmstart import Example


def tool_loop_examples(max_prior_turns: int = 6) -> list[Example]:
    """Built-in set ``tool-loop``: the reference agent's prompt and tools, and an assistant that
    always answers with one ``bash`` call (``echo step``), whatever the number of earlier turns.

    A policy trained on it keeps a harness busy for as many turns as it allows: the test policy
    of the role-transition tests.
    """
    from gyre.harness.reference_agent.agent import DEFAULT_SYSTEM_PROMPT
    from gyre.harness.reference_agent.tools import TOOL_SCHEMAS
    from gyre.training.warmstart import Example

    tools = [TOOL_SCHEMAS["bash"]]
    out = []
    for k in range(max_prior_turns + 1):
        msgs: list[dict[str, Any]] = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                                      {"role": "user", "content": "Run the checks, one step at a time."}]
        for t in range(k + 1):
            call_id = f"call_{t}"
            msgs.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "bash", "arguments": {"command": "echo step"}}}]})
            if t < k:
                msgs.append({"role": "tool", "tool_call_id": call_id, "content": "exit code: 0\nstep\n"})
        out.append(Example(msgs, tools))
    return out


TOY_SUM_RE = r"What is (\d+)\+(\d+)\? Write the result to answer\.txt"


def _answer_file_example(question: str, content: str) -> Example:
    """``question`` answered by one ``write_file`` call that writes ``content`` to answer.txt, with
    only the ``write_file`` tool offered (the toy sets' prompt shape)."""
    from gyre.harness.reference_agent.tools import TOOL_SCHEMAS
    from gyre.training.warmstart import Example

    return Example([{"role": "user", "content": question},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "call_0", "type": "function",
                         "function": {"name": "write_file",
                                      "arguments": {"path": "answer.txt", "content": content}}}]}],
                   [TOOL_SCHEMAS["write_file"]])


def toy_sum_examples(exclude: Sequence[str] = ()) -> list[Example]:
    """Built-in set ``toy-sums``: "What is a+b? Write the result to answer.txt" (``a, b`` in 1..9)
    answered by one ``write_file`` call, with no system prompt and only the ``write_file`` tool --
    what the reference agent sends with ``--reference-tools write_file --reference-system-prompt ''``
    on ``examples/tasks/toy/tasks.jsonl``.

    ``exclude``: instructions to leave out (the RL training queries: the warm-start teaches the
    format on *other* sums, so RL starts above 0 but below 1).
    """
    skip = {(int(m.group(1)), int(m.group(2))) for t in exclude if (m := re.fullmatch(TOY_SUM_RE, t.strip()))}
    return [_answer_file_example(f"What is {a}+{b}? Write the result to answer.txt", str(a + b))
            for a in range(1, 10) for b in range(1, 10) if (a, b) not in skip]


TOY_LARGEST_RE = r"What is the largest of ([1-9](?: [1-9])*)\? Write the result to answer\.txt"


def toy_largest_examples(exclude: Sequence[str] = (), n: int = 400, seed: int = 0) -> list[Example]:
    """Built-in set ``toy-largest``: ``n`` conversations "What is the largest of d1 d2 d3 d4 d5?
    Write the result to answer.txt" (random digits 1..9, seeded) answered by one ``write_file`` call
    whose content is a *randomly chosen listed digit* -- a format-only warm-start: the policy
    learns the tool call and to answer with one of the digits, not which one (RL's job on
    ``examples/tasks/toy/largest.tasks.jsonl``, whose lists each hold a 9: a start near 1/5).

    ``exclude``: instructions to leave out (the RL queries).

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    skip = {m.group(1) for t in exclude if (m := re.fullmatch(TOY_LARGEST_RE, t.strip()))}
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        digits = [rng.randint(1, 9) for _ in range(5)]
        listed = " ".join(map(str, digits))
        if listed not in skip:
            out.append(_answer_file_example(f"What is the largest of {listed}? Write the result to answer.txt",
                                            str(rng.choice(digits))))
    return out


BUILTIN_EXAMPLES = {"tool-loop": tool_loop_examples, "toy-sums": toy_sum_examples,
                    "toy-largest": toy_largest_examples}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.error = lambda msg: p.exit(2, f"{p.prog}: error: {msg}\n")
    p.add_argument("--out", required=True)
    p.add_argument("--model-dir", default=None)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--examples", default=None, help="JSONL file of conversations")
    src.add_argument("--builtin", choices=("tool-loop", "toy-sums", "toy-largest"), default=None)
    p.add_argument("--exclude-tasks", default=None,
                   help="Task file whose instructions the examples leave out (toy-sums, toy-largest: the RL queries).")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.steps < 1 or a.lr <= 0:
        p.error("--steps must be >= 1 and --lr > 0")

    from gyre.embedded_model import ensure_tiny_model, load_hf_model, load_tokenizer
    from gyre.training.warmstart import load_examples, sft

    try:
        exclude = []
        if a.exclude_tasks:
            from gyre.tasks import load_tasks

            exclude = [t.instruction for t in load_tasks(a.exclude_tasks).tasks]
        if a.builtin == "toy-sums":
            examples = BUILTIN_EXAMPLES[a.builtin](exclude)
        elif a.builtin == "toy-largest":
            examples = BUILTIN_EXAMPLES[a.builtin](exclude, seed=a.seed)
        else:
            examples = BUILTIN_EXAMPLES[a.builtin]() if a.builtin else load_examples(a.examples)
        src_dir = Path(a.model_dir) if a.model_dir else ensure_tiny_model("local")
        model, tok = load_hf_model(src_dir), load_tokenizer(src_dir)
        losses = sft(model, tok, examples, steps=a.steps, lr=a.lr, batch_size=a.batch_size, seed=a.seed)
    except (OSError, ValueError) as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    for f in ("generation_config.json", "gyre_model.json"):
        if (src_dir / f).exists():
            shutil.copy(src_dir / f, out / f)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps", file=sys.stderr)
    print(json.dumps({"model_dir": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
