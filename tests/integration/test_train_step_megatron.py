"""Training step on megatron-core (single process, CPU/gloo) through ``get_forward_backward_func``:
same numbers as the HF path, micro-step count/order invariance, tree-packed = per-row forward."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from gyre.buffer.packing import PackingConfig, pack_rows
from gyre.embedded_model import load_hf_model
from gyre.training.hf_step import HFTrainStep
from gyre.training.megatron_step import build_megatron_train_step
from gyre.training.step import AdamConfig
from tests.training.test_step import TRACES, assert_same_update, pack_into, trace_batch, with_behaviour_near_policy


@pytest.fixture(scope="module")
def megatron(tiny_model_dir):
    from gyre.training.megatron_model import initialize_megatron_cpu

    initialize_megatron_cpu(1, 1, seed=1234)
    return load_hf_model(tiny_model_dir)


def hf_named(step, what: str):
    """Megatron parameters (``what='param'``) or gradients (``'grad'``) under HF names."""
    from gyre.training.checkpoint_conversion import megatron_to_hf

    gpt = step.policy.gpt
    sd = {n: (p.detach() if what == "param" else p.main_grad.detach()).clone() for n, p in gpt.named_parameters()}
    out = megatron_to_hf({(0, 0): sd}, gpt.config_hf)
    out.pop("lm_head.weight", None)  # tied to the embedding
    return out


def mg_step(hf, adam=None, objective=None):
    step = build_megatron_train_step(hf, objective, adam or AdamConfig())
    step.policy.gpt.config_hf = hf.config
    return step


def test_megatron_step_equals_hf_step(megatron, traces_dir):
    hf = megatron
    rows = with_behaviour_near_policy(hf, trace_batch(traces_dir, scale=1 / 96, seed=2), seed=2)
    ms = pack_rows(rows, PackingConfig(100_000, "pack", tree=True)).micro_steps
    h = HFTrainStep(copy.deepcopy(hf))
    rh = h(ms)
    m = mg_step(hf)
    rm = m(pack_rows(rows, PackingConfig(100_000, "pack", tree=True)).micro_steps)
    for key in ("loss", "rho_mean", "train_inference_mismatch", "entropy"):
        assert abs(rm.metrics[key] - rh.metrics[key]) < 1e-5, key
    assert abs(rm.metrics["grad_norm"] - rh.metrics["grad_norm"]) < 1e-5 * rh.metrics["grad_norm"]
    assert rm.metrics["clip_fraction"] == rh.metrics["clip_fraction"]
    assert rm.metrics["normaliser"] == rh.metrics["normaliser"] == len(TRACES)
    gh = {n: p.grad for n, p in h.model.named_parameters()}
    ph = {n: p.detach() for n, p in h.model.named_parameters()}
    assert_same_update(gh, hf_named(m, "grad"), ph, hf_named(m, "param"))
    # like the HF path (and Megatron-LM's scheduler), no weight decay on 1-D parameters
    for group in m.optimizer.param_groups:
        assert group["weight_decay"] == (0.0 if all(p.ndim == 1 for p in group["params"]) else 0.01)


def test_megatron_micro_step_count_and_order_do_not_change_the_update(megatron, traces_dir):
    hf = megatron
    rows = with_behaviour_near_policy(hf, trace_batch(traces_dir, scale=1 / 96, seed=1), seed=1)
    res, grads, params = {}, {}, {}
    for k in (1, 3, 7):
        ms = pack_into(rows, k, layout="pad").micro_steps
        if k > 1:
            ms = [ms[i] for i in np.random.default_rng(k).permutation(len(ms))]
        step = mg_step(hf)
        res[k] = step(ms)
        assert res[k].metrics["optimizer_steps"] == 1 and res[k].metrics["micro_steps"] == k
        grads[k], params[k] = hf_named(step, "grad"), hf_named(step, "param")
    assert res[7].metrics["log_ratio_pass_tokens"] > 0  # split executions took the forward-only pass
    for k in (3, 7):
        assert abs(res[k].metrics["loss"] - res[1].metrics["loss"]) < 1e-6
        assert_same_update(grads[1], grads[k], params[1], params[k])


def test_megatron_tree_packed_equals_per_row(megatron, traces_dir):
    hf = megatron
    rows = with_behaviour_near_policy(hf, trace_batch(traces_dir, scale=1 / 96, seed=3), seed=3)
    out = {}
    for tree in (False, True):
        step = mg_step(hf, adam=AdamConfig(lr=0.0, weight_decay=0.0))
        packed = pack_rows(rows, PackingConfig(100_000, "pad", tree=tree))
        r = step(packed.micro_steps)
        out[tree] = (r.metrics["loss"], hf_named(step, "grad"), packed.stats)
    assert abs(out[True][0] - out[False][0]) < 1e-5
    for n, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][n], g, rtol=0, atol=1e-5)
    assert out[True][2].real_tokens < out[False][2].real_tokens


def test_megatron_logprobs_are_of_the_tempered_distribution(megatron, traces_dir):
    from tests.training.test_step import tempered_batch, tempered_reference

    hf = megatron
    batch = tempered_batch(traces_dir)
    adam = AdamConfig(lr=0.0)
    for temperature in (1.0, 0.7):
        step = build_megatron_train_step(hf, adam=adam, temperature=temperature)
        with torch.no_grad():
            lp, _ = step.policy(batch)
        torch.testing.assert_close(lp, tempered_reference(hf, batch, temperature), rtol=0, atol=2e-5)


def test_megatron_tempered_step_equals_hf_tempered_step(megatron, traces_dir):
    """At T = 0.7 the gradients through Megatron's in-place ``logits / T`` equal the HF path's
    (``hidden / T``), and both differ from the T = 1 step."""
    hf = megatron
    rows = with_behaviour_near_policy(hf, trace_batch(traces_dir, scale=1 / 96, seed=5), seed=5)
    grads = {}
    for t in (1.0, 0.7):
        h = HFTrainStep(copy.deepcopy(hf), temperature=t)
        rh = h(pack_rows(rows, PackingConfig(100_000, "pack", tree=True)).micro_steps)
        m = build_megatron_train_step(hf, temperature=t)
        m.policy.gpt.config_hf = hf.config
        rm = m(pack_rows(rows, PackingConfig(100_000, "pack", tree=True)).micro_steps)
        assert abs(rm.metrics["loss"] - rh.metrics["loss"]) < 1e-5
        gh = {n: p.grad for n, p in h.model.named_parameters()}
        ph = {n: p.detach() for n, p in h.model.named_parameters()}
        assert_same_update(gh, hf_named(m, "grad"), ph, hf_named(m, "param"))
        grads[t] = hf_named(m, "grad")
    assert max(float((grads[0.7][n] - grads[1.0][n]).abs().max()) for n in grads[1.0]) > 1e-4


def test_megatron_streaming_interface_equals_one_step(megatron, traces_dir, tmp_path):
    """What a streaming cell does: accumulate without ``finalize_model_grads``
    (un-normalised gradients in ``main_grad``), divide by ``|E|`` in ``optimizer_step`` -- the same
    update as one Megatron step that finalizes; weights come out under HF names and save as a
    loadable HF checkpoint."""
    from gyre.embedded_model import load_hf_model
    from gyre.training.step import apply_log_ratio_sums

    hf = megatron
    rows = with_behaviour_near_policy(hf, trace_batch(traces_dir, scale=1 / 96, seed=4), seed=4)
    one = mg_step(hf)
    r1 = one(pack_into(rows, 3).micro_steps)
    g1, p1 = hf_named(one, "grad"), hf_named(one, "param")

    st = mg_step(hf)
    st.zero_grad()
    ms = pack_into(rows, 3).micro_steps
    sums, _ = st.precompute_log_ratio_sums(ms)
    apply_log_ratio_sums(ms, sums)
    normaliser = 0
    for m in ms:  # one micro-step at a time, as claimed from the stream
        n, _ = st.accumulate([m])
        normaliser += n
    assert normaliser == r1.metrics["normaliser"] == len(TRACES)
    # not yet divided by |E| (one's gradients are already clipped in place, so compare norms)
    raw_norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in st.grad_tensors()])))
    assert abs(raw_norm / normaliser - r1.metrics["grad_norm"]) < 1e-4 * r1.metrics["grad_norm"]
    norm = st.optimizer_step(normaliser)
    assert abs(norm - r1.metrics["grad_norm"]) < 1e-5 * r1.metrics["grad_norm"]
    assert st.num_updates() == one.num_updates() == 1
    assert_same_update(g1, hf_named(st, "grad"), p1, hf_named(st, "param"))
    # HF names for the rollout engine: every HF parameter but the tied lm_head, same values
    named = st.hf_named([p.detach() for p in st.params])
    assert set(named) == {n for n, _ in hf.named_parameters()} - {"lm_head.weight"}
    st.save_hf(tmp_path / "hf")
    back = load_hf_model(tmp_path / "hf")
    for n, p in back.named_parameters():
        if n != "lm_head.weight":
            torch.testing.assert_close(p.detach(), named[n], rtol=0, atol=0)
