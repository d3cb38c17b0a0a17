"""Supervised format warm-start of a (tiny) policy on chat conversations.

A randomly initialised model never emits EOS or a valid tool call; a short supervised training on
format examples makes it a usable test policy and a sensible RL start. Each conversation is
rendered with the model's own chat template (incrementally, message by message, so the token
boundaries are the ones the proxy produces); the loss covers the assistant messages only (mean
next-token cross-entropy over those tokens). Optimizer: AdamW. ``tools/warmstart.py`` is the
command line and holds the built-in example sets.
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
    kicking a tiny model out of the minimum it found).

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
