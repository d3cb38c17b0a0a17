import threading

import pytest
import torch.distributed as dist

from gyre.training.control import (MESSAGE_TYPES, ControlChannel, Failed, JoinSkipped, JoinStep, LoadWeights,
                                   Published, Saved, SaveCheckpoint, Shutdown, StepDone, Stopped, Switched, SwitchFailed,
                                   SwitchToRollout, SwitchToTraining, decode, encode)


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    yield s


def test_round_trip_every_message():
    msgs = (SwitchToTraining(cell=1, step=3), SwitchToRollout(cell=2, version=4), JoinStep(cell=1, step=3, version=3),
            LoadWeights(version=5), SaveCheckpoint("/tmp/x"), Shutdown(reason="done"),
            Switched(cell=1, role="rollout", latency_s=0.25, phases_s={"load_s": 0.1}, version=4),
            SwitchFailed(cell=2, role="training", detail="cell 2 could not release its engine's memory"),
            StepDone(cell=0, step=3, micro_steps_here=2, window=1, join_s=0.0, consume_s=1.5, update_s=0.25,
                     time_s=1.75, loss=float("inf"), grad_norm=0.5, row_tokens=120.0),
            JoinSkipped(cell=2, step=3, reason="window closed"), Published(cell=1, version=5, load_s=0.0),
            Saved(cell=0, directory="/tmp/x", save_s=0.5), Stopped(cell=2), Failed(cell=1, command="join_step", detail="E"))
    assert {type(m) for m in msgs} == set(MESSAGE_TYPES.values())  # every kind is covered
    for msg in msgs:
        assert decode(encode(msg)) == msg
    assert encode(SwitchToTraining(cell=1, step=3)) == b'{"cell": 1, "kind": "switch_to_training", "step": 3}'


def test_step_done_metrics_are_the_fields_with_values():
    done = StepDone(cell=0, step=3, micro_steps_here=2, window=1, join_s=0.0, consume_s=1.5, update_s=0.25,
                    time_s=1.75, loss=0.125, grad_norm=0.5)
    assert done.metrics() == {"step": 3, "micro_steps_here": 2, "window": 1, "join_s": 0.0, "consume_s": 1.5,
                              "update_s": 0.25, "time_s": 1.75, "loss": 0.125, "grad_norm": 0.5}


def test_bad_messages_are_clear_errors():
    with pytest.raises(ValueError, match="unknown control message kind 'nope'"):
        decode(b'{"kind": "nope"}')
    with pytest.raises(ValueError, match="bad switch_to_training message"):
        decode(b'{"kind": "switch_to_training", "cell": 1}')


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
            cell.send("rank0", Switched(cell=1, role=msg.kind, latency_s=0.0))

    t = threading.Thread(target=cell_loop)
    t.start()
    sent = [SwitchToTraining(cell=1, step=0), SwitchToRollout(cell=1, version=1), SwitchToTraining(cell=1, step=1),
            Shutdown()]
    for m in sent:
        scheduler.send("cell1", m)
    acks = []
    while len(acks) < 3:  # one ack per non-shutdown command
        acks.append(scheduler.recv(timeout_s=10))
    t.join(10)
    assert received == sent
    assert [a.role for a in acks] == ["switch_to_training", "switch_to_rollout", "switch_to_training"]
    assert scheduler.poll() is None


def test_recv_timeout(store):
    with pytest.raises(TimeoutError, match="cell3: no control message"):
        ControlChannel(store, "cell3").recv(timeout_s=0.05)
