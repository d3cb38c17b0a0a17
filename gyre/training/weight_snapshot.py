"""Core-cell weight snapshots that joining satellites pull.

Before each optimizer step the core (cell 0) copies its parameters into one flat, registered host
buffer and stamps it with the policy version. A satellite that joins the batch pulls that buffer
and checks the version before it claims micro-steps; weights are fixed during gradient
accumulation, so every satellite reads the same snapshot. Transports (``--weight-transport``):
``mooncake`` -- Mooncake Transfer Engine one-sided reads (``transfer_sync_read``; TCP on CPU with
``mooncake-transfer-engine-non-cuda``; the CUDA wheel offers the same API over RDMA);
``gloo`` -- a ``torch.distributed.broadcast`` of the flat buffer over the participants' group, the
fallback when Mooncake is unavailable. Layout: an int64 header ``[version, numel]`` (``version ==
-1`` while a write is in progress) and a flat payload of the parameters in ``named_parameters()``
order, both registered with the engine. A reader checks the header before and after reading the
payload, so a torn read is detected.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import torch

from gyre.transfer_engine import TransferEngineError, start_transfer_engine

logger = logging.getLogger(__name__)


class SnapshotError(RuntimeError):
    """A pull failed (dead peer, bad address) or returned an unexpected version / layout."""


@dataclass(frozen=True, slots=True)
class SnapshotHandle:
    """What a satellite needs to pull: the core's Mooncake session and buffer addresses.

    Attributes:
        session_id: ``"host:rpc_port"`` of the core's transfer engine.
        header_addr: address of the int64 ``[version, numel]`` header (16 bytes).
        payload_addr: address of the flat parameter buffer.
        numel: elements in the payload.
        dtype: payload dtype name (``"float32"``).
    """

    session_id: str
    header_addr: int
    payload_addr: int
    numel: int
    dtype: str


def flat_numel(params: Iterable[torch.Tensor]) -> int:
    """Total elements of ``params``."""
    return sum(p.numel() for p in params)


def _views(flat: torch.Tensor, params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(param, flat view of the same size)`` pairs in order.

    Raises:
        ValueError: ``flat`` does not have exactly the parameters' total size.
    """
    params = list(params)
    total = flat_numel(params)
    if total != flat.numel():
        raise ValueError(f"flat buffer has {flat.numel()} elements, parameters {total}")
    out, offset = [], 0
    for p in params:
        out.append((p, flat[offset:offset + p.numel()]))
        offset += p.numel()
    return out


