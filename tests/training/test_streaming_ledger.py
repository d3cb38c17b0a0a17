import pytest

from gyre.training.streaming import StreamLedger, dead_cells


def ledger_with(n, cells=3):
    led = StreamLedger(cells)
    for m in range(n):
        led.add(m)
    led.close()
    return led


def test_done_needs_every_micro_step_finished_by_a_valid_cell():
    led = ledger_with(3)
    led.on_claim(0, 0, 0)
    led.on_finish(0, 0, 0)
    led.on_claim(1, 0, 1)
    led.on_finish(1, 0, 1)
    assert led.done() == {0, 1} and not led.drained()
    led.on_claim(2, 0, 2)
    led.on_finish(2, 0, 2)
    assert led.drained()
    assert led.window([1, 2]) == 2
    # a second finish of the same generation does not change who finished it
    led.on_finish(2, 0, 1)
    assert led.finished_by[(2, 0)] == 2


def test_excluding_a_dead_cell_requeues_its_claimed_and_finished_work_and_everything_above():
    led = ledger_with(5)
    led.on_claim(0, 0, 0)
    led.on_finish(0, 0, 0)
    led.on_claim(1, 0, 1)
    led.on_finish(1, 0, 1)   # finished by cell 1 (will die)
    led.on_claim(2, 0, 1)                            # held by cell 1, never finished
    led.on_claim(3, 0, 2)
    led.on_finish(3, 0, 2)   # cell 2 is above the dead cell: excluded too
    requeue = led.exclude(1)
    assert requeue == [(1, 1), (2, 1), (3, 1)]
    assert led.done() == {0} and led.window([1, 2]) == 0
    # late completions of old generations do not count
    led.on_finish(2, 0, 1)
    assert led.done() == {0}
    for m in (1, 2, 3, 4):
        g = led.generation[m]
        led.on_claim(m, g, 0)
        led.on_finish(m, g, 0)
    assert led.drained()


def test_window_is_the_contiguous_joined_prefix():
    led = ledger_with(1, cells=4)
    assert led.window([]) == 0
    assert led.window([1, 3]) == 1
    assert led.window([1, 2, 3]) == 3
    led.exclude(2)
    assert led.window([1, 2, 3]) == 1


def test_errors():
    led = StreamLedger(2)
    led.add(0)
    with pytest.raises(ValueError, match="already queued"):
        led.add(0)
    with pytest.raises(ValueError, match="core cell cannot be excluded"):
        led.exclude(0)
    led.close()
    with pytest.raises(ValueError, match="closed"):
        led.add(1)


def test_dead_cells_by_heartbeat_age():
    assert dead_cells({1: 10.0, 2: 7.0, 3: 9.5}, now=10.5, lease_s=1.0) == [2]
    assert dead_cells({}, now=0.0, lease_s=1.0) == []
