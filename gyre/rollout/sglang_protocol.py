"""Which generation of SGLang's HTTP protocol a server speaks, from the version it reports.

Gyre runs two generations of SGLang here (``tools/setup_sglang.sh``) and reads both sources:

* **0.5.10.post1** -- weight updates are single calls; ``/flush_cache`` answers 400 while a
  paused (``retract``) request waits; ``/get_load`` and ``/clear_hicache_storage_backend`` exist.
* **0.5.23** -- every ``/update_weights_from_tensor`` and ``/update_weights_from_distributed``
  must sit inside a weight-update session (``POST /begin_weight_update`` ...
  ``POST /end_weight_update``; outside one it answers 400, and the distributed call answers
  before it joins the broadcast), a ``retract``-paused server may flush, ``meta_info`` carries
  per-token ``weight_versions``, and ``/get_load``, ``/get_weight_version`` and
  ``/clear_hicache_storage_backend`` are gone.

:func:`detect` asks ``/server_info`` (``/get_server_info`` on older servers) once; an engine that
reports no SGLang version (the embedded engine) is treated as the older generation, whose calls it
serves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The first SGLang version Gyre has seen that needs weight-update sessions.
SESSIONS_SINCE = (0, 5, 23)


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """``"0.5.10.post1"`` -> ``(0, 5, 10)``; ``None`` for anything without a numeric release."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if m is None:
        return None
    return tuple(int(g) for g in m.groups(default="0"))


@dataclass(frozen=True)
class SGLangProtocol:
    """What a server of SGLang ``version`` (``None``: not SGLang, or unknown) needs from Gyre."""

    version: tuple[int, ...] | None = None

    @property
    def is_sglang(self) -> bool:
        """The server reported an SGLang version."""
        return self.version is not None

    @property
    def weight_update_sessions(self) -> bool:
        """Weight loads must be wrapped in ``/begin_weight_update`` ... ``/end_weight_update``."""
        return self.version is not None and self.version >= SESSIONS_SINCE

    @property
    def flushes_while_retracted(self) -> bool:
        """``/flush_cache`` succeeds while requests wait after a ``retract`` pause."""
        return self.version is not None and self.version >= SESSIONS_SINCE


#: ``engine`` in the embedded engine's ``/server_info`` (its ``version`` is Gyre's, not SGLang's).
EMBEDDED_ENGINE = "gyre-embedded"


def from_server_info(info) -> SGLangProtocol:
    """The protocol a ``/server_info`` body describes: SGLang's ``version``, or none for the
    embedded engine (``engine`` is :data:`EMBEDDED_ENGINE`) and anything without a version."""
    if not isinstance(info, dict) or info.get("engine") == EMBEDDED_ENGINE:
        return SGLangProtocol(None)
    return SGLangProtocol(parse_version(info.get("version")))


def detect(client) -> SGLangProtocol:
    """The protocol of the server behind ``client`` (from its ``get_server_info()``)."""
    return from_server_info(client.get_server_info())
