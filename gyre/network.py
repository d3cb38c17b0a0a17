"""Addresses of a job that spans machines.

:func:`node_address` is the address other ranks reach this rank's servers at (the control store on
rank 0, a cell's engine, the core's weight snapshot): the local end of this machine's route to
``MASTER_ADDR`` (which torchrun sets), unless ``GYRE_NODE_ADDR`` names the address (a node with
several networks, or several Slurm nodes on one machine: ``examples/slurm/cpu.env``).  On one
machine the route is the loopback address, so a single-node job keeps every server on ``127.0.0.1``.
"""

from __future__ import annotations

import os
import socket


def node_address(master_addr: str | None = None) -> str:
    """``GYRE_NODE_ADDR`` when it is set and not empty; otherwise the local IPv4 address of the route
    to ``master_addr`` (default ``MASTER_ADDR``, else ``127.0.0.1``).  Nothing is sent: a UDP
    socket's ``connect`` only picks the route.

    Raises:
        OSError: ``master_addr`` does not resolve or no route leads to it.
    """
    if os.environ.get("GYRE_NODE_ADDR"):
        return os.environ["GYRE_NODE_ADDR"]
    master = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master, 9))
        return s.getsockname()[0]
