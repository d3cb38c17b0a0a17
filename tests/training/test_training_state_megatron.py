"""A Megatron replica's training state leaves memory and comes back bit-identically: parameters
and optimizer state copied out, DDP's gradient buffers freed in place (the ``main_grad`` views stay
attached) and re-allocated zeroed."""

import copy
from pathlib import Path

import pytest
import torch

from gyre.embedded_model import load_hf_model
from gyre.training.cell import TrainingState
from gyre.training.step import apply_log_ratio_sums
from tests.training.test_step import pack_into, trace_batch, with_behaviour_near_policy

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"


@pytest.fixture(scope="module")
def megatron_single_rank():
    from gyre.training.megatron_model import initialize_megatron_cpu

    initialize_megatron_cpu(1, 1, seed=1234)
    yield


def one_step(step, rows):
    micro = pack_into(rows, 2).micro_steps
    apply_log_ratio_sums(micro, step.precompute_log_ratio_sums(micro)[0])
    step.zero_grad()
    normaliser, _ = step.accumulate(micro)
    step.optimizer_step(normaliser)


def test_offload_frees_the_grad_buffers_and_restore_is_bit_identical(megatron_single_rank, tiny_model_dir):
    from gyre.training.megatron_step import build_megatron_train_step

    hf = load_hf_model(tiny_model_dir)
    rows = with_behaviour_near_policy(hf, trace_batch(TRACES, scale=1 / 96, seed=3), seed=3)
    kept, moved = build_megatron_train_step(copy.deepcopy(hf)), build_megatron_train_step(copy.deepcopy(hf))
    for s in (kept, moved):
        one_step(s, rows)  # the optimizer has state to offload
    buffers = moved.grad_buffers()
    nbytes = [b.untyped_storage().nbytes() for b in buffers]
    assert buffers and min(nbytes) > 0
    state = TrainingState(moved.params, moved.optimizer, buffers)
    state.offload()
    assert [b.untyped_storage().nbytes() for b in buffers] == [0] * len(buffers)
    assert all(p.numel() == 0 for p in moved.params)
    state.restore()
    assert [b.untyped_storage().nbytes() for b in buffers] == nbytes and all(not b.any() for b in buffers)
    grads = moved.grad_tensors()  # still views of the re-allocated buffers
    assert all(g.untyped_storage().data_ptr() == buffers[0].untyped_storage().data_ptr() for g in grads)
    assert all(torch.equal(p, q) for p, q in zip(kept.params, moved.params))
    for s in (kept, moved):
        one_step(s, rows)
    assert all(torch.equal(p, q) for p, q in zip(kept.params, moved.params))  # the next step is the same
