"""The embedded CPU rollout engine: a torch causal LM driven by one engine thread.

:class:`EmbeddedEngine` owns the model (:class:`~gyre.rollout.embedded.model_runner.HFModelRunner`),
the tokenizer and a :class:`~gyre.rollout.embedded.core.EngineCore` (continuous batching, prefix cache,
stop conditions, pause / abort / weight-update policy).  A single engine thread runs core steps;
every state change -- :meth:`EmbeddedEngine.call` with a function of the core, or
:meth:`EmbeddedEngine.update_weights` -- is queued and executed on that thread between two
steps, and the caller gets a ``concurrent.futures.Future``.  Each step's outputs are handed to
the per-sequence sinks the requests registered.

Weight updates: requests already running finish on the old weights and carry the old
``weight_version`` while new requests wait for the swap, unless the update aborts them; the
prefix cache is always flushed on a weight change.  Weights may come in buckets: every update but
the last passes ``flush_cache=false``; from the first bucket to the last the engine admits nothing
(the prefix cache still holds KV of the old weights and the model is partly updated), and the last
(``flush_cache`` true) flushes the cache, sets the version and resumes admission -- so no request
ever runs on partly updated weights.  A model error during a step aborts every waiting and running
request and the engine keeps serving.

:mod:`gyre.rollout.embedded.server` puts this engine behind SGLang's native HTTP API.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from gyre.rollout.api.sglang_api import ProtocolError, SeqOutput
from gyre.rollout.client.sglang_protocol import EMBEDDED_ENGINE as ENGINE_NAME  # what /server_info says
from gyre.rollout.embedded.config import PREFIX_CACHE_DEFAULT_BYTES, EngineConfig
from gyre.rollout.embedded.core import CoreConfig, EngineCore, Seq
from gyre.rollout.embedded.model_runner import HFModelRunner, load_model_dir

logger = logging.getLogger(__name__)


class _Command:
    __slots__ = ("fn", "future")

    def __init__(self, fn: Callable[[EngineCore], Any]):
        self.fn = fn
        self.future: concurrent.futures.Future = concurrent.futures.Future()


class _Update:
    __slots__ = ("named", "source", "version", "abort", "flush", "future", "aborted")

    def __init__(self, named, source, version, abort, flush=True):
        self.named, self.source, self.version, self.abort, self.flush = named, source, version, abort, flush
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.aborted: list[str] = []


_STOP = object()


class EmbeddedEngine:
    """Model, tokenizer, :class:`EngineCore` and the engine thread (see module docstring).

    Every method that changes state is executed on the engine thread between two steps and
    returns a ``concurrent.futures.Future`` (exceptions: :class:`ProtocolError`,
    :class:`WeightError` -> HTTP 400).
    """

    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.model_dir is None:
            from gyre.embedded_model import ensure_tiny_model

            config.model_dir = str(ensure_tiny_model("local"))
        self.model_path = str(config.model_dir)
        self.tokenizer_path = str(config.tokenizer_dir or config.model_dir)
        model = load_model_dir(self.model_path).to(config.device)
        self.runner = HFModelRunner(model, source_dir=self.model_path, context_len=config.context_length,
                                    max_slots=config.max_running_requests,
                                    prefill_chunk_tokens=config.prefill_chunk_tokens)
        self.tokenizer = self._load_tokenizer(self.tokenizer_path)
        self.prefix_cache_tokens = (config.prefix_cache_tokens if config.prefix_cache_tokens is not None
                                    else PREFIX_CACHE_DEFAULT_BYTES // self.runner.kv_bytes_per_token)
        self.eos_token_ids = self._eos_ids(model)
        self.core = EngineCore(
            self.runner,
            CoreConfig(max_running_requests=config.max_running_requests,
                       max_prefill_tokens=config.max_prefill_tokens,
                       prefix_cache_tokens=self.prefix_cache_tokens,
                       weight_version=config.weight_version, random_seed=config.random_seed),
            eos_token_ids=self.eos_token_ids,
            decode_tail=(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False))
            if self.tokenizer is not None else None)
        self._queue: queue.Queue = queue.Queue()
        self._updates: list[_Update] = []
        self._thread = threading.Thread(target=self._run, name="gyre-engine", daemon=True)
        self._stopped = threading.Event()

    # ------------------------------------------------------------------ setup

    @staticmethod
    def _load_tokenizer(path: str):
        if not (Path(path) / "tokenizer.json").exists() and not (Path(path) / "tokenizer_config.json").exists():
            return None
        from gyre.embedded_model import load_tokenizer

        return load_tokenizer(path)

    def _eos_ids(self, model) -> set[int]:
        ids: set[int] = set()

        def add(v):
            if isinstance(v, int):
                ids.add(v)
            elif isinstance(v, (list, tuple)):
                ids.update(int(x) for x in v)

        add(getattr(model.config, "eos_token_id", None))
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            add(getattr(gen, "eos_token_id", None))
        if self.tokenizer is not None:
            add(self.tokenizer.eos_token_id)
        return ids

    def tokenize(self, text: str) -> list[int]:
        """Text -> ids with no special tokens added (``ProtocolError`` without a tokenizer)."""
        if self.tokenizer is None:
            raise ProtocolError("this engine has no tokenizer; send input_ids")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text (``""`` without a tokenizer)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """Text of one token (for ``return_text_in_logprobs``)."""
        return self.decode([token_id], skip_special_tokens=False)

    # ------------------------------------------------------------------ thread

    def start(self) -> "EmbeddedEngine":
        """Start the engine thread."""
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything, stop the thread."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)
        self._stopped.set()

    def call(self, fn: Callable[[EngineCore], Any]) -> concurrent.futures.Future:
        """Run ``fn(core)`` on the engine thread between steps; its outputs are dispatched."""
        cmd = _Command(fn)
        if not self.alive:
            cmd.future.set_exception(RuntimeError("engine is stopped"))
            return cmd.future
        self._queue.put(cmd)
        return cmd.future

    def update_weights(self, named: dict[str, torch.Tensor], *, source: str | None, version: str | None,
                       abort: bool, flush: bool = True) -> concurrent.futures.Future:
        """Swap weights (see module docstring; ``flush=False``: a bucket, more follow); the future
        yields a result dict."""
        upd = _Update(named, source, version, abort, flush)
        if not self.alive:
            upd.future.set_exception(RuntimeError("engine is stopped"))
            return upd.future
        self._queue.put(upd)
        return upd.future

    def _run(self) -> None:
        core = self.core
        while True:
            idle = not core.has_work() and not (self._updates and core.ready_for_weight_update())
            try:
                item = self._queue.get(timeout=0.05) if idle else self._queue.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    self._shutdown_core()
                    return
                self._execute(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            self._progress_updates()
            if core.has_work():
                try:
                    outs = core.step()
                except Exception as exc:  # a model error must not kill the engine
                    logger.exception("engine step failed; aborting running requests")
                    core.abort(abort_all=True, message=f"engine error: {type(exc).__name__}: {exc}"[:300])
                    outs = core.drain_outputs()
                self._dispatch(outs)

    def _execute(self, item) -> None:
        if isinstance(item, _Update):
            self._updates.append(item)
            if len(self._updates) == 1:
                item.aborted = self.core.begin_weight_update(item.abort)
            self._dispatch(self.core.drain_outputs())
            return
        try:
            result = item.fn(self.core)
        except Exception as exc:
            item.future.set_exception(exc)
        else:
            item.future.set_result(result)
        self._dispatch(self.core.drain_outputs())

    def _progress_updates(self) -> None:
        core = self.core
        while self._updates and core.ready_for_weight_update():
            upd = self._updates.pop(0)
            try:
                self.runner.load_weights(upd.named, source_dir=upd.source)
            except Exception as exc:
                core.cancel_weight_update()
                upd.future.set_exception(exc)
            else:
                old = core.version
                if upd.flush:
                    core.finish_weight_update(upd.version)
                    note = f"weight version {core.version}."
                else:  # a bucket: admission stays stopped until the update that flushes
                    note = "admission held until an update with flush_cache."
                upd.future.set_result({"success": True, "weight_version": core.version, "previous_version": old,
                                       "num_aborted_requests": len(upd.aborted), "num_paused_requests": 0,
                                       "message": f"Weights updated ({len(upd.named)} tensors); {note}"})
            if self._updates:
                self._updates[0].aborted = core.begin_weight_update(self._updates[0].abort)
            self._dispatch(core.drain_outputs())

    def _shutdown_core(self) -> None:
        self.core.continue_generation()
        self.core.abort(abort_all=True, message="engine shutting down")
        self._dispatch(self.core.drain_outputs())
        for upd in self._updates:
            upd.future.set_exception(RuntimeError("engine shutting down"))
        self._updates.clear()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, (_Command, _Update)):
                item.future.set_exception(RuntimeError("engine shutting down"))
        self._stopped.set()

    @staticmethod
    def _dispatch(outs: Iterable[tuple[Seq, SeqOutput]]) -> None:
        for seq, out in outs:
            if seq.sink is not None:
                try:
                    seq.sink(out)
                except Exception:  # a closed event loop (client gone) must not stop the engine
                    logger.debug("dropping output for %s", seq.rid, exc_info=True)

    # ------------------------------------------------------------------ weights helpers

    def server_info(self) -> dict[str, Any]:
        """``/get_server_info`` body (configuration, version, internal state)."""
        from gyre import __version__

        info = dataclasses.asdict(self.config)
        info.update({"model_path": self.model_path, "tokenizer_path": self.tokenizer_path, "engine": ENGINE_NAME,
                     "version": __version__, "weight_version": self.core.version,
                     "context_length": self.runner.context_len, "vocab_size": self.runner.vocab_size,
                     "prefix_cache_tokens": self.prefix_cache_tokens,
                     "eos_token_ids": sorted(self.eos_token_ids)})
        return info
