"""Training step on the HF path: chunked target log-probs = naive, packed/padded/tree-packed forward =
per-row forward (loss and gradients), micro-step count and order do not change the update, one
optimizer update per batch."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from gyre.buffer.packing import PackingConfig, pack_rows
from gyre.embedded_model import load_hf_model
from gyre.rl.objective import ObjectiveConfig, ObjectiveInputs, execution_objective
from gyre.training.hf_step import HFTrainStep
from gyre.training.logprobs import target_logprobs_from_hidden, target_logprobs_from_logits
from gyre.training.step import AdamConfig
from gyre.testing.trace_trees import trace_shaped_rows

# Trees with the traces' branching structure and sizes scaled down (gyre/testing/trace_trees.py: long
# shared prefix, compaction branch, sub-agent root branch; random token ids), so the 2-layer embedded
# model runs them in seconds. Real replays (9k-19k-token rows) are in
# tests/integration/test_train_step_replay.py.
TRACES = ("claude-code/cc2_autocompact.jsonl", "codex/cx2_gpt55_autocompact.jsonl", "codex/cx1_tools_subagent.jsonl")


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    torch.manual_seed(0)
    return load_hf_model(tiny_model_dir)


def trace_batch(traces_dir: Path, scale=1 / 48, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for i, name in enumerate(TRACES):
        rows += trace_shaped_rows(traces_dir / name, rng, advantage=float(rng.normal()), scale=scale,
                                  execution_id=f"ex-{i}")
    return rows


# --------------------------------------------------------------------------- log-probs


def test_chunked_logprobs_equal_naive_on_tiny_model(hf):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4000, (2, 40), generator=g)
    hidden = hf.model(input_ids=ids).last_hidden_state.reshape(-1, 128).detach().requires_grad_(True)
    weight = hf.lm_head.weight.detach().clone().requires_grad_(True)
    index = torch.randint(0, 80, (57,), generator=g)
    index[:3] = 5  # repeated predicting positions
    targets = torch.randint(0, 4224, (57,), generator=g)
    logits = hidden @ weight.t()
    naive_full = torch.log_softmax(logits, -1)
    naive = naive_full[index, targets]
    naive_ent = -(naive_full.exp() * naive_full).sum(-1)[index]
    w = torch.randn(57, generator=g)
    gh, gw = torch.autograd.grad((naive * w).sum(), (hidden, weight))
    for chunk in (1, 7, 4096):
        lp, ent = target_logprobs_from_hidden(hidden, weight, index, targets, chunk, with_entropy=True)
        torch.testing.assert_close(lp, naive, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ent, naive_ent, rtol=1e-6, atol=1e-6)
        h2, w2 = torch.autograd.grad((lp * w).sum(), (hidden, weight))
        torch.testing.assert_close(h2, gh, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w2, gw, rtol=1e-5, atol=1e-6)
        lg = logits.detach().requires_grad_(True)
        lp2, ent2 = target_logprobs_from_logits(lg, index, targets, chunk, with_entropy=True)
        torch.testing.assert_close(lp2, naive, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ent2, naive_ent, rtol=1e-6, atol=1e-6)
        (glg,) = torch.autograd.grad((lp2 * w).sum(), (lg,))
        (ref,) = torch.autograd.grad((torch.log_softmax(lg, -1)[index, targets] * w).sum(), (lg,))
        torch.testing.assert_close(glg, ref, rtol=1e-5, atol=1e-7)


def test_chunked_logprobs_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    wt = torch.randn(9, 4, dtype=torch.float64, generator=g, requires_grad=True)
    idx = torch.tensor([0, 2, 2, 5, 1])
    tg = torch.tensor([3, 0, 8, 8, 1])
    assert torch.autograd.gradcheck(lambda a, b: target_logprobs_from_hidden(a, b, idx, tg, 2)[0], (h, wt))
    z = torch.randn(6, 9, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: target_logprobs_from_logits(a, idx, tg, 2)[0], (z,))


def test_logprob_errors():
    h, w = torch.zeros(3, 2), torch.zeros(5, 2)
    with pytest.raises(ValueError, match="out of range"):
        target_logprobs_from_hidden(h, w, torch.tensor([3]), torch.tensor([0]))
    with pytest.raises(ValueError, match="target id"):
        target_logprobs_from_logits(torch.zeros(3, 5), torch.tensor([0]), torch.tensor([5]))
    with pytest.raises(ValueError, match="int64"):
        target_logprobs_from_logits(torch.zeros(3, 5), torch.tensor([0], dtype=torch.int32), torch.tensor([1]))


# --------------------------------------------------------------------------- per-row reference


def row_target_logprobs(model, r):
    """Per-row forward: the row alone, default positions and causal mask, chunked target log-probs
    (equal to the naive log-softmax, see above)."""
    t = np.flatnonzero(r.target_mask)
    hidden = model.model(input_ids=torch.as_tensor(r.input_ids[None], dtype=torch.int64)).last_hidden_state[0]
    return target_logprobs_from_hidden(hidden, model.lm_head.weight, torch.as_tensor(t - 1),
                                       torch.as_tensor(r.input_ids[t], dtype=torch.int64))[0]


def per_row_loss(model, rows, objective: ObjectiveConfig):
    """Loss of the batch with one plain forward per row (:func:`row_target_logprobs`)."""
    lps, blps, exs = [], [], []
    execs = sorted({r.execution_id for r in rows if r.num_targets})
    loc = {e: i for i, e in enumerate(execs)}
    L, A = {}, {}
    for r in rows:
        t = np.flatnonzero(r.target_mask)
        if not t.size:
            continue
        lps.append(row_target_logprobs(model, r))
        blps.append(torch.as_tensor(r.behaviour_logprobs[t]))
        exs += [loc[r.execution_id]] * len(t)
        L[r.execution_id], A[r.execution_id] = r.num_execution_targets, r.advantage
    inp = ObjectiveInputs(torch.cat(blps), torch.tensor(exs), torch.tensor([L[e] for e in execs]),
                          torch.tensor([A[e] for e in execs], dtype=torch.float64))
    out = execution_objective(torch.cat(lps), inp, objective)
    return out.loss_sum / out.normaliser, out


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def with_behaviour_near_policy(model, rows, spread=0.004, seed=0):
    """Rows whose behaviour log-probs are the model's own plus noise, so that s_i sits near the clip
    bounds [0.995, 1.005] (some executions clipped, most not)."""
    rng = np.random.default_rng(seed)
    out = []
    with torch.no_grad():
        for r in rows:
            r = copy.copy(r)
            t = np.flatnonzero(r.target_mask)
            lp = row_target_logprobs(model, r)
            blp = np.zeros_like(r.behaviour_logprobs)
            blp[t] = lp.numpy() + rng.normal(0, spread, len(t)) + rng.normal(0, spread)
            r.behaviour_logprobs = blp.astype(np.float32)
            out.append(r)
    return out


@pytest.mark.parametrize("layout, tree", [("pack", True), ("pad", True), ("pack", False)])
def test_packed_and_tree_forward_equal_per_row_forward(hf, traces_dir, layout, tree):
    rows = with_behaviour_near_policy(hf, trace_batch(traces_dir))
    model = copy.deepcopy(hf)
    model.zero_grad()
    ref_loss, ref_out = per_row_loss(model, rows, ObjectiveConfig())
    ref_loss.backward()
    ref = grads_of(model)
    step = HFTrainStep(copy.deepcopy(hf))
    res = pack_rows(rows, PackingConfig(100_000, layout, tree))
    normaliser, stats = step.forward_backward(res.micro_steps)
    got = {n: g / normaliser for n, g in grads_of(step.model).items()}
    assert abs(stats.loss_sum / normaliser - float(ref_loss)) < 1e-5
    assert normaliser == ref_out.normaliser == len(TRACES)
    assert set(got) == set(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=0, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    if tree:  # the compaction branch shares a long prefix with the main trajectory
        assert res.stats.forward_token_ratio < 0.9


# --------------------------------------------------------------------------- micro-step invariance


def pack_into(rows, k, layout="pack", tree=False):
    """Micro-steps of ``rows`` with the smallest budget that gives exactly ``k`` of them."""
    lo = max(r.num_tokens for r in rows)
    hi = sum(r.num_tokens for r in rows) if layout == "pack" else len(rows) * lo
    for budget in ([hi] if k == 1 else range(lo, hi + 1)):
        res = pack_rows(rows, PackingConfig(budget, layout, tree))
        if len(res.micro_steps) == k:
            return res
    raise AssertionError(f"no budget gives {k} micro-steps")


def assert_same_update(g1, gk, p1, pk):
    """Gradients equal to float rounding (1e-5 of each tensor's largest element) and parameters
    within 1e-6 after the step.

    One exception, inherent to Adam with eps = 1e-15: its first update is ``lr * g / (|g| + eps)``,
    i.e. ``lr * sign(g)``, so a gradient element that is pure rounding noise (``|g|`` below 1e-5 of
    the tensor's largest) can flip sign under another summation order and move by ``2 * lr``
    instead of 0. Such elements must be that small and rare (< 1e-4 of the tensor).
    """
    for n in g1:
        scale = float(g1[n].abs().max())
        torch.testing.assert_close(gk[n], g1[n], rtol=0, atol=1e-5 * scale, msg=lambda m, n=n: f"{n}: {m}")
        flip = (g1[n] * gk[n] <= 0) & ((g1[n] != 0) | (gk[n] != 0))
        assert bool((g1[n][flip].abs() <= 1e-5 * scale).all()), n
        assert int(flip.sum()) <= max(1, int(1e-4 * flip.numel())), n
        diff = (pk[n] - p1[n]).abs()
        assert float(diff[~flip].max()) <= 1e-6, n
    for n in p1:
        if n not in g1:
            torch.testing.assert_close(pk[n], p1[n], rtol=0, atol=1e-6)


def test_micro_step_count_and_order_do_not_change_the_update(hf, traces_dir):
    rows = with_behaviour_near_policy(hf, trace_batch(traces_dir, scale=1 / 96, seed=1), seed=1)
    adam = AdamConfig()  # defaults: lr 1e-6, betas (0.9, 0.95), eps 1e-15, wd 0.01, clip 1
    results, grads, params = {}, {}, {}
    for k in (1, 3, 7):
        res = pack_into(rows, k)
        ms = res.micro_steps
        if k > 1:
            ms = [ms[i] for i in np.random.default_rng(k).permutation(len(ms))]  # order too
        step = HFTrainStep(copy.deepcopy(hf), adam=adam)
        orig = step.optimizer.step
        calls = []
        step.optimizer.step = lambda *a, **kw: (calls.append(1), orig(*a, **kw))[1]
        results[k] = step(ms)
        assert len(calls) == 1 and results[k].metrics["optimizer_steps"] == 1
        grads[k] = grads_of(step.model)  # after 1/|E| and clipping, as used by the update
        params[k] = {n: p.detach().clone() for n, p in step.model.named_parameters()}
        if k == 7:
            assert res.stats.split_executions > 0  # the forward-only log-ratio pass ran
            assert results[k].metrics["log_ratio_pass_tokens"] > 0
    for k in (3, 7):
        assert abs(results[k].metrics["loss"] - results[1].metrics["loss"]) < 1e-6
        assert abs(results[k].metrics["grad_norm"] - results[1].metrics["grad_norm"]) < 1e-6 * results[1].metrics["grad_norm"] + 1e-9
        assert results[k].metrics["clip_fraction"] == results[1].metrics["clip_fraction"]
        assert_same_update(grads[1], grads[k], params[1], params[k])
    moved = max(float((params[1][n] - p).abs().max()) for n, p in hf.named_parameters())
    assert moved > 5e-7  # the step did update (lr 1e-6)
    m = results[1].metrics
    assert m["normaliser"] == len(TRACES) and m["executions"] == len(TRACES)
    assert 0 <= m["clip_fraction"] <= 1 and m["entropy"] > 0 and m["rho_max"] <= 5.0


def test_negative_control_per_micro_step_mean_is_caught(hf, traces_dir):
    """Normalising each micro-step by its own |E_m| (instead of 1/|E| once) changes the gradient:
    the invariance test above would catch it."""
    rows = with_behaviour_near_policy(hf, trace_batch(traces_dir, scale=1 / 96, seed=1), seed=1)
    one = HFTrainStep(copy.deepcopy(hf))
    n1, _ = one.forward_backward(pack_into(rows, 1).micro_steps)
    good = {n: g / n1 for n, g in grads_of(one.model).items()}
    bad_step = HFTrainStep(copy.deepcopy(hf))
    from gyre.training.step import MicroStepBatch, apply_log_ratio_sums, micro_step_loss, precompute_log_ratio_sums

    mss = pack_into(rows, 3).micro_steps
    apply_log_ratio_sums(mss, precompute_log_ratio_sums(bad_step.policy, mss)[0])
    for ms in mss:
        out = micro_step_loss(bad_step.policy, MicroStepBatch.from_micro_step(ms), bad_step.objective)
        (out.loss_sum / max(out.normaliser, 1) / 3).backward()
    bad = grads_of(bad_step.model)
    assert max(float((bad[n] - good[n]).abs().max()) for n in good) > 1e-3 * max(float(g.abs().max()) for g in good.values())


def tempered_batch(traces_dir):
    """One execution's rows, one padded batch row each (own positions, causal mask)."""
    from gyre.training.step import MicroStepBatch

    rows = [r for r in trace_batch(traces_dir, scale=1 / 96) if r.execution_id == "ex-0"]
    (ms,) = pack_rows(rows, PackingConfig(100_000, "pad", False)).micro_steps
    batch = MicroStepBatch.from_micro_step(ms)
    assert batch.input_ids.shape[0] == len(rows) > 1
    return batch


def tempered_reference(model, batch, temperature):
    """Brute force: each padded row's full logits / temperature -> log_softmax -> the targets."""
    with torch.no_grad():
        logits = torch.cat([model(input_ids=batch.input_ids[i:i + 1]).logits[0].float()
                            for i in range(batch.input_ids.shape[0])])
    return torch.log_softmax(logits / temperature, -1)[batch.target_index, batch.target_ids]


def test_policy_logprobs_are_of_the_tempered_distribution(hf, traces_dir):
    """``--rollout-temperature T``: the engine returns log-probs of softmax(z / T) (SGLang does), so
    the trainer's log-probs must be of the same distribution, not of softmax(z)."""
    from gyre.training.hf_step import HFPolicy

    batch = tempered_batch(traces_dir)
    with torch.no_grad():
        for temperature in (1.0, 0.7, 1.3):
            lp, _ = HFPolicy(hf, temperature=temperature)(batch)
            torch.testing.assert_close(lp, tempered_reference(hf, batch, temperature), rtol=0, atol=2e-5)
        assert float((HFPolicy(hf, temperature=0.7)(batch)[0] - HFPolicy(hf)(batch)[0]).abs().max()) > 1e-2
    with pytest.raises(ValueError, match="temperature must be > 0"):
        HFPolicy(hf, temperature=0.0)


def test_build_train_step_from_args(hf):
    from gyre.arguments import parse_args
    from gyre.training.backends import build_train_step

    args = parse_args(["--training-backend", "hf", "--lr", "2e-6", "--clip-grad", "0.5", "--loss-type", "grpo",
                       "--logprob-chunk-size", "64"])
    step = build_train_step(args, copy.deepcopy(hf))
    assert isinstance(step, HFTrainStep)
    assert step.objective.loss_type == "grpo" and step.adam.clip_grad == 0.5 and step.policy.chunk_size == 64
    assert step.policy.temperature == 1.0
    assert build_train_step(parse_args(["--training-backend", "hf", "--rollout-temperature", "0.7"]),
                            copy.deepcopy(hf)).policy.temperature == 0.7
    groups = step.optimizer.param_groups
    assert groups[0]["lr"] == 2e-6 and groups[0]["betas"] == (0.9, 0.95) and groups[0]["eps"] == 1e-15
    assert groups[0]["weight_decay"] == 0.01 and groups[1]["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in groups[0]["params"]) and all(p.ndim == 1 for p in groups[1]["params"])



def test_lr_warmup_follows_megatron_schedule_and_survives_a_checkpoint(hf):
    """``--lr-warmup-iters 4``: the update after k earlier ones uses lr * min(1, k/4) (Megatron's
    OptimizerParamScheduler); the count comes back with the optimizer's state_dict."""
    from gyre.arguments import parse_args
    from gyre.training.backends import build_train_step

    args = parse_args(["--training-backend", "hf", "--lr", "1e-3", "--lr-warmup-iters", "4", "--weight-decay", "0"])
    step = build_train_step(args, copy.deepcopy(hf))
    assert step.adam.lr_warmup_iters == 4 and step.num_updates() == 0
    assert [step.adam.lr_at(k) for k in range(6)] == [0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3]
    seen = []
    for k in range(3):
        before = {n: p.detach().clone() for n, p in step.model.named_parameters()}
        for p in step.params:
            p.grad = torch.ones_like(p)
        step.optimizer_step(1)
        seen.append(step.optimizer.param_groups[0]["lr"])
        moved = max(float((p - before[n]).abs().max()) for n, p in step.model.named_parameters())
        # constant gradients: every Adam update is lr * sign(g) -- exactly 0 at lr 0
        assert (moved == 0.0) if k == 0 else abs(moved - seen[-1]) < 1e-3 * seen[-1], (k, moved)  # fp32 rounding of the weights
    assert seen == [0.0, 2.5e-4, 5e-4] and step.num_updates() == 3
    resumed = build_train_step(args, copy.deepcopy(step.model))
    resumed.optimizer.load_state_dict(step.optimizer.state_dict())
    assert resumed.num_updates() == 3 and resumed.adam.lr_at(resumed.num_updates()) == 7.5e-4
    with pytest.raises(SystemExit):
        parse_args(["--lr-warmup-iters", "-1"])
