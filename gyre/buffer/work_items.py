"""Work items: the unit a training cell claims from a step's micro-step stream.

A GSPO sequence ratio needs every target of an execution, so the micro-steps of an execution that
the packer split across several micro-steps form one *work item*, processed by one cell (the
forward-only log-ratio pass sees the whole execution).  Other micro-steps are work items of one.
Work items travel through the stream as ``uint8`` tensors of their pickled micro-steps.
"""

from __future__ import annotations

import pickle
from typing import Any, Sequence

import numpy as np
import torch


def work_items(micro_steps: Sequence[Any]) -> list[list[Any]]:
    """Group micro-steps that share a split execution (union-find), keeping their order."""
    parent = list(range(len(micro_steps)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[str, int] = {}
    for i, ms in enumerate(micro_steps):
        for e in np.flatnonzero(ms.split):
            eid = ms.execution_ids[e]
            if eid in first:
                parent[find(i)] = find(first[eid])
            else:
                first[eid] = i
    items: dict[int, list[Any]] = {}
    for i, ms in enumerate(micro_steps):
        items.setdefault(find(i), []).append(ms)
    return list(items.values())


def encode_work_item(micro_steps: Sequence[Any]) -> torch.Tensor:
    """A work item as a ``uint8`` tensor (the stream's payloads are ``torch.save``-d tensors)."""
    return torch.frombuffer(bytearray(pickle.dumps(list(micro_steps))), dtype=torch.uint8)


def decode_work_item(payload: torch.Tensor) -> list[Any]:
    """Inverse of :func:`encode_work_item`."""
    return pickle.loads(payload.numpy().tobytes())
