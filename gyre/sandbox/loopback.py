"""Inside a sandbox without a network: listen on ``127.0.0.1:PORT``, forward to a Unix socket, run a command.

Usage (standard library only, so any Python 3 runs it)::

    python3 loopback.py PORT SOCKET [-- COMMAND ARGS...]

Every connection accepted on ``127.0.0.1:PORT`` (and ``[::1]:PORT`` where the sandbox has IPv6) is
joined to a new connection to the Unix socket ``SOCKET``, bytes copied both ways until either side
closes. With a command, it runs as this process's child; ``SIGTERM``, ``SIGINT`` and ``SIGHUP``
are passed on to it, and this process exits with its status (``128 + N`` after signal ``N``).
Without one, it writes ``gyre-loopback: listening on ...`` to stderr once it listens and forwards
until it is killed. It exits with 97 (after a ``gyre-loopback: ...`` line) when it cannot.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

LISTEN_FAILED = 97
#: The line written to stderr once it listens.
READY = "gyre-loopback: listening on"
_CHUNK = 1 << 16


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(_CHUNK)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


def _serve_connection(client: socket.socket, path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError as exc:
        print(f"gyre-loopback: cannot reach the proxy socket: {exc}", file=sys.stderr, flush=True)
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def _accept_loop(server: socket.socket, path: str) -> None:
    while True:
        try:
            client, _ = server.accept()
        except OSError:
            return
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_serve_connection, args=(client, path), daemon=True).start()


def _listen(port: int) -> list[socket.socket]:
    servers = []
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            s.listen(128)
        except OSError as exc:
            if family == socket.AF_INET:
                raise exc
            continue  # no IPv6 loopback here
        servers.append(s)
    return servers


def main(argv: list[str]) -> int:
    if len(argv) < 2 or (len(argv) > 2 and argv[2] != "--"):
        print("usage: loopback.py PORT SOCKET [-- COMMAND ARGS...]", file=sys.stderr)
        return 2
    port, path, command = int(argv[0]), os.path.abspath(argv[1]), argv[3:]
    try:
        servers = _listen(port)
    except OSError as exc:
        print(f"gyre-loopback: cannot listen on 127.0.0.1:{port}: {exc}", file=sys.stderr, flush=True)
        return LISTEN_FAILED
    for s in servers:
        threading.Thread(target=_accept_loop, args=(s, path), daemon=True).start()
    if not command:
        print(f"{READY} 127.0.0.1:{port}", file=sys.stderr, flush=True)
        threading.Event().wait()
        return 0
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        print(f"gyre-loopback: cannot start {command[0]}: {exc}", file=sys.stderr, flush=True)
        return 127

    def forward(signum, _frame):
        try:
            child.send_signal(signum)
        except OSError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    rc = child.wait()
    return 128 - rc if rc < 0 else rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
