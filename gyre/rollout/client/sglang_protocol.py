"""What an SGLang server needs from Gyre, asked of the server itself rather than read from its
version number.

Gyre runs two generations of SGLang here (``tools/setup_sglang.sh``) and reads both sources:

* **0.5.10.post1** -- weight updates are single calls; ``/flush_cache`` answers 400 while a
  paused (``retract``) request waits; ``/get_load`` and ``/clear_hicache_storage_backend`` exist.
* **0.5.23** -- every ``/update_weights_from_tensor`` and ``/update_weights_from_distributed``
  must sit inside a weight-update session (``POST /begin_weight_update`` ...
  ``POST /end_weight_update``; outside one it answers 400, and the distributed call answers
  before it joins the broadcast), a ``retract``-paused server may flush, ``meta_info`` carries
  per-token ``weight_versions``, and ``/get_load``, ``/get_weight_version`` and
  ``/clear_hicache_storage_backend`` are gone.

:func:`probe_weight_update_sessions` tells the two apart by the capability: ``POST
/end_weight_update`` answers 400 ("no weight-update session is open") on a server with sessions
and 404 on one without (an older SGLang, the embedded engine).  So a development build
(``0.0.0.dev0``), a release that gained sessions before Gyre saw one, and a front end whose
``/server_info`` has no ``version`` are all read right.  The probe also closes a session left open
on the server (it answers 200 then).  :func:`from_server_info` only says whether an engine is an
SGLang server at all (it reports a version and is not the embedded engine).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """``"0.5.10.post1"`` -> ``(0, 5, 10)``; ``None`` for anything without a numeric release."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if m is None:
        return None
    return tuple(int(g) for g in m.groups(default="0"))


@dataclass(frozen=True)
class SGLangProtocol:
    """The SGLang ``version`` a server reports (``None``: not SGLang, or unknown)."""

    version: tuple[int, ...] | None = None

    @property
    def is_sglang(self) -> bool:
        """The server reported an SGLang version."""
        return self.version is not None


#: ``engine`` in the embedded engine's ``/server_info`` (its ``version`` is Gyre's, not SGLang's).
EMBEDDED_ENGINE = "gyre-embedded"


def from_server_info(info) -> SGLangProtocol:
    """The protocol a ``/server_info`` body describes: SGLang's ``version``, or none for the
    embedded engine (``engine`` is :data:`EMBEDDED_ENGINE`) and anything without a version."""
    if not isinstance(info, dict) or info.get("engine") == EMBEDDED_ENGINE:
        return SGLangProtocol(None)
    return SGLangProtocol(parse_version(info.get("version")))


#: Statuses of ``POST /end_weight_update`` from a server without the endpoint (no such route;
#: a front end that knows the path for another method).
NO_ROUTE = frozenset({404, 405})


def probe_weight_update_sessions(client) -> bool:
    """Whether the server behind ``client`` loads weights only inside a weight-update session,
    from its answer to ``client.end_weight_update()``: 400 (no session open) or 200 (one was left
    open, and is closed now) -- sessions; 404 or 405 -- none.

    The call takes SGLang's weight-update lock unless generation is paused, so it waits for the
    running requests; Gyre probes where it is about to load weights (generation paused).

    Raises:
        EngineError: any other answer (the server cannot say).
    """
    from gyre.rollout.client.messages import EngineError

    try:
        client.end_weight_update()
    except EngineError as exc:
        if exc.status_code in NO_ROUTE:
            return False
        if exc.status_code != 400:
            raise
    return True