def copy_params_to_flat(params: Iterable[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``params`` (in order) into the 1-D ``flat`` buffer.

    Raises:
        ValueError: sizes differ.
    """
    with torch.no_grad():
        for p, view in _views(flat, params):
            view.copy_(p.detach().reshape(-1))


def copy_flat_to_params(flat: torch.Tensor, params: Iterable[torch.Tensor]) -> None:
    """Inverse of :func:`copy_params_to_flat`.

    Raises:
        ValueError: sizes differ.
    """
    with torch.no_grad():
        for p, view in _views(flat, params):
            p.copy_(view.view_as(p))


def _engine_with_memory(host: str, tensors: Iterable[torch.Tensor]):
    """A Mooncake transfer engine on ``host`` with ``tensors`` registered (:class:`SnapshotError` if not)."""
    try:
        return start_transfer_engine(host, tensors)
    except TransferEngineError as exc:
        raise SnapshotError(str(exc)) from exc


class MooncakeSnapshotServer:
    """Core side: owns the registered header + payload and publishes snapshots into them.

    Args:
        numel: elements of the flat payload (``flat_numel(model.parameters())``).
        host: address the transfer engine binds and readers reach (``127.0.0.1`` on one machine;
            the main job passes :func:`gyre.network.node_address`).
    """

    def __init__(self, numel: int, host: str = "127.0.0.1", dtype: torch.dtype = torch.float32):
        self.host = host
        self.header = torch.zeros(2, dtype=torch.int64)
        self.payload = torch.zeros(numel, dtype=dtype)
        self._engine = _engine_with_memory(host, (self.header, self.payload))
        self.handle = SnapshotHandle(
            session_id=f"{host}:{self._engine.get_rpc_port()}", header_addr=self.header.data_ptr(),
            payload_addr=self.payload.data_ptr(), numel=numel, dtype=str(dtype).removeprefix("torch."))

    @property
    def version(self) -> int:
        """The version stamped last (``-1`` while a publication is being written)."""
        return int(self.header[0])

    def restamp(self, version: int) -> None:
        """The same weights are now version ``version`` (a step that changed nothing)."""
        self.header[0] = int(version)

    def publish(self, params: Iterable[torch.Tensor], version: int) -> None:
        """Copy ``params`` into the payload, then stamp ``version`` (header written last)."""
        self.header[0] = -1  # readers seeing -1 know a write is in progress
        copy_params_to_flat(params, self.payload)
        self.header[1] = self.payload.numel()
        self.header[0] = int(version)


class MooncakeSnapshotClient:
    """Satellite side: pulls the core's snapshot with one-sided reads into its parameters
    (``header_only``: only reads and writes the version header)."""

    def __init__(self, handle: SnapshotHandle, host: str = "127.0.0.1", *, header_only: bool = False):
        self.handle = handle
        self.header = torch.zeros(2, dtype=torch.int64)
        self.payload = torch.zeros(0 if header_only else handle.numel, dtype=getattr(torch, handle.dtype))
        self._engine = _engine_with_memory(host, (self.header,) if header_only else (self.header, self.payload))

    def _read(self, local: torch.Tensor, remote_addr: int) -> None:
        rc = self._engine.transfer_sync_read(self.handle.session_id, local.data_ptr(), remote_addr,
                                             local.numel() * local.element_size())
        if rc != 0:
            raise SnapshotError(f"transfer_sync_read from {self.handle.session_id} failed: rc={rc}")

    def restamp(self, version: int) -> None:
        """Write ``version`` into the core's header (one-sided write; the core is not writing: a
        step without training work).

        Raises:
            SnapshotError: the transfer failed.
        """
        header = torch.tensor([int(version), self.handle.numel], dtype=torch.int64)
        self.header.copy_(header)
        rc = self._engine.transfer_sync_write(self.handle.session_id, self.header.data_ptr(), self.handle.header_addr,
                                              self.header.numel() * self.header.element_size())
        if rc != 0:
            raise SnapshotError(f"transfer_sync_write to {self.handle.session_id} failed: rc={rc}")

    def peek_version(self) -> int:
        """The snapshot's current version (``-1`` while the core writes it).

        Raises:
            SnapshotError: the transfer failed.
        """
        self._read(self.header, self.handle.header_addr)
        return int(self.header[0])

    def pull(self, params: Iterable[torch.Tensor], expected_version: int) -> int:
        """Read the snapshot into ``params`` and return its version.

        Raises:
            SnapshotError: transfer failed, or the header's version/numel differ from what was
                expected before or after the payload read (a torn read).
        """
        self._read(self.header, self.handle.header_addr)
        before = int(self.header[0])
        if before != expected_version or int(self.header[1]) != self.handle.numel:
            raise SnapshotError(f"snapshot version {before} (numel {int(self.header[1])}), "
                                f"expected {expected_version} ({self.handle.numel})")
        self._read(self.payload, self.handle.payload_addr)
        self._read(self.header, self.handle.header_addr)
        if int(self.header[0]) != before:
            raise SnapshotError(f"snapshot changed during the read ({before} -> {int(self.header[0])})")
        copy_flat_to_params(self.payload, params)
        return before


class CoreSnapshotStamps:
    """Rank 0's handle on every shard of the core's snapshot: its own ``server`` (shard 0) and a
    client of each further shard's server, so a step without training work moves every shard's
    version on (:meth:`restamp`)."""

    def __init__(self, server: MooncakeSnapshotServer, shards: Iterable[MooncakeSnapshotClient] = ()):
        self.server, self.shards = server, list(shards)
        self.handle, self.host = server.handle, server.host

    @property
    def version(self) -> int:
        return self.server.version

    def restamp(self, version: int) -> None:
        self.server.restamp(version)
        for client in self.shards:
            client.restamp(version)


def gloo_broadcast_snapshot(params: list[torch.Tensor], version: int, src: int, group=None) -> int:
    """Fallback transport: broadcast ``[version] + flat params`` from global rank ``src`` over ``group``.

    Every member of ``group`` calls it; non-source ranks receive into ``params``.  Returns the version.
    """
    import torch.distributed as dist

    flat = torch.zeros(flat_numel(params), dtype=params[0].dtype)
    header = torch.tensor([version if dist.get_rank() == src else -1], dtype=torch.int64)
    if dist.get_rank() == src:
        copy_params_to_flat(params, flat)
    dist.broadcast(header, src=src, group=group)
    dist.broadcast(flat, src=src, group=group)
    if dist.get_rank() != src:
        copy_flat_to_params(flat, params)
    return int(header[0])
