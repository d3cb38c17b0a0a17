"""The launcher's side of a sandbox without a network: one Unix socket per execution, joined to the proxy.

:class:`ProxyGateway` runs an asyncio loop in one daemon thread. :meth:`ProxyGateway.open` makes a
Unix socket for one sandbox in a directory only the launcher's user can enter; every connection made
to it is joined to a new TCP connection to the proxy, bytes copied both ways. The socket is bound
into that sandbox alone (:data:`~gyre.sandbox.spec.IN_SANDBOX_PROXY_SOCKET`), so a sandbox reaches
the proxy and nothing else of the launcher's machine; the proxy still checks the execution's key.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

__all__ = ["ProxyGateway"]

logger = logging.getLogger(__name__)
_CHUNK = 1 << 16


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        try:
            if writer.can_write_eof():
                writer.write_eof()
        except OSError:
            pass


class ProxyGateway:
    """Per-sandbox Unix sockets forwarding to ``host``:``port`` (module docstring)."""

    def __init__(self, host: str, port: int, *, socket_dir: str | os.PathLike[str] | None = None) -> None:
        self.host, self.port = host, port
        self.dir = Path(tempfile.mkdtemp(prefix="gyre-gw-", dir=socket_dir))
        os.chmod(self.dir, 0o700)
        self._loop = asyncio.new_event_loop()
        self._servers: dict[str, asyncio.AbstractServer] = {}
        self._conns: dict[str, set[asyncio.StreamWriter]] = {}
        self._thread = threading.Thread(target=self._loop.run_forever, name="gyre-proxy-gateway", daemon=True)
        self._thread.start()
        self._closed = False
        self._paths: dict[str, Path] = {}
        self._numbers = itertools.count()
        self._names_lock = threading.Lock()

    def _call(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def socket_path(self, name: str) -> Path:
        """Where ``name``'s socket is (short names: a Unix socket's path has at most 107 bytes)."""
        with self._names_lock:
            if name not in self._paths:
                self._paths[name] = self.dir / f"{next(self._numbers)}.sock"
            return self._paths[name]

    def open(self, name: str) -> Path:
        """Listen on a new socket for sandbox ``name``; returns its path.

        Raises:
            ValueError: ``name`` is already open. OSError: the socket could not be made.
        """
        if self._closed:
            raise OSError("the proxy gateway is closed")
        return self._call(self._open(name))

    async def _open(self, name: str) -> Path:
        if name in self._servers:
            raise ValueError(f"a gateway socket for {name!r} is open already")
        path = self.socket_path(name)
        conns: set[asyncio.StreamWriter] = set()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conns.add(writer)
            try:
                up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
            except OSError as exc:
                logger.warning("gateway %s: the proxy at %s:%d is unreachable: %s", name, self.host, self.port, exc)
                writer.close()
                conns.discard(writer)
                return
            conns.add(up_writer)
            try:
                await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
            finally:
                for w in (writer, up_writer):
                    w.close()
                    conns.discard(w)

        server = await asyncio.start_unix_server(handle, path=str(path))
        self._servers[name], self._conns[name] = server, conns
        return path

    def close(self, name: str) -> None:
        """Stop listening for ``name``, end its connections and remove its socket. Idempotent."""
        if not self._closed:
            try:
                self._call(self._close(name))
            except Exception as exc:  # the loop is gone: the socket file is removed below anyway
                logger.warning("gateway %s: close failed: %s", name, exc)
        self.socket_path(name).unlink(missing_ok=True)
        with self._names_lock:
            self._paths.pop(name, None)

    async def _close(self, name: str) -> None:
        server = self._servers.pop(name, None)
        conns = self._conns.pop(name, set())
        if server is not None:
            server.close()
        for w in list(conns):
            w.close()

    def open_sockets(self) -> list[str]:
        return self._call(self._names())

    async def _names(self) -> list[str]:
        return sorted(self._servers)

    def shutdown(self) -> None:
        """Close every socket, stop the thread, remove the directory. Idempotent."""
        if self._closed:
            return
        for name in self.open_sockets():
            self.close(name)
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        shutil.rmtree(self.dir, ignore_errors=True)
