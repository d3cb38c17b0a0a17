"""Supervised format warm-start of a (tiny) policy on chat conversations.

A randomly initialised model never emits EOS or a valid tool call (BACKENDS.md); a few seconds
of supervised training on format examples makes it a usable test policy and a sensible RL start.
Each conversation is rendered with the model's own chat template (incrementally, message by
message, so the token boundaries are the ones the proxy produces); the loss covers the assistant
messages only (mean next-token cross-entropy over those tokens).  Optimizer: AdamW.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch


@dataclass(frozen=True, slots=True)
class Example:
    """One training conversation: OpenAI-style ``messages`` and the ``tools`` offered."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


def render_example(tokenizer, ex: Example) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` with ``labels = -100`` outside assistant messages.

    Raises:
        ValueError: the template's rendering of a prefix is not a prefix of the next one.
    """
    ids: list[int] = []
    labels: list[int] = []
    for i, msg in enumerate(ex.messages):
        full = tokenizer.apply_chat_template(ex.messages[: i + 1], tools=ex.tools, tokenize=True,
                                             return_dict=False)
        if full[: len(ids)] != ids:
            raise ValueError(f"template rendering of message {i} does not extend the previous messages")
        new = full[len(ids):]
        if msg["role"] == "assistant":
            # the "<|im_start|>assistant\n" header is part of the prompt, not a target
            header = len(tokenizer.apply_chat_template(ex.messages[:i], tools=ex.tools, tokenize=True,
                                                       add_generation_prompt=True, return_dict=False)) - len(ids)
            labels += [-100] * header + new[header:]
        else:
            labels += [-100] * len(new)
        ids = full
    return ids, labels


def sft_lr_factor(i: int, steps: int, warmup_steps: int, min_lr_ratio: float = 0.1) -> float:
    """Multiplier of the peak lr for optimizer step ``i`` (0-based) of ``steps``: linear warm-up
    ``(i + 1) / warmup_steps`` for ``i < warmup_steps``, then cosine decay from 1 to
    ``min_lr_ratio`` at ``i = steps`` (Megatron's ``--lr-decay-style cosine`` with ``--min-lr``)."""
    if i < warmup_steps:
        return (i + 1) / warmup_steps
    frac = min((i - warmup_steps) / max(1, steps - warmup_steps), 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


def sft(model, tokenizer, examples: Sequence[Example], *, steps: int = 200, lr: float = 1e-3,
        batch_size: int = 4, seed: int = 0, weight_decay: float = 0.0, warmup_steps: int | None = None,
        min_lr_ratio: float = 0.1) -> list[float]:
    """Train ``model`` in place; returns the loss of every step.

    AdamW with Megatron's schedule: linear warm-up over ``warmup_steps`` (default: 5% of
    ``steps``), then cosine decay to ``min_lr_ratio * lr`` at the last step (a constant lr keeps
    kicking a tiny model out of the minimum it found: loss 0.10 at 200 steps, 0.51 at 1000).

    Raises:
        ValueError: no example has an assistant token.
    """
    rendered = [render_example(tokenizer, ex) for ex in examples]
    rendered = [r for r in rendered if any(t != -100 for t in r[1])]
    if not rendered:
        raise ValueError("no assistant tokens to train on")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    warm = max(1, steps // 20) if warmup_steps is None else max(1, warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: sft_lr_factor(i, steps, warm, min_lr_ratio))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model.train()
    losses = []
    for _ in range(steps):
        batch = [rendered[rng.randrange(len(rendered))] for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in batch)
        x = torch.full((len(batch), width), pad, dtype=torch.long)
        y = torch.full((len(batch), width), -100, dtype=torch.long)
        att = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (ids, lab) in enumerate(batch):
            x[i, : len(ids)] = torch.tensor(ids)
            y[i, : len(lab)] = torch.tensor(lab)
            att[i, : len(ids)] = 1
        logits = model(input_ids=x, attention_mask=att).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1),
                                                 ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def load_examples(path: str | Path) -> list[Example]:
    """JSONL of ``{"messages": [...], "tools": [...]}`` objects.

    Raises:
        ValueError: a line is not valid JSON or has no ``messages`` list (names the line).
    """
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
            raise ValueError(f"{path}:{n}: expected an object with a 'messages' list")
        out.append(Example(obj["messages"], obj.get("tools")))
    return out


def tool_loop_examples(max_prior_turns: int = 6) -> list[Example]:
    """Built-in set ``tool-loop``: the reference agent's prompt and tools, and an assistant that
    always answers with one ``bash`` call (``echo step``), whatever the number of earlier turns.

    A policy trained on it keeps a harness busy for as many turns as it allows: the test policy
    of the role-transition tests.
    """
    from gyre.harness.reference_agent.agent import DEFAULT_SYSTEM_PROMPT
    from gyre.harness.reference_agent.tools import TOOL_SCHEMAS

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

    return Example([{"role": "user", "content": question},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "call_0", "type": "function",
                         "function": {"name": "write_file", "arguments": {"path": "answer.txt", "content": content}}}]}],
                   [TOOL_SCHEMAS["write_file"]])


def toy_sum_examples(exclude: Sequence[str] = ()) -> list[Example]:
    """Built-in set ``toy-sums``: "What is a+b? Write the result to answer.txt" (``a, b`` in 1..9)
    answered by one ``write_file`` call, with no system prompt and only the ``write_file`` tool --
    what the reference agent sends with ``--reference-tools write_file --reference-system-prompt ''``
    on ``examples/tasks/toy/tasks.jsonl``.

    ``exclude``: instructions to leave out (the RL training queries: the warm-start teaches the
    format on *other* sums, so RL starts above 0 but below 1).
    """
    import re

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
    import re

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
