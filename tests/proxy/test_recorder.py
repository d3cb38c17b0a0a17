"""Group-committed record writes (gyre/proxy/recorder.py)."""

from __future__ import annotations

import numpy as np

from gyre.proxy.recorder import RecordSink
from gyre.trajectory.records import RequestRecord
from gyre.trajectory.store import TrajectoryStore


def _rec(eid, ci):
    return RequestRecord(eid, ci, "main", np.arange(ci + 3), np.array([7, 8]), np.array([-0.1, -0.2]))


def test_batches_keep_order_and_close(tmp_path):
    store = TrajectoryStore(tmp_path, fsync_every=0)
    sink = RecordSink(store, fsync=True)
    futs = [sink.submit(_rec(f"e{k % 3}", k // 3)) for k in range(30)]
    closed = sink.close_execution("e0")
    assert [f.result(10) for f in futs] == [k // 3 for k in range(30)]  # seq per execution file
    closed.result(10)
    late = sink.submit(_rec("e0", 10))  # a record after the close reopens the file
    assert late.result(10) == 10
    sink.close()
    for e in ("e0", "e1", "e2"):
        recs = TrajectoryStore(tmp_path).read_records(e)
        assert [r.call_index for r in recs] == list(range(10)) + ([10] if e == "e0" else [])
    assert sink.records == 31 and 1 <= sink.batches <= 33


def test_append_errors_reach_the_caller(tmp_path):
    class Broken:
        def append(self, rec):
            raise OSError("disk full")

        def path(self, eid):
            return tmp_path / "x"

        def close(self):
            pass

    sink = RecordSink(Broken())
    fut = sink.submit(_rec("e", 0))
    assert isinstance(fut.exception(10), OSError)
    sink.close()


def test_flush_mode_syncs_in_the_background(tmp_path, monkeypatch):
    import os as _os

    synced = []
    real = _os.fsync
    monkeypatch.setattr("gyre.proxy.recorder.os.fsync", lambda fd: (synced.append(fd), real(fd)))
    sink = RecordSink(TrajectoryStore(tmp_path, fsync_every=0), fsync=False, fsync_interval_s=0.05)
    assert sink.submit(_rec("e", 0)).result(10) == 0  # stored (written to the OS) before any fsync
    import time

    end = time.time() + 5
    while not synced and time.time() < end:
        time.sleep(0.01)
    assert synced  # the background fsync came
    sink.close()
    assert len(TrajectoryStore(tmp_path).read_records("e")) == 1
