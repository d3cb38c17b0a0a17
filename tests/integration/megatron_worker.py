"""torchrun worker: train the embedded tiny model with Megatron on CPU and dump losses/params.

Run by tests/integration/test_megatron_cpu.py as
``torchrun --nproc-per-node W megatron_worker.py --tp T --pp P --steps S --out OUT.json``.
Each step runs ``get_forward_backward_func`` over 2 micro-batches of a fixed, seeded global batch
(split across data-parallel ranks), then one optimizer step.
"""

import argparse
import gc
import hashlib
import json
import os

import torch
import torch.distributed as dist

from gyre.embedded_model import ensure_tiny_model, load_hf_model
from gyre.training.checkpoint_conversion import hf_to_megatron, load_into_megatron, megatron_state_dict
from gyre.training.megatron_model import (build_gpt_model, build_optimizer, causal_attention_mask,
                                          initialize_megatron_cpu, transformer_config_from_hf, wrap_ddp)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", required=True)
    p.add_argument("--skip-finalize-grads", action="store_true",
                   help="negative control: unset config.finalize_model_grads_func (no DP all-reduce)")
    a = p.parse_args()

    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    initialize_megatron_cpu(a.tp, a.pp, seed=1234)
    hf = load_hf_model(ensure_tiny_model("local"))
    cfg = hf.config
    tcfg = transformer_config_from_hf(cfg)
    model = build_gpt_model(cfg, tcfg)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    load_into_megatron(model, hf_to_megatron(hf.state_dict(), cfg, tp_rank, a.tp, pp_rank, a.pp))
    ddp = wrap_ddp(model, tcfg)
    if a.skip_finalize_grads:
        tcfg.finalize_model_grads_func = None
    opt = build_optimizer(ddp, lr=a.lr, clip_grad=1.0)

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 4000, (a.steps, a.global_batch, a.seq + 1), generator=g)
    micro_batches, per_dp = 2, a.global_batch // dp
    mbs = per_dp // micro_batches
    mask = causal_attention_mask(a.seq)
    pos = torch.arange(a.seq)[None].expand(mbs, -1)

    def loss_func(loss_mask, output_tensor):
        loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
        return loss, {"lm loss": loss.detach().clone()}

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        out = model(batch[:, :-1], pos, mask, labels=batch[:, 1:])
        return out, lambda t: loss_func(torch.ones_like(batch[:, 1:], dtype=torch.float), t)

    fbf = get_forward_backward_func()
    losses = []
    for step in range(a.steps):
        local = data[step, dp_rank * per_dp:(dp_rank + 1) * per_dp]
        it = iter(local.split(mbs))
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = fbf(forward_step_func=forward_step, data_iterator=it, model=[ddp], num_microbatches=micro_batches,
                  seq_length=a.seq, micro_batch_size=mbs, forward_only=False)
        ok, grad_norm, _ = opt.step()
        loss = torch.tensor(sum(float(o["lm loss"]) for o in out) / micro_batches if out else 0.0)
        # mean over DP on the last stage, then share with every rank
        if ps.is_pipeline_last_stage():
            dist.all_reduce(loss, group=ps.get_data_parallel_group())
            loss /= dp
        dist.broadcast(loss, src=dist.get_world_size() - 1)
        losses.append(float(loss))

    # parameters of this shard, and the same shard on every DP replica
    sd = megatron_state_dict(ddp)
    flat = torch.cat([v.flatten().float() for _, v in sorted(sd.items())])
    gathered = [torch.zeros_like(flat) for _ in range(dp)]
    dist.all_gather(gathered, flat, group=ps.get_data_parallel_group())
    max_replica_diff = max(float((x - flat).abs().max()) for x in gathered)
    init = hf_to_megatron(hf.state_dict(), cfg, tp_rank, a.tp, pp_rank, a.pp)
    changed = max(float((sd[k] - init[k]).abs().max()) for k in init)
    rec = {"rank": dist.get_rank(), "tp": a.tp, "pp": a.pp, "dp": dp, "losses": losses,
           "max_replica_diff": max_replica_diff, "max_param_change": changed,
           "grad_norm": float(grad_norm) if grad_norm is not None else None,
           "sha": hashlib.sha256(flat.numpy().tobytes()).hexdigest()}
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, rec)
    if dist.get_rank() == 0:
        with open(a.out, "w") as fh:
            json.dump(objs, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    gc.freeze()  # the collections at exit skip what lived until now (seconds with Torch loaded)
