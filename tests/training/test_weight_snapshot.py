import pytest
import torch

from gyre.training.prefix_groups import prefix_group_ranks
from gyre.training.weight_snapshot import (MooncakeSnapshotClient, MooncakeSnapshotServer, SnapshotError,
                                           SnapshotHandle, copy_flat_to_params, copy_params_to_flat, flat_numel)


def params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 4, generator=g), torch.randn(7, generator=g), torch.randn(2, 2, 2, generator=g)]


def test_flat_round_trip():
    src, dst = params(0), params(1)
    flat = torch.zeros(flat_numel(src))
    copy_params_to_flat(src, flat)
    copy_flat_to_params(flat, dst)
    assert all(torch.equal(a, b) for a, b in zip(src, dst))
    with pytest.raises(ValueError, match="flat buffer has 10 elements, parameters 27"):
        copy_flat_to_params(torch.zeros(10), dst[:1] + dst[1:])


def test_prefix_group_ranks_layout():
    assert prefix_group_ranks(1, 4) == {}
    assert prefix_group_ranks(3, 1) == {1: [[0, 1]], 2: [[0, 1, 2]]}
    # TP=2 inside a cell: only corresponding shard ranks are connected
    assert prefix_group_ranks(3, 2) == {1: [[0, 2], [1, 3]], 2: [[0, 2, 4], [1, 3, 5]]}
    with pytest.raises(ValueError):
        prefix_group_ranks(0, 1)


@pytest.fixture(scope="module")
def mooncake_available():
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda not installed")


def test_mooncake_pull_equals_core_weights(mooncake_available):
    core, sat = params(0), params(1)
    server = MooncakeSnapshotServer(flat_numel(core))
    server.publish(core, version=7)
    client = MooncakeSnapshotClient(server.handle)
    assert client.pull(sat, expected_version=7) == 7
    assert all(torch.equal(a, b) for a, b in zip(core, sat))
    # next step: new weights, new version
    with torch.no_grad():
        core[0].add_(1.0)
    server.publish(core, version=8)
    with pytest.raises(SnapshotError, match="snapshot version 8 .* expected 7"):
        client.pull(sat, expected_version=7)
    assert client.pull(sat, expected_version=8) == 8
    assert torch.equal(sat[0], core[0])


def test_mooncake_dead_peer_is_a_clear_error(mooncake_available):
    bad = SnapshotHandle(session_id="127.0.0.1:1", header_addr=0x1000, payload_addr=0x2000, numel=27, dtype="float32")
    client = MooncakeSnapshotClient(bad)
    with pytest.raises(SnapshotError, match="transfer_sync_read from 127.0.0.1:1 failed"):
        client.pull(params(0), expected_version=0)
