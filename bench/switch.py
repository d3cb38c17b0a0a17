#!/usr/bin/env python
"""Role-switch latency of a cell on the CPU default (paper: 8.52 s R->T, 3.46 s T->R).

    python bench/switch.py [--switches 10] [--tokenizer local|qwen]

Starts two embedded engines behind the proxy (cell 1 and a destination), keeps one execution
generating on cell 1, and switches cell 1 rollout -> training -> rollout ``--switches`` times:
reroute + abort (the proxy retries at the destination), engine ``release_memory_occupation``,
training state restored; then training state offloaded, ``resume_memory_occupation`` and a
weight update with a new version.  Prints per-phase medians and a JSON line.
"""

import argparse
import json
import statistics
import threading
import time

import httpx


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--switches", type=int, default=10)
    p.add_argument("--tokenizer", choices=("local", "qwen"), default="local")
    a = p.parse_args()

    import torch

    from gyre.embedded_model import ensure_tiny_model, load_hf_model
    from gyre.proxy.serve import RolloutService, parse_args
    from gyre.rollout.client.engine_client import EngineClient
    from gyre.training.cell import CellRoles, TrainingState

    model_dir = str(ensure_tiny_model(a.tokenizer))
    svc = RolloutService(parse_args(["--num-engines", "2", "--tokenizer-kind", a.tokenizer, "--port", "0",
                                     "--save-dir", "/tmp/gyre-bench-switch"]))
    proxy = svc.start()
    trainer = load_hf_model(model_dir).train()
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-6)
    trainer(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()  # optimizer state exists, so it is offloaded/restored too
    state = TrainingState(trainer.parameters(), opt)
    state.offload()  # the cell starts in rollout
    named = {k: v.detach().clone() for k, v in load_hf_model(model_dir).state_dict().items()}
    client = EngineClient(svc.engines[1].url)
    cell = CellRoles(1, "engine-1", client, proxy, state)

    reg = httpx.post(f"{proxy.url}/gyre/executions", json={"task_id": "bench", "harness": "bench"}).json()
    proxy.set_route(reg["execution_id"], "engine-1")
    stop = threading.Event()
    calls = {"ok": 0, "errors": 0}

    def harness():
        with httpx.Client(timeout=120) as h:
            msgs = [{"role": "user", "content": "Tell me a long story."}]
            while not stop.is_set():
                r = h.post(f"{proxy.url}/v1/chat/completions", headers={"Authorization": f"Bearer {reg['api_key']}"},
                           json={"model": "m", "messages": msgs, "max_tokens": 64, "ignore_eos": True})
                calls["ok" if r.status_code == 200 else "errors"] += 1

    th = threading.Thread(target=harness, daemon=True)
    th.start()
    time.sleep(1.0)
    for i in range(a.switches):
        cell.to_train("engine-0")
        time.sleep(0.2)
        cell.to_rollout(str(i + 1), named)
        proxy.set_route(reg["execution_id"], "engine-1")  # the scheduler routes work back to the cell
        time.sleep(0.2)
    stop.set()
    th.join(60)
    counters = proxy.counters(reg["execution_id"])
    svc.stop()
    out = {"switches": a.switches, "harness_calls_ok": calls["ok"], "harness_errors": calls["errors"],
           "reroutes": counters.get("reroutes"), "retries": counters.get("retries")}
    for direction in ("rollout->training", "training->rollout"):
        trs = [t for t in cell.transitions if t.direction == direction]
        out[direction] = {"median_s": round(statistics.median(t.latency_s for t in trs), 4),
                          "max_s": round(max(t.latency_s for t in trs), 4)}
        for phase in trs[0].phases_s:
            out[direction][phase + "_median_s"] = round(statistics.median(t.phases_s[phase] for t in trs), 4)
        print(f"{direction:18s} median {out[direction]['median_s'] * 1000:8.1f} ms   max {out[direction]['max_s'] * 1000:8.1f} ms   "
              + "  ".join(f"{k}={v * 1000:.1f}ms" for k, v in out[direction].items() if k.endswith('_median_s') and k != 'median_s'))
    print(f"harness calls ok {calls['ok']}, errors {calls['errors']}, proxy reroutes {out['reroutes']}, retries {out['retries']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
