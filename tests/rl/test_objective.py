"""The execution-level objective against a brute-force reference written here as
plain Python loops over executions and tokens; gradcheck; the public numeric bug cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gyre.rl.advantages import group_advantages
from gyre.rl.objective import ObjectiveConfig, ObjectiveInputs, ObjectiveStats, execution_objective
from gyre.training.logprobs import target_logprobs_from_hidden

# --------------------------------------------------------------------------- brute force


def reference(batch, cfg: ObjectiveConfig):
    """Loss, d loss / d l_t (per execution, per row, per token) and clip counts, by loops.

    ``batch``: list of executions ``{"A": float, "rows": [[(l, b), ...], ...]}``.
    """
    E = [ex for ex in batch if sum(len(r) for r in ex["rows"]) > 0]
    total = 0.0
    grads = []
    high = low = 0
    for ex in batch:
        L = sum(len(r) for r in ex["rows"])
        g_ex = []
        if L == 0:
            grads.append([[] for _ in ex["rows"]])
            continue
        log_ratio = 0.0
        for row in ex["rows"]:
            for l, b in row:
                log_ratio += l - b
        s = math.exp(log_ratio / L)
        A = ex["A"]
        m = 1.0
        if A > 0 and s > 1 + cfg.seq_clip_high:
            m, high = 0.0, high + 1
        if A < 0 and s < 1 - cfg.seq_clip_low:
            m, low = 0.0, low + 1
        inner = 0.0
        for row in ex["rows"]:
            g_row = []
            for l, b in row:
                rho = min(math.exp(l - b), cfg.token_is_cap)
                inner += rho * A * l
                g_row.append(-m * rho * A / L / len(E))
            g_ex.append(g_row)
        total += m / L * inner
        grads.append(g_ex)
    return -total / len(E), grads, high, low


def random_batch(rng: np.random.Generator):
    """Executions with 1..3 rows, some one-target, shifted to clip high/low or cap rho."""
    batch = []
    for _ in range(rng.integers(1, 7)):
        kind = rng.integers(0, 5)
        A = float(rng.choice([-1.3, -0.4, 0.0, 0.7, 1.9]))
        shift = {0: 0.0, 1: 0.02, 2: -0.02, 3: 2.0, 4: -0.001}[int(kind)]
        rows = []
        for _ in range(rng.integers(1, 4)):
            n = int(rng.integers(0, 5)) if rng.random() < 0.8 else 1
            row = []
            for _ in range(n):
                b = -float(rng.uniform(0.05, 4.0))
                row.append((b + shift + float(rng.normal(0, 0.003 if kind != 3 else 0.5)), b))
            rows.append(row)
        batch.append({"A": A, "rows": rows})
    return batch


def run_ours(batch, cfg, n_micro: int, rng, dtype=torch.float64):
    """Our objective over the batch's targets spread over ``n_micro`` micro-steps (random
    assignment per row, so executions split), with ``log_ratio_sum`` for split executions."""
    targets = []  # (micro, exec, row, tok, l, b)
    for e, ex in enumerate(batch):
        for r, row in enumerate(ex["rows"]):
            k = int(rng.integers(0, n_micro))
            for t, (l, b) in enumerate(row):
                targets.append((k, e, r, t, l, b))
    L = {e: sum(len(r) for r in ex["rows"]) for e, ex in enumerate(batch)}
    micro_of = {}
    for k, e, *_ in targets:
        micro_of.setdefault(e, set()).add(k)
    first = {e: min(ks) for e, ks in micro_of.items()}
    lrs = {e: sum(l - b for row in ex["rows"] for l, b in row) for e, ex in enumerate(batch)}
    loss_sum, norm, stats = 0.0, 0, ObjectiveStats()
    grads = {}
    for k in range(n_micro):
        mine = [t for t in targets if t[0] == k]
        execs = sorted({t[1] for t in mine})
        if not execs:
            continue
        loc = {e: i for i, e in enumerate(execs)}
        lp = torch.tensor([t[4] for t in mine], dtype=dtype, requires_grad=True)
        inp = ObjectiveInputs(
            behaviour_logprobs=torch.tensor([t[5] for t in mine], dtype=dtype),
            target_execution=torch.tensor([loc[t[1]] for t in mine], dtype=torch.int64),
            num_execution_targets=torch.tensor([L[e] for e in execs], dtype=torch.int64),
            advantages=torch.tensor([batch[e]["A"] for e in execs], dtype=torch.float64),
            counted=torch.tensor([first[e] == k for e in execs]),
            log_ratio_sum=torch.tensor([lrs[e] if len(micro_of[e]) > 1 else math.nan for e in execs],
                                       dtype=torch.float64),
        )
        out = execution_objective(lp, inp, cfg)
        out.loss_sum.backward()
        loss_sum += float(out.loss_sum.detach())
        norm += out.normaliser
        stats.merge(out.stats)
        for t, g in zip(mine, lp.grad.tolist()):
            grads[t[1:4]] = g
    grads = {k: g / norm for k, g in grads.items()}  # 1/|E| applied once, after all micro-steps
    return loss_sum / norm, grads, stats, norm


@pytest.mark.parametrize("n_micro", [1, 2, 3])
def test_matches_brute_force_reference(n_micro):
    cfg = ObjectiveConfig()
    seen = {"high": 0, "low": 0, "capped": 0, "one_target": 0, "multi_row": 0, "split": 0}
    rng = np.random.default_rng(100 + n_micro)
    for _ in range(60):
        batch = random_batch(rng)
        if not any(r for ex in batch for r in ex["rows"]):
            continue
        ref_loss, ref_grads, high, low = reference(batch, cfg)
        loss, grads, stats, norm = run_ours(batch, cfg, n_micro, rng)
        assert abs(loss - ref_loss) <= 1e-6 * max(1.0, abs(ref_loss))
        assert norm == sum(1 for ex in batch if any(ex["rows"]))
        for e, ex in enumerate(batch):
            for r, row in enumerate(ex["rows"]):
                for t in range(len(row)):
                    assert abs(grads[(e, r, t)] - ref_grads[e][r][t]) <= 1e-9
        assert (stats.clipped_high, stats.clipped_low) == (high, low)
        seen["high"] += high
        seen["low"] += low
        seen["capped"] += stats.capped
        seen["one_target"] += sum(1 for ex in batch if sum(len(r) for r in ex["rows"]) == 1)
        seen["multi_row"] += sum(1 for ex in batch if sum(1 for r in ex["rows"] if r) > 1)
    # the random batches exercised every case the issue lists
    assert all(v > 0 for k, v in seen.items() if k != "split"), seen


def test_float32_logprobs_match_reference_to_1e6():
    cfg = ObjectiveConfig()
    rng = np.random.default_rng(7)
    for _ in range(20):
        batch = random_batch(rng)
        if not any(r for ex in batch for r in ex["rows"]):
            continue
        # round the inputs to float32 first so both sides see the same numbers
        batch = [{"A": ex["A"], "rows": [[(float(np.float32(l)), float(np.float32(b))) for l, b in r]
                                         for r in ex["rows"]]} for ex in batch]
        ref_loss, *_ = reference(batch, cfg)
        loss, *_ = run_ours(batch, cfg, 2, rng, dtype=torch.float32)
        assert abs(loss - ref_loss) <= 1e-6 * max(1.0, abs(ref_loss))


def _one_microstep(l, b, ex, L, A, **kw):
    lp = torch.tensor(l, dtype=torch.float64, requires_grad=True)
    inp = ObjectiveInputs(torch.tensor(b, dtype=torch.float64), torch.tensor(ex), torch.tensor(L),
                          torch.tensor(A, dtype=torch.float64), **kw)
    return lp, inp


def test_mean_not_sum_of_log_ratios():
    """Bug case: s_i from the *sum* of log-ratios. Per-token log-ratio 0.003 over L_i = 4: the mean
    gives s = exp(0.003) = 1.003 (inside [0.995, 1.005], kept); the sum would give exp(0.012) =
    1.012 (clipped). Same for A < 0 with -0.003."""
    b = [-1.0, -2.0, -0.5, -3.0, -0.1, -0.2, -0.1, -0.3]
    l = [x + 0.003 for x in b[:4]] + [x - 0.003 for x in b[4:]]
    lp, inp = _one_microstep(l, b, [0] * 4 + [1] * 4, [4, 4], [1.0, -1.0])
    out = execution_objective(lp, inp, ObjectiveConfig())
    assert out.execution_mask.tolist() == [True, True]
    assert out.stats.clipped_high == out.stats.clipped_low == 0
    rho = [math.exp(0.003)] * 4 + [math.exp(-0.003)] * 4
    expected = -0.5 * (sum(r * 1.0 * x for r, x in zip(rho[:4], l[:4])) / 4
                       + sum(r * -1.0 * x for r, x in zip(rho[4:], l[4:])) / 4)
    assert abs(float(out.loss_sum.detach()) / out.normaliser - expected) < 1e-12
    np.testing.assert_allclose(out.token_weights.numpy(), [-r / 4 for r in rho[:4]] + [r / 4 for r in rho[4:]],
                               rtol=1e-12)
    # summing log-ratios would mask both executions: loss 0 and no gradient
    assert abs(expected) > 0.5


def test_per_execution_mean_not_global_token_mean():
    """Bug case (pinned definition): rewards [1, 0], lengths [2, 4], on-policy (l = b = -1).
    A = [1, -1]; our loss = -(1/|E|) sum_i (1/L_i) sum_t A_i l_t = -(1/2)(-1 + 1) = 0, each execution
    weighing the same. A global token mean would be -(1/6)(-2 + 4) = -1/3."""
    adv, *_ = group_advantages([1.0, 0.0])
    assert np.allclose(adv, [1.0, -1.0], atol=1e-5)
    lp, inp = _one_microstep([-1.0] * 6, [-1.0] * 6, [0, 0, 1, 1, 1, 1], [2, 4], adv.tolist())
    out = execution_objective(lp, inp, ObjectiveConfig())
    loss = out.loss_sum / out.normaliser
    loss.backward()
    token_mean = -(sum(a * -1.0 for a in [adv[0]] * 2 + [adv[1]] * 4)) / 6
    assert abs(float(loss) - 0.0) < 1e-5
    assert abs(token_mean - (-1 / 3)) < 1e-5
    assert abs(float(loss) - token_mean) > 0.3
    # per-token gradient weights: -A_i / (|E| L_i)
    np.testing.assert_allclose(lp.grad.numpy(), [-1 / 4] * 2 + [1 / 8] * 4, atol=1e-5)
    # grpo averages per execution too; ppo is the global token mean
    g = execution_objective(lp, inp, ObjectiveConfig(loss_type="grpo"))
    assert abs(float(g.loss_sum) / g.normaliser) < 1e-5 and g.normaliser == 2
    p = execution_objective(lp, inp, ObjectiveConfig(loss_type="ppo"))
    assert p.normaliser == 6 and abs(float(p.loss_sum) / p.normaliser - 1 / 3) < 1e-5


def test_clipping_both_directions_and_cap():
    cfg = ObjectiveConfig(token_is_cap=2.0)
    # ex0: A>0, s = e^0.01 > 1.005 -> masked; ex1: A<0, s = e^-0.01 < 0.995 -> masked;
    # ex2: A>0 with s < 1 -> kept (clip is direction-aware); ex3: A<0 with s = e > 1 -> kept,
    # its rho capped (l - b = 1 > log 2)
    b = [-1.0, -1.0, -1.0, -2.0]
    l = [-0.99, -1.01, -1.01, -1.0]
    lp, inp = _one_microstep(l, b, [0, 1, 2, 3], [1, 1, 1, 1], [1.0, -1.0, 1.0, -0.5])
    out = execution_objective(lp, inp, cfg)
    assert out.execution_mask.tolist() == [False, False, True, True]
    assert (out.stats.clipped_high, out.stats.clipped_low, out.stats.capped) == (1, 1, 1)
    m = out.stats.metrics()
    assert m["clip_fraction"] == 0.5 and m["rho_max"] == 2.0 and m["rho_capped_fraction"] == 0.25
    assert abs(m["train_inference_mismatch"] - (0.01 + 0.01 + 0.01 + 1.0) / 4) < 1e-12
    w = out.token_weights.tolist()
    assert w[0] == w[1] == 0.0 and abs(w[2] + math.exp(-0.01)) < 1e-12 and abs(w[3] - 2.0 * 0.5) < 1e-12


def test_split_execution_needs_log_ratio_sum():
    lp, inp = _one_microstep([-1.0], [-1.0], [0], [3], [1.0])
    with pytest.raises(ValueError, match="forward-only"):
        execution_objective(lp, inp)
    lp, inp = _one_microstep([-1.0], [-1.0], [0], [3], [1.0], log_ratio_sum=torch.tensor([0.03], dtype=torch.float64),
                             counted=torch.tensor([False]))
    out = execution_objective(lp, inp)
    assert out.execution_mask.tolist() == [False]  # s = e^0.01 > 1.005, A > 0
    assert out.normaliser == 0 and out.stats.executions == 0


@pytest.mark.parametrize("bad, match", [
    (dict(advantages=[math.nan]), "finite"),
    (dict(L=[0]), "L_i"),
    (dict(ex=[1]), "out of range"),
])
def test_bad_inputs_are_clear_errors(bad, match):
    lp, inp = _one_microstep([-1.0], [-1.0], bad.get("ex", [0]), bad.get("L", [1]), bad.get("advantages", [1.0]))
    with pytest.raises(ValueError, match=match):
        execution_objective(lp, inp)


def test_config_validation_and_from_args():
    with pytest.raises(ValueError):
        ObjectiveConfig(loss_type="dpo")
    with pytest.raises(ValueError):
        ObjectiveConfig(token_is_cap=0)
    with pytest.raises(ValueError):
        ObjectiveConfig(seq_clip_low=1.0)
    from gyre.arguments import parse_args

    args = parse_args(["--loss-type", "grpo", "--token-is-cap", "3", "--seq-clip-high", "0.01",
                       "--token-clip-low", "0.1"])
    cfg = ObjectiveConfig.from_args(args)
    assert (cfg.loss_type, cfg.token_is_cap, cfg.seq_clip_high, cfg.token_clip_low) == ("grpo", 3.0, 0.01, 0.1)


# --------------------------------------------------------------------------- gradcheck


class _Toy(torch.nn.Module):
    """A tiny causal float64 'language model': h_t = tanh(mean_{u<=t} E[x_u] @ A); logits = h W^T."""

    def __init__(self, vocab=11, dim=5, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(vocab, dim, generator=g, dtype=torch.float64) * 0.5)
        self.mix = torch.nn.Parameter(torch.randn(dim, dim, generator=g, dtype=torch.float64) * 0.5)
        self.out = torch.nn.Parameter(torch.randn(vocab, dim, generator=g, dtype=torch.float64) * 0.5)

    def hidden(self, x, emb, mix):
        e = emb[x]
        c = e.cumsum(0) / torch.arange(1, x.shape[0] + 1, dtype=e.dtype)[:, None]
        return torch.tanh(c @ mix)


@pytest.mark.parametrize("loss_type", ["gspo", "grpo", "ppo"])
def test_gradcheck_float64_tiny_model(loss_type):
    toy = _Toy()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 11, (9,), generator=g)
    # targets: tokens 1..8 of two executions (ex0: positions 1-4, ex1: 5-8), predicted from t-1
    index = torch.arange(0, 8)
    targets = x[1:9]
    ex = torch.tensor([0] * 4 + [1] * 4)
    with torch.no_grad():
        l0, _ = target_logprobs_from_hidden(toy.hidden(x, toy.emb, toy.mix), toy.out, index, targets, chunk_size=3)
    # behaviour close to l0 so the ratios sit inside/outside the clip ranges away from kinks
    b = l0 + torch.tensor([0.3, -0.2, 0.1, 0.05, -0.4, 0.2, -0.1, 0.15], dtype=torch.float64)
    inp = ObjectiveInputs(b, ex, torch.tensor([4, 4]), torch.tensor([0.8, -1.2], dtype=torch.float64))
    cfg = ObjectiveConfig(loss_type=loss_type, seq_clip_low=0.5, seq_clip_high=0.5, token_clip_low=0.25,
                          token_clip_high=0.25, token_is_cap=1.3)

    def f(emb, mix, out):
        lp, _ = target_logprobs_from_hidden(toy.hidden(x, emb, mix), out, index, targets, chunk_size=3)
        # gspo: sg(l_t) (rho, s_i, masks) held at the current point, as the trainer's surrogate
        ref = l0 if loss_type == "gspo" else None
        o = execution_objective(lp, inp, cfg, reference_logprobs=ref)
        return o.loss_sum / o.normaliser

    params = tuple(p.detach().clone().requires_grad_(True) for p in (toy.emb, toy.mix, toy.out))
    assert torch.autograd.gradcheck(f, params, eps=1e-6, atol=1e-7, rtol=1e-5)
