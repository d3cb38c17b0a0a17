"""Start-up of a Mooncake Transfer Engine, shared by weight snapshots and KV payloads.

:func:`start_transfer_engine` starts one engine bound to ``host`` over TCP (Mooncake's P2P
handshake, no metadata server), or over RDMA after :func:`set_transport`, with the given tensors
registered for one-sided reads.  The CPU wheel (``mooncake-transfer-engine-non-cuda``) is tested
over TCP; RDMA has not run here.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Iterable

import torch


class TransferEngineError(RuntimeError):
    """Mooncake is not installed, or starting it / registering memory failed."""


#: Transport every engine this process starts uses: ``(protocol, device names)``; see
#: :func:`set_transport` (``--weight-transport``, ``--weight-transport-device``).
_TRANSPORT = ["tcp", ""]


def set_transport(protocol: str, device_names: str = "") -> None:
    """Make every transfer engine this process starts use ``protocol`` (``tcp`` or ``rdma``) and,
    for RDMA, the NICs ``device_names`` (e.g. ``mlx5_0,mlx5_1``; empty: Mooncake picks).

    Raises:
        ValueError: an unknown protocol.
    """
    if protocol not in ("tcp", "rdma"):
        raise ValueError(f"Mooncake protocol must be tcp or rdma, not {protocol!r}")
    _TRANSPORT[:] = [protocol, device_names]


@contextlib.contextmanager
def native_stderr_captured():
    """Collect what native code writes to file descriptor 2 meanwhile; yields a callable that
    returns it.  Mooncake logs its start-up (and one harmless error-level line per engine) there."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lambda: (tmp.seek(0), tmp.read().decode(errors="replace"))[1]
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def start_transfer_engine(host: str, tensors: Iterable[torch.Tensor] = ()):
    """A Mooncake transfer engine on ``host`` (the process's transport, :func:`set_transport`;
    TCP by default) with ``tensors`` registered.  Mooncake's own
    log lines of this start-up appear only in the error when it fails; later it logs errors only
    (``MC_LOG_LEVEL``, default ``ERROR`` here).

    Raises:
        TransferEngineError: Mooncake is missing or did not start.
    """
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # pragma: no cover - depends on the wheel
        raise TransferEngineError(f"Mooncake Transfer Engine unavailable ({exc}); bash tools/setup.sh installs it") \
            from exc
    with native_stderr_captured() as log:
        engine = TransferEngine()
        protocol, devices = _TRANSPORT
        rc = engine.initialize(host, "P2PHANDSHAKE", protocol, devices)
        if rc != 0:
            raise TransferEngineError(f"TransferEngine.initialize({host!r}, {protocol}, {devices!r}) failed: rc={rc}: "
                                      f"{log()[-2000:]}")
        for t in tensors:
            register(engine, t)
    return engine


def register(engine, t: torch.Tensor) -> None:
    """Register ``t``'s memory with ``engine`` for remote reads.

    Raises:
        TransferEngineError: Mooncake refused it.
    """
    rc = engine.register_memory(t.data_ptr(), t.numel() * t.element_size())
    if rc != 0:
        raise TransferEngineError(f"register_memory of {t.numel() * t.element_size()} bytes failed: rc={rc}")
