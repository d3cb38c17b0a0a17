"""torchrun worker: the Megatron train step at tensor parallelism ``--tp`` against the single-process
HF step on the same packed batch of the tiny model; dumps the measured differences as JSON.

Run by tests/integration/test_train_step_megatron_tp.py as
``torchrun --nproc-per-node 2 megatron_tp_worker.py --tp 2 --out OUT.json``. Every rank also runs
the single-process HF reference (the tiny model is cheap). Measured, each as a max abs difference:

* ``lp`` / ``ent`` / ``lp_t07``: target log-probs and entropy of the packed micro-step
  (:class:`MegatronPolicy` vs :class:`HFPolicy`), and the log-probs at temperature 0.7;
* ``grad``: per HF parameter, the gradients after ``accumulate`` one micro-step at a time, gathered
  to HF layout, vs the HF step's un-normalised gradients;
* ``grad_unreduced`` / ``grad_reduced``: the same after one ``forward_backward(finalize=False)``
  (no TP reduction: the negative control) and after ``reduce_tensor_parallel_grads``;
* ``weights`` / ``saved``: the gathered HF weights, and those of the checkpoint ``save_hf`` wrote,
  vs the HF model's; ``update``: the weights after
  ``optimizer_step(|E|)`` vs the HF step's after its update; ``finalized``: one full Megatron step
  (``finalize_model_grads``) vs the HF step: loss, grad norm, weights.
"""

import argparse
import copy
import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]


