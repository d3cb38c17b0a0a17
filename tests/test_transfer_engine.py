"""The transport every Mooncake transfer engine of a process uses (``--weight-transport``)."""

import sys
import types

import pytest

from gyre import transfer_engine


@pytest.fixture
def fake_mooncake(monkeypatch):
    calls = []

    class TransferEngine:
        def initialize(self, host, metadata, protocol, devices):
            calls.append((host, metadata, protocol, devices))
            return 0 if protocol == "tcp" else -1

        def register_memory(self, ptr, n):
            return 0

    module = types.ModuleType("mooncake.engine")
    module.TransferEngine = TransferEngine
    monkeypatch.setitem(sys.modules, "mooncake.engine", module)
    yield calls
    transfer_engine.set_transport("tcp", "")


def test_engines_start_with_the_process_transport(fake_mooncake):
    transfer_engine.start_transfer_engine("10.0.0.1")
    transfer_engine.set_transport("rdma", "mlx5_0,mlx5_1")
    with pytest.raises(transfer_engine.TransferEngineError, match="rdma, 'mlx5_0,mlx5_1'\\) failed: rc=-1"):
        transfer_engine.start_transfer_engine("10.0.0.1")
    assert fake_mooncake == [("10.0.0.1", "P2PHANDSHAKE", "tcp", ""),
                             ("10.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0,mlx5_1")]


def test_unknown_protocols_are_refused():
    with pytest.raises(ValueError, match="tcp or rdma"):
        transfer_engine.set_transport("infiniband")
