"""TCP ports and listening sockets for rollout engines.

:func:`free_port` picks a port for a server that binds it itself later (an SGLang server, a
weight-update group's rendezvous); :func:`bind_socket` binds a listening socket at once (the
embedded engine's HTTP server).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket with ``TCP_NODELAY`` (``port=0``: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted sockets inherit TCP_NODELAY (Linux); asyncio only sets it itself for sockets
    # created with proto=IPPROTO_TCP.  Without it a response written in two parts waits for
    # the client's delayed ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A currently free TCP port on ``host``, below the kernel's ephemeral port range where there
    is room (``/proc/sys/net/ipv4/ip_local_port_range``). A port from that range can be handed to
    another socket between this check and the server's own bind (any ``bind`` to port 0 or
    outgoing connection, the server's own included); one below it is taken only by a process that
    asks for it by number. ``rng`` picks the candidates (default: the system's randomness)."""
    rng = rng or random.SystemRandom()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_port_low()
    for _ in range(64 if low > _LOWEST_PORT else 0):
        port = rng.randrange(_LOWEST_PORT, low)
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family) as s:  # no room below the range, or every candidate taken
        s.bind((host, 0))
        return s.getsockname()[1]


#: The lowest port :func:`free_port` picks (below it: the ports services are usually given).
_LOWEST_PORT = 10_000


def _ephemeral_port_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