def max_diffs(a: dict, b: dict) -> dict:
    return {n: float((a[n].float() - b[n].float()).abs().max()) for n in b}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    from gyre.buffer.packing import PackingConfig, pack_rows
    from gyre.embedded_model import ensure_tiny_model, load_hf_model
    from gyre.training.hf_step import HFPolicy, HFTrainStep
    from gyre.training.megatron_model import initialize_megatron_cpu
    from gyre.training.megatron_step import MegatronPolicy, build_megatron_train_step
    from gyre.training.step import MicroStepBatch, apply_log_ratio_sums
    from tests.training.test_step import pack_into, trace_batch, with_behaviour_near_policy

    initialize_megatron_cpu(a.tp, 1, seed=1234)
    torch.manual_seed(0)
    hf = load_hf_model(ensure_tiny_model("local"))
    rows = with_behaviour_near_policy(hf, trace_batch(ROOT / "tests" / "data" / "traces", scale=1 / 96, seed=2),
                                      seed=2)
    rec: dict = {"rank": dist.get_rank(), "tp": a.tp}

    # the function alone: random logits split over the TP ranks vs the whole vocabulary
    from gyre.training.logprobs import target_logprobs_from_logits
    from megatron.core import parallel_state as ps

    g = torch.Generator().manual_seed(3)
    full = (4 * torch.randn(40, 24, generator=g, dtype=torch.float64)).requires_grad_(True)
    index = torch.randint(0, 40, (57,), generator=g)
    index[:3] = 5  # repeated predicting positions
    targets = torch.randint(0, 24, (57,), generator=g)
    w = torch.randn(57, generator=g, dtype=torch.float64)
    naive = torch.log_softmax(full, -1)
    (g_full,) = torch.autograd.grad((naive[index, targets] * w).sum(), (full,))
    width, t = 24 // a.tp, ps.get_tensor_model_parallel_rank()
    fn = {}
    for chunk in (1, 7, 4096):
        shard = full.detach()[:, t * width:(t + 1) * width].clone().requires_grad_(True)
        lp, ent = target_logprobs_from_logits(shard, index, targets, chunk, with_entropy=True,
                                              group=ps.get_tensor_model_parallel_group())
        (g_shard,) = torch.autograd.grad((lp * w).sum(), (shard,))
        fn[chunk] = {"lp": float((lp - naive[index, targets]).abs().max()),
                     "ent": float((ent + (naive.exp() * naive).sum(-1)[index]).abs().max()),
                     "grad": float((g_shard - g_full[:, t * width:(t + 1) * width]).abs().max())}
    rec["function"] = fn

    # (a) log-probs and entropy of one tree-packed micro-step
    (ms,) = pack_rows(rows, PackingConfig(100_000, "pack", tree=True)).micro_steps
    batch = MicroStepBatch.from_micro_step(ms)
    step = build_megatron_train_step(hf)
    with torch.no_grad():
        lp_h, ent_h = HFPolicy(hf)(batch)
        lp_m, ent_m = step.policy(batch)
        lp_h7, _ = HFPolicy(hf, temperature=0.7)(batch)
        lp_m7, _ = MegatronPolicy(step.model, temperature=0.7)(batch)
    rec["targets"] = int(lp_h.numel())
    rec["lp"] = float((lp_m - lp_h).abs().max())
    rec["ent"] = float((ent_m - ent_h).abs().max())
    rec["lp_t07"] = float((lp_m7 - lp_h7).abs().max())
    rec["lp_t07_vs_t1"] = float((lp_h7 - lp_h).abs().max())
    rec["vocab_shard"] = int(step.policy.logits(step.model, batch).shape[-1])

    # the single-process HF reference: un-normalised gradients, then its update
    ref = HFTrainStep(copy.deepcopy(hf))
    ref_ms = pack_into(rows, 3).micro_steps
    sums, _ = ref.precompute_log_ratio_sums(ref_ms)
    apply_log_ratio_sums(ref_ms, sums)
    ref.zero_grad()
    n_ref, _ = ref.forward_backward(ref_ms)
    g_ref = {n: p.grad.detach().clone() for n, p in ref.model.named_parameters()}
    rec["ref_grad_scale"] = {n: float(g.abs().max()) for n, g in g_ref.items()}
    # the exact norm of the normalised gradients (fp32 norms on CPU are off by up to ~5e-5 relative)
    rec["ref_grad_norm_fp64"] = float(sum((g.double() / n_ref).pow(2).sum() for g in g_ref.values()).sqrt())
    ref_norm = ref.optimizer_step(n_ref)
    w_ref = {n: p.detach().clone() for n, p in ref.model.named_parameters()}

    # (e) the gathered HF weights are the HF model's
    named = step.hf_named([p.detach() for p in step.params])
    rec["weights"] = max_diffs(named, dict(hf.named_parameters()))
    rec["weight_names"] = sorted(named)
    rec["hf_names"] = sorted(n for n, _ in hf.named_parameters())
    saved = Path(a.out).parent / "saved-hf"
    step.save_hf(saved)  # gathered on every TP rank, written by TP rank 0
    dist.barrier()
    back = dict(load_hf_model(saved).named_parameters())
    rec["saved"] = max_diffs(back, dict(hf.named_parameters()))

    # (b) the streaming cell's accumulate, one micro-step at a time
    step.zero_grad()
    ms3 = pack_into(rows, 3).micro_steps
    sums, _ = step.precompute_log_ratio_sums(ms3)
    apply_log_ratio_sums(ms3, sums)
    normaliser = 0
    for m in ms3:
        n, _ = step.accumulate([m])
        normaliser += n
    rec["normaliser"], rec["ref_normaliser"] = normaliser, n_ref
    rec["grad"] = max_diffs(step.hf_named(step.grad_tensors()), g_ref)
    norm = step.optimizer_step(normaliser)
    rec["grad_norm"], rec["ref_grad_norm"] = norm, ref_norm
    rec["update"] = max_diffs(step.hf_named([p.detach() for p in step.params]), w_ref)

    # (c) negative control: no TP reduction, then the reduction
    neg = build_megatron_train_step(hf)
    neg.zero_grad()
    ms3 = pack_into(rows, 3).micro_steps
    sums, _ = neg.precompute_log_ratio_sums(ms3)
    apply_log_ratio_sums(ms3, sums)
    neg.forward_backward(ms3, finalize=False)
    rec["grad_unreduced"] = max_diffs(neg.hf_named(neg.grad_tensors()), g_ref)
    neg.reduce_tensor_parallel_grads()
    rec["grad_reduced"] = max_diffs(neg.hf_named(neg.grad_tensors()), g_ref)

    # the full Megatron step (finalize_model_grads) vs the HF step
    full = build_megatron_train_step(hf)
    hstep = HFTrainStep(copy.deepcopy(hf))
    rm = full(pack_into(rows, 3).micro_steps).metrics
    rh = hstep(pack_into(rows, 3).micro_steps).metrics
    rec["finalized"] = {
        "loss": abs(rm["loss"] - rh["loss"]), "entropy": abs(rm["entropy"] - rh["entropy"]),
        "grad_norm": rm["grad_norm"], "ref_grad_norm": rh["grad_norm"],
        "weights": max(max_diffs(full.hf_named([p.detach() for p in full.params]),
                                 dict(hstep.model.named_parameters())).values())}

    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, rec)
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(objs))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    gc.freeze()  # the collections at exit skip what lived until now (seconds with Torch loaded)
