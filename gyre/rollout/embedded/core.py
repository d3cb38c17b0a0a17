"""The embedded engine's continuous-batching core: deterministic, single-threaded, no I/O.

:class:`EngineCore` owns the waiting queue, the running batch (one KV *slot* per running
sequence, slots ``0..B-1`` kept contiguous), the prefix cache, stop conditions, abort / pause /
weight-update / memory state and the weight version.  The model is behind the small
:class:`ModelRunner` protocol (the HF implementation is ``gyre/rollout/embedded/model_runner.py``; tests
use a fake), randomness is per-sequence ``torch.Generator`` and time is an injected clock, so
a script of calls always produces the same outputs.

Each :meth:`EngineCore.step` admits and prefills waiting sequences, decodes every running
sequence by one token and retires finished ones; :meth:`EngineCore.begin_weight_update` and
:meth:`EngineCore.finish_weight_update` bracket a weight swap.  Upstream analogue: SGLang
``managers/scheduler.py`` (``get_next_batch_to_run``: prefill new requests, then decode the
running batch) and ``schedule_batch.py`` (``Req.check_finished``).
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from gyre.common_prefix import common_prefix_len
from gyre.rollout.api.sglang_api import (
    MEMORY_TAGS,
    PAUSE_MODES,
    ProtocolError,
    SamplingParams,
    SeqOutput,
    SeqSpec,
    finish_abort,
    finish_length,
    finish_stop,
)
from gyre.rollout.embedded.prefix_cache import RadixPrefixCache
from gyre.rollout.embedded.sampling import sample_next_tokens


class ModelRunner(Protocol):
    """What the core needs from a model with slot-indexed KV storage.

    Slots are rows ``0..S-1`` of the KV store; positions are token indices within a sequence.
    Payloads returned by :meth:`read_kv` are opaque to the core (stored in the prefix cache).
    """

    vocab_size: int
    context_len: int

    def prefill(self, slot: int, token_ids: Sequence[int], start: int) -> None:
        """Compute and store KV of ``token_ids`` at positions ``start..start+n-1`` of ``slot``
        (positions ``< start`` must already hold the sequence's KV)."""

    def decode(self, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Feed token ``b`` at ``positions[b]`` of slot ``b`` for ``b < B`` (storing its KV);
        return next-token logits ``[B, V]`` fp32."""

    def read_kv(self, slot: int, start: int, end: int) -> Any:
        """Copy of the KV of positions ``[start, end)`` of ``slot``."""

    def write_kv(self, slot: int, start: int, pieces: Sequence[Any]) -> None:
        """Write consecutive payloads into ``slot`` from position ``start``."""

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""

    def slice_kv(self, payload: Any, start: int, end: int) -> Any:
        """Positions ``[start, end)`` of a payload."""


@dataclass(slots=True, eq=False)
class Seq:
    """Mutable state of one sequence inside the core (engine thread only)."""

    spec: SeqSpec
    sink: Callable[[SeqOutput], None] | None
    generator: torch.Generator
    version: str
    created: float
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    slot: int = -1
    kv_len: int = 0
    cached_tokens: int = 0
    epoch: int = -1
    started: bool = False
    emitted: int = 0
    finish_reason: dict[str, Any] | None = None

    @property
    def rid(self) -> str:
        return self.spec.rid

    @property
    def params(self) -> SamplingParams:
        return self.spec.params

    def tokens(self) -> list[int]:
        return self.spec.input_ids + self.output_ids

    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.spec.input_ids[-1]


@dataclass(slots=True)
class CoreConfig:
    """Scheduling knobs of :class:`EngineCore` (units: sequences, tokens)."""

    max_running_requests: int = 64
    max_prefill_tokens: int = 8192
    prefix_cache_tokens: int = 131072
    weight_version: str = "default"
    random_seed: int = 0


class EngineCore:
    """Continuous batching over a :class:`ModelRunner`.

    Args:
        runner: the model.
        config: scheduling knobs.
        eos_token_ids: ids that stop a sequence unless ``ignore_eos``.
        decode_tail: ``ids -> text`` used for stop-string checks (``None``: stop strings never match).
        clock: seconds, monotonic (for ``e2e_latency``).
    """

    def __init__(self, runner: ModelRunner, config: CoreConfig | None = None, *,
                 eos_token_ids: Sequence[int] = (),
                 decode_tail: Callable[[list[int]], str] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.runner = runner
        self.config = config or CoreConfig()
        if self.config.max_running_requests < 1 or self.config.max_prefill_tokens < 1:
            raise ValueError("max_running_requests and max_prefill_tokens must be >= 1")
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.decode_tail = decode_tail
        self.clock = clock
        self.cache: RadixPrefixCache[Any] = RadixPrefixCache(self.config.prefix_cache_tokens, runner.slice_kv)
        self.version = self.config.weight_version
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.by_rid: dict[str, Seq] = {}
        self.paused: str | None = None          # None or the pause mode
        self.released: set[str] = set()         # memory tags released
        self.update_pending = False
        self._seed_rng = random.Random(self.config.random_seed)
        self._outbox: list[tuple[Seq, SeqOutput]] = []
        self.num_steps = 0
        self.num_decode_tokens = 0
        self.num_prefill_tokens = 0

    # ------------------------------------------------------------------ requests

    def add(self, specs: Sequence[SeqSpec], sink: Callable[[SeqOutput], None] | None = None) -> list[Seq]:
        """Queue sequences (all or none).

        Raises:
            ProtocolError: a ``rid`` is already in use, or a prompt does not fit the context.
        """
        for s in specs:
            if s.rid in self.by_rid:
                raise ProtocolError(f"rid {s.rid!r} is already in use by a running request")
            if len(s.input_ids) >= self.runner.context_len:
                raise ProtocolError(f"input has {len(s.input_ids)} tokens; context length is {self.runner.context_len}")
        if len({s.rid for s in specs}) != len(specs):
            raise ProtocolError("duplicate rid in one request")
        now = self.clock()
        out = []
        for s in specs:
            seed = s.seed if s.seed is not None else self._seed_rng.getrandbits(63)
            gen = torch.Generator().manual_seed(seed % (1 << 63))
            seq = Seq(spec=s, sink=sink, generator=gen, version=self.version, created=now)
            self.by_rid[s.rid] = seq
            if s.params.max_new_tokens == 0:
                self._finish(seq, finish_length(0))
            else:
                self.waiting.append(seq)
            out.append(seq)
        return out

    def abort(self, rid: str | None = None, *, abort_all: bool = False,
              message: str = "aborted by request") -> list[str]:
        """Abort waiting or running sequences whose ``rid`` or request ``rid`` matches.

        Returns:
            The aborted sequence ids (empty when nothing matched).
        """
        victims = [s for s in list(self.waiting) + list(self.running)
                   if abort_all or s.rid == rid or s.spec.group_rid == rid]
        self._abort(victims, message)
        return [s.rid for s in victims]

    def _abort(self, victims: Sequence[Seq], message: str) -> None:
        if not victims:
            return
        vset = set(victims)
        self.waiting = deque(s for s in self.waiting if s not in vset)
        running = [s for s in victims if s.slot >= 0]
        for s in victims:
            s.finish_reason = finish_abort(message)
        self._retire(running)
        for s in victims:
            if s.slot < 0 and s.rid in self.by_rid:
                self._finish(s, s.finish_reason)

    # ------------------------------------------------------------------ control

    def pause(self, mode: str) -> list[str]:
        """``abort``: abort everything, then pause; ``in_place``: freeze the batch with its KV;
        ``retract``: move running sequences back to the queue (their KV goes to the prefix
        cache, so resuming recomputes little).  New requests queue while paused.

        Returns:
            Aborted (``abort``) or retracted (``retract``) sequence ids.
        Raises:
            ProtocolError: unknown mode.
        """
        if mode not in PAUSE_MODES:
            raise ProtocolError(f"unknown pause mode {mode!r}")
        affected: list[str] = []
        if mode == "abort":
            affected = self.abort(abort_all=True, message="aborted by pause_generation")
        elif mode == "retract":
            affected = [s.rid for s in self.running]
            retracted = list(self.running)
            self._retire(retracted, keep=True)
            self.waiting.extendleft(reversed(retracted))
        self.paused = mode
        return affected

    def continue_generation(self) -> None:
        """Undo :meth:`pause`."""
        self.paused = None

    def export_prefix(self, token_ids: Sequence[int]) -> tuple[int, Any]:
        """The KV of the longest prefix of ``token_ids`` this engine holds -- in its prefix cache or
        in a running sequence's slot (its partial output included) -- as ``(m, kv)``: ``m`` tokens
        and a copy of their KV (``None`` when ``m == 0``)."""
        m, pieces = self.cache.match(token_ids, count=False)
        best = None
        for s in self.running:
            n = common_prefix_len(s.tokens()[: s.kv_len], token_ids)
            if n > m:
                m, best = n, s
        if best is not None:
            return m, self.runner.read_kv(best.slot, 0, m)
        return m, (torch.cat(pieces, dim=3) if m else None)

    def import_prefix(self, token_ids: Sequence[int], kv: Any) -> int:
        """Store ``kv`` (the KV of ``token_ids``, computed under this engine's current weights: the
        caller checks) in the prefix cache; returns the tokens newly stored.

        Raises:
            ProtocolError: the KV cache is released.
        """
        if "kv_cache" in self.released:
            raise ProtocolError("the KV cache is released; resume_memory_occupation first")
        return self.cache.insert(list(token_ids), lambda a, b: self.runner.slice_kv(kv, a, b).clone())

    def flush_cache(self) -> None:
        """Drop the prefix cache (running sequences keep their own KV)."""
        self.cache.flush()

    def release(self, tags: Sequence[str]) -> None:
        """Mark memory released; the caller frees it.  Nothing is admitted until :meth:`resume`.

        Raises:
            ProtocolError: sequences are running (pause with ``mode=abort``/``retract`` first).
        """
        if self.running:
            raise ProtocolError(f"{len(self.running)} requests are running; pause_generation "
                                "(mode abort or retract) before releasing memory")
        if "kv_cache" in tags:
            self.cache.flush()
        self.released |= set(t for t in tags if t in MEMORY_TAGS)

    def resume(self, tags: Sequence[str]) -> None:
        """Mark memory resumed."""
        self.released -= set(tags)

    def begin_weight_update(self, abort: bool) -> list[str]:
        """Stop admission before a weight swap.

        By default in-flight sequences *finish on the old weights*: admission stops, the running
        batch drains, then the caller swaps the weights and calls :meth:`finish_weight_update`,
        which flushes the prefix cache and changes the version.  Every output carries the
        version it was computed with (constant per sequence).  With ``abort`` (SGLang
        ``abort_all_requests``) running sequences are aborted instead (``finish_reason.type ==
        "abort"``, labelled with the old version).  Sequences that hold old tokens but cannot
        run (paused in place, or retracted) are always aborted.  Waiting sequences that have not
        started are kept and served on the new weights.

        Returns:
            Ids of sequences aborted because of the update.
        """
        victims = [s for s in self.waiting if s.started]      # retracted: hold old-version tokens
        if abort or self.paused is not None:
            victims += list(self.running)
        self._abort(victims, "aborted: weight update")
        self.update_pending = True
        return [s.rid for s in victims]

    def ready_for_weight_update(self) -> bool:
        """True once no sequence computed with the old weights is still running."""
        return self.update_pending and not self.running

    def finish_weight_update(self, version: str | None) -> None:
        """Weights were swapped: flush the prefix cache, set the version, resume admission."""
        self.cache.flush()
        if version is not None:
            self.version = version
        self.update_pending = False

    def cancel_weight_update(self) -> None:
        """The swap failed (weights unchanged): resume admission, keep cache and version."""
        self.update_pending = False

    # ------------------------------------------------------------------ stepping

    def has_work(self) -> bool:
        """Whether :meth:`step` would do anything."""
        if self.paused is not None or self.released:
            return False
        return bool(self.running) or (bool(self.waiting) and not self.update_pending)

    def step(self) -> list[tuple[Seq, SeqOutput]]:
        """Admit, decode once, retire; return the emitted outputs.

        1. **Admission** (not paused, no memory released, no weight update pending): while a
           slot is free and the prefill budget (``max_prefill_tokens``) allows, take the oldest
           waiting sequence, look up the longest cached prefix of its tokens, copy that KV into
           its slot and prefill the rest *except the last token*; then store the prompt's KV in
           the prefix cache so parallel samples and later calls share it.
        2. **Decode**: one batched forward of every running sequence's last token at its own
           position (left-over columns are masked), sample per sequence, append, check stops.
        3. **Retire** finished sequences: store their KV in the prefix cache (only if computed
           under the current weights and cache epoch), free the slot (the last slot moves into
           the hole).
        """
        if not self.has_work():
            return self.drain_outputs()
        self.num_steps += 1
        if not self.update_pending:
            self._admit()
        if self.running:
            self._decode()
        return self.drain_outputs()

    def _admit(self) -> None:
        budget = self.config.max_prefill_tokens
        admitted = 0
        while self.waiting and len(self.running) < self.config.max_running_requests:
            seq = self.waiting[0]
            tokens = seq.tokens()
            need = len(tokens) - 1
            m, pieces = self.cache.match(tokens[:need]) if need > 0 else (0, [])
            cost = need - m
            if admitted and cost > budget:
                break
            self.waiting.popleft()
            slot = len(self.running)
            if m:
                self.runner.write_kv(slot, 0, pieces)
            if cost:
                self.runner.prefill(slot, tokens[m:need], m)
                self.num_prefill_tokens += cost
            seq.slot, seq.kv_len, seq.epoch = slot, need, self.cache.epoch
            if not seq.started:
                seq.cached_tokens = m
                seq.started = True
                seq.version = self.version
            self.running.append(seq)
            if cost:
                self.cache.insert(tokens[:need], lambda a, b, s=slot: self.runner.read_kv(s, a, b))
            budget -= cost
            admitted += 1

    def _decode(self) -> None:
        run = self.running
        logits = self.runner.decode([s.last_token() for s in run], [s.kv_len for s in run])
        for s in run:
            s.kv_len += 1
        banned = []
        for s in run:
            p = s.params
            if not p.ignore_eos and len(s.output_ids) < p.min_new_tokens:
                banned.append(sorted(self.eos_token_ids | set(p.stop_token_ids)))
            else:
                banned.append(None)
        res = sample_next_tokens(logits, [s.params for s in run], [s.generator for s in run], banned=banned,
                                 top_logprobs_num=[s.spec.top_logprobs_num for s in run])
        self.num_decode_tokens += len(run)
        done: list[Seq] = []
        for i, s in enumerate(run):
            tok = res.token_ids[i]
            s.output_ids.append(tok)
            s.logprobs.append(res.logprobs[i])
            if res.top_logprobs[i] is not None:
                s.top_logprobs.append(res.top_logprobs[i])
            reason = self._check_finish(s, tok)
            if reason is not None:
                s.finish_reason = reason
                done.append(s)
            elif s.spec.stream:
                self._emit(s)
        self._retire(done)

    def _check_finish(self, s: Seq, tok: int) -> dict[str, Any] | None:
        """SGLang order: length cap, then stop token, then stop string, then context length."""
        p = s.params
        n = len(s.output_ids)
        if n >= p.max_new_tokens:
            return finish_length(n)
        if not p.ignore_eos and (tok in self.eos_token_ids or tok in p.stop_token_ids):
            return finish_stop(tok)
        if p.stop and self.decode_tail is not None:
            width = max(len(x) for x in p.stop) + 1
            tail = self.decode_tail(s.output_ids[-width:])
            for x in p.stop:
                if x in tail:
                    return finish_stop(x)
        if len(s.spec.input_ids) + n >= self.runner.context_len:
            return finish_length(n)
        return None

    def _retire(self, seqs: Sequence[Seq], keep: bool = False) -> None:
        """Free the slots of ``seqs`` (store their KV first); finish them unless ``keep``."""
        for s in sorted(seqs, key=lambda x: x.slot, reverse=True):
            if s.slot < 0:
                continue
            if s.epoch == self.cache.epoch and s.version == self.version and s.kv_len > 0:
                toks = s.tokens()[: s.kv_len]
                slot = s.slot
                self.cache.insert(toks, lambda a, b, sl=slot: self.runner.read_kv(sl, a, b))
            last = len(self.running) - 1
            if s.slot != last:
                mover = self.running[last]
                self.runner.move_slot(last, s.slot, mover.kv_len)
                mover.slot = s.slot
                self.running[s.slot] = mover
            self.running.pop()
            s.slot = -1
            s.kv_len = 0
            if not keep:
                self._finish(s, s.finish_reason)

    def _finish(self, s: Seq, reason: dict[str, Any] | None) -> None:
        s.finish_reason = reason
        if not s.started:
            s.version = self.version
        self.by_rid.pop(s.rid, None)
        self._emit(s)

    def _emit(self, s: Seq) -> None:
        k = s.emitted
        out = SeqOutput(
            rid=s.rid, index=s.spec.index, new_token_ids=s.output_ids[k:], new_logprobs=s.logprobs[k:],
            new_top_logprobs=s.top_logprobs[k:] if s.spec.top_logprobs_num else None,
            finish_reason=s.finish_reason, prompt_tokens=len(s.spec.input_ids),
            completion_tokens=len(s.output_ids), cached_tokens=s.cached_tokens, weight_version=s.version,
            e2e_latency=(self.clock() - s.created) if s.finish_reason is not None else None)
        s.emitted = len(s.output_ids)
        self._outbox.append((s, out))

    def drain_outputs(self) -> list[tuple[Seq, SeqOutput]]:
        """Outputs emitted since the last call, in emission order."""
        out, self._outbox = self._outbox, []
        return out

    def stats(self) -> dict[str, Any]:
        """Counters for ``/get_server_info`` (``internal_states``)."""
        return {
            "num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
            "paused": self.paused, "memory_released": sorted(self.released),
            "weight_update_pending": self.update_pending, "weight_version": self.version,
            "prefix_cache_tokens": self.cache.total_tokens, "prefix_cache_epoch": self.cache.epoch,
            "prefix_cache_hit_tokens": self.cache.hit_tokens, "num_steps": self.num_steps,
            "num_decode_tokens": self.num_decode_tokens, "num_prefill_tokens": self.num_prefill_tokens,
        }
