"""The proxy's settings: :class:`ProxyConfig` (read by :class:`~gyre.proxy.server.ProxyServer`, the
main job and ``tools/serve_rollout.py``)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.proxy.request_body import RequestLimits, limits_from_args

_LIMITS = RequestLimits()  # the request limits' defaults, stated once (in RequestLimits)

__all__ = ["ProxyConfig"]


@dataclass(slots=True)
class ProxyConfig:
    """Proxy settings.

    * ``model_name`` -- name listed by ``/v1/models``.
    * ``default_max_tokens`` -- ``max_new_tokens`` when a request gives none (tokens).
    * ``max_tokens_cap`` -- upper bound on every call's ``max_new_tokens`` (tokens): a request
      asking for more gets the cap, and its record's metadata says so (``max_tokens_capped``:
      ``{"requested", "applied", "by"}``). The main job and ``serve_rollout`` set it (and
      ``default_max_tokens``) from ``--rollout-max-new-tokens``.
    * ``max_context_tokens`` -- prompt + output limit (tokens); longer prompts get 400
      ``"prompt is too long"`` (the phrase harnesses react to by compacting), and a call's
      output is cut to the room the prompt leaves (``by: "context"``). The main job and
      ``serve_rollout`` set it from ``--rollout-max-context-tokens``.
    * ``restore_reasoning`` -- see :class:`~gyre.proxy.tito.TitoSession`.
    * ``retry_timeout_s`` -- give up a generation after this long (seconds) -> 503/529.
    * ``kv_migration`` -- a request retried on another engine first copies its input's KV there,
      and an execution's context follows every route change (:class:`~gyre.proxy.router.Router`;
      engines that move KV payloads only); ``kv_transport`` -- ``"mooncake"`` (engine to engine,
      HTTP as the fallback) or ``"http"`` (through the proxy).
    * ``delivery_timeout_s`` -- how long a finished stream may take to be sent (seconds).
    * ``retry_memory_bytes`` -- the answers of committed calls kept for client retries (the last
      4 calls of each execution, :mod:`gyre.proxy.retries`), all executions together, at most
      (bytes); beyond it the oldest are forgotten. The default holds 1,152 executions x 4 calls
      of 2,000-token answers in the costliest mode (Responses, streamed) twice over (what
      ``bench/retry_memory.py`` measured is in docs/proxy.md).
    * ``sse_ping_s`` -- SSE keep-alive comment interval (seconds).
    * ``stream_hold_s`` -- how long a streamed call waits for the engine's first output before
      the response starts (seconds): an engine refusal or a failure within that time is
      answered with its HTTP status instead of a 200 stream that ends in an error event.
    * ``admin_token`` -- bearer token required on ``/gyre/*`` (``None``: open, for 127.0.0.1).
    * ``policy_version`` -- fallback version when engines report none.
    * ``default_sampling`` -- SGLang sampling params used when a request leaves them unset
      (e.g. ``{"temperature": 1.0}``); ``forced_sampling`` -- params that override the request.
    * ``durability`` -- when a call's record counts as stored (it always is before the response
      completes): ``"flush"`` (default) once written to the OS -- it survives a crash of the
      process; files are fsynced every ``fsync_interval_s`` seconds in the background -- or
      ``"fsync"``: fsynced too (group commit, :class:`~gyre.proxy.recorder.RecordSink`), which
      adds a disk sync to every call's latency. Give the server a store with ``fsync_every=0``.
    * ``max_body_bytes`` -- the largest model-call body (bytes), as declared, as received and after
      gzip/deflate decoding (413); ``max_json_depth`` -- nesting of its arrays and objects;
      ``max_messages``, ``max_tools``, ``max_tool_results`` (in one turn) -- per request (400).
      Sized from the paper's workload: a 1M-token conversation is 4-6 MB of JSON, a harness
      session of hundreds of calls a few thousand messages (:mod:`gyre.proxy.request_body`).
    * ``body_check_bytes`` -- a model-call body at least this large (after decoding) is checked in a
      helper process before the proxy parses it (:mod:`gyre.proxy.body_check`); 0 turns that off.
    * ``gc_freeze_after_ms`` -- after a full garbage collection at least this long (ms), the
      objects that survived it are frozen (:mod:`gyre.proxy.gc_policy`; ``None``: never);
      ``gc_unfreeze_interval_s`` -- how often they are handed back to the collector;
      ``heap_trim_interval_s`` -- how often the C heap's free pages go back to the operating
      system (:class:`~gyre.proxy.gc_policy.HeapTrimmer`; ``None``: never);
      ``malloc_arena_max`` -- the most C heap arenas of the threads started afterwards
      (:func:`~gyre.proxy.gc_policy.limit_malloc_arenas`, glibc only; ``None``: glibc's default,
      eight per core). The first server of a process sets them for the whole process.
    """

    model_name: str = "gyre"
    default_max_tokens: int = 1024
    max_tokens_cap: int = 32768
    max_context_tokens: int = 131072
    restore_reasoning: bool = True
    retry_timeout_s: float = 600.0
    kv_migration: bool = False
    kv_transport: str = "mooncake"
    delivery_timeout_s: float = 300.0
    retry_memory_bytes: int = 512 << 20
    sse_ping_s: float = 15.0
    stream_hold_s: float = 30.0
    admin_token: str | None = None
    policy_version: int = 0
    default_sampling: dict[str, Any] = field(default_factory=dict)
    forced_sampling: dict[str, Any] = field(default_factory=dict)
    durability: str = "flush"
    fsync_interval_s: float = 1.0
    max_body_bytes: int = _LIMITS.max_body_bytes
    max_json_depth: int = _LIMITS.max_json_depth
    max_messages: int = _LIMITS.max_messages
    max_tools: int = _LIMITS.max_tools
    max_tool_results: int = _LIMITS.max_tool_results
    body_check_bytes: int = 8 << 20
    gc_freeze_after_ms: float | None = 20.0
    gc_unfreeze_interval_s: float = 1800.0
    heap_trim_interval_s: float | None = 60.0
    malloc_arena_max: int | None = 1

    @classmethod
    def from_args(cls, args: Any, model_dir: Any) -> "ProxyConfig":
        """The settings of Gyre's parsed flags (:mod:`gyre.arguments`) for the model in ``model_dir``;
        the main job and ``serve_rollout`` both build their proxy's settings here.

        ``--rollout-max-new-tokens`` sets ``default_max_tokens`` and ``max_tokens_cap``;
        ``--rollout-temperature`` and ``--rollout-top-p`` the ``default_sampling``;
        ``--rollout-kv-migration`` and ``--rollout-kv-transport`` the KV moves; ``--admin-token``
        and the ``--proxy-max-*`` request limits their fields.  ``max_context_tokens`` is
        ``--rollout-max-context-tokens``, else the ``max_position_embeddings`` of
        ``model_dir/config.json`` (``--seq-length`` when the file or the key is missing), at most
        ``--seq-length``.  ``model_name`` is ``"gyre-policy"`` (the model Gyre's harnesses ask
        for); every other field keeps its default.
        """
        try:
            positions = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
        except (OSError, ValueError):
            positions = None
        if not isinstance(positions, int) or positions < 1:
            positions = args.seq_length
        return cls(model_name="gyre-policy", default_max_tokens=args.rollout_max_new_tokens,
                   max_tokens_cap=args.rollout_max_new_tokens,
                   max_context_tokens=args.rollout_max_context_tokens or min(positions, args.seq_length),
                   admin_token=args.admin_token,
                   default_sampling={"temperature": args.rollout_temperature, "top_p": args.rollout_top_p},
                   kv_migration=args.rollout_kv_migration, kv_transport=args.rollout_kv_transport,
                   ).with_limits(limits_from_args(args))

    def request_limits(self) -> RequestLimits:
        """The per-request limits of these settings."""
        return RequestLimits(self.max_body_bytes, self.max_json_depth, self.max_messages, self.max_tools,
                             self.max_tool_results)

    def with_limits(self, limits: RequestLimits) -> "ProxyConfig":
        """These settings with the per-request limits of ``limits``."""
        return dataclasses.replace(self, **dataclasses.asdict(limits))
