import threading

import pytest
import torch.distributed as dist

from gyre.training.control import (Ack, ControlChannel, JoinBatch, Publish, Shutdown, ToRollout, ToTrain, decode,
                                   encode)


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    yield s


def test_round_trip_every_message():
    for msg in (ToTrain(cell=1, step=3), ToRollout(cell=2, version=4), JoinBatch(cell=1, step=3, version=3),
                Publish(version=5), Shutdown(reason="done"), Ack(cell=1, command="to_train", timings={"switch_s": 0.25})):
        assert decode(encode(msg)) == msg
    assert encode(ToTrain(cell=1, step=3)) == b'{"cell": 1, "kind": "to_train", "step": 3}'


def test_bad_messages_are_clear_errors():
    with pytest.raises(ValueError, match="unknown control message kind 'nope'"):
        decode(b'{"kind": "nope"}')
    with pytest.raises(ValueError, match="bad to_train message"):
        decode(b'{"kind": "to_train", "cell": 1}')


def test_fifo_exactly_once_between_threads(store):
    scheduler = ControlChannel(store, "rank0")
    cell = ControlChannel(dist.TCPStore("127.0.0.1", store.port, 1, is_master=False), "cell1")
    received = []

    def cell_loop():
        while True:
            msg = cell.recv(timeout_s=10)
            received.append(msg)
            if isinstance(msg, Shutdown):
                return
            cell.send("rank0", Ack(cell=1, command=msg.kind))

    t = threading.Thread(target=cell_loop)
    t.start()
    sent = [ToTrain(cell=1, step=0), ToRollout(cell=1, version=1), ToTrain(cell=1, step=1), Shutdown()]
    for m in sent:
        scheduler.send("cell1", m)
    acks = []
    while len(acks) < 3:  # one ack per non-shutdown command
        acks.append(scheduler.recv(timeout_s=10))
    t.join(10)
    assert received == sent
    assert [a.command for a in acks] == ["to_train", "to_rollout", "to_train"]
    assert scheduler.poll() is None


def test_recv_timeout(store):
    with pytest.raises(TimeoutError, match="cell3: no control message"):
        ControlChannel(store, "cell3").recv(timeout_s=0.05)
