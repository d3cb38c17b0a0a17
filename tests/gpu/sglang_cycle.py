"""Phase f of the GPU check: a cell's SGLang server through two rollout -> training -> rollout
cycles, driven as the main job drives it (:class:`gyre.training.cell.CellRoles` with an
:class:`gyre.rollout.sglang_driver.weights.SGLangTensorClient`).

On a GPU the server runs in bfloat16 with SGLang's memory saver and CUDA graphs on; the trainer
(the embedded tiny Qwen3, fp32) shares the GPU and pushes its weights by CUDA IPC.  The cycle:

1. rollout: a greedy generation with log-probs (the reference), then a long request that is still
   running (``/v1/loads`` counts it) when the cell switches to training;
2. rollout -> training: the running request comes back aborted, the server holds none, and the
   release gives back the memory the server took at start-up (nvidia-smi);
3. training: a stand-in update (seeded noise on every weight);
4. training -> rollout: the weights are pushed inside a weight-update session (the probe finds
   sessions), the server's greedy log-probs now follow the updated weights (an fp32 forward on
   the host; bf16 tolerance) and differ from the reference;
5. the second cycle pushes the original weights back: the greedy tokens and log-probs equal the
   reference (the CUDA graphs captured at start-up replay on the resumed memory), and the resumed
   server takes no more memory than after the first cycle.

Emulated on a CPU (``gpu_check.py --emulate-on-cpu`` run with the Python of the SGLang
environment ``tools/setup_sglang.sh`` makes) the same cycle runs against a CPU server (float32, no
memory saver, no CUDA graphs, weights as shared-memory files instead of CUDA IPC); nothing is
measured of memory there.  Only endpoints SGLang 0.5.23 serves are called: the requests a server
holds are read from ``/v1/loads`` (:func:`held_requests`), not the ``/get_load`` it removed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

#: SGLang flags of the GPU server: memory saver and CUDA graphs on (batch sizes up to 4 captured).
GPU_ARGV = ["--enable-memory-saver", "--dtype", "bfloat16", "--mem-fraction-static", "0.3",
            "--cuda-graph-max-bs", "4", "--attention-backend", "triton", "--max-running-requests", "8",
            "--context-length", "16384", "--skip-server-warmup", "--log-level", "warning"]
#: SGLang flags of the CPU server (emulation; its launcher adds ``--device cpu --dtype float32``).
CPU_ARGV = ["--max-total-tokens", "4096", "--context-length", "1024", "--mem-fraction-static", "0.5",
            "--skip-server-warmup", "--sleep-on-idle", "--log-level", "warning"]
PROMPT = [17, 23, 99, 512, 7, 301, 44, 1001, 5, 88]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
#: The server's log-probs against the host's fp32 forward: bfloat16 on a GPU, float32 emulated.
HF_TOLERANCE = {"gpu": 0.1, "cpu": 1e-3}
#: The reference rollout against the one after the original weights came back.
SAME_TOLERANCE = 1e-4


def held_requests(url: str, timeout: float = 10.0) -> int:
    """Requests an SGLang server holds, running or waiting, over all its schedulers
    (``GET /v1/loads?include=core``, SGLang 0.5.23).

    Raises:
        RuntimeError: the server does not answer 200 (an SGLang without ``/v1/loads`` answers 404;
            reading that as 0 would make a caller wait for a request it can never see).
    """
    import httpx

    r = httpx.get(url + "/v1/loads", params={"include": "core"}, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"GET /v1/loads answered {r.status_code}: {r.text[:300]}")
    return sum(int(x["num_running_reqs"]) + int(x["num_waiting_reqs"]) for x in r.json()["loads"])


def _memory_section(url: str) -> dict:
    """``/v1/loads``' memory section of the first scheduler (weights, KV cache, CUDA graphs, GB)."""
    import httpx

    loads = httpx.get(url + "/v1/loads", params={"include": "memory"}, timeout=10).json()["loads"]
    return loads[0].get("memory") or {}


def _host_logprobs(model_dir, weights: dict, ids: list[int], n_prompt: int) -> list[float]:
    """Log-probs of ``ids[n_prompt:]`` under ``weights`` (host tensors), an fp32 forward on the CPU."""
    import torch

    from gyre.embedded_model import load_hf_model

    model = load_hf_model(model_dir)
    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [float(lp[n_prompt - 1 + j, t]) for j, t in enumerate(ids[n_prompt:])]


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")


def run_cycle(tmp: Path, *, emulate: bool, used_mib: Callable[[], int], deadline: float) -> dict:
    """The two cycles above; ``used_mib``: GPU memory in use (MiB, every process), ``deadline``:
    ``time.monotonic()`` by which the server must have started.  Returns the result with
    ``status`` ``pass`` or ``fail``."""
    import torch

    from gyre.embedded_model import ensure_tiny_model, load_hf_model
    from gyre.rollout.sglang_driver.engine import SGLangEngine
    from gyre.rollout.sglang_driver.launch import cpu_server_launcher
    from gyre.rollout.sglang_driver.weights import SGLangTensorClient
    from gyre.training.cell import CellRoles, TrainingState

    dev = "cpu" if emulate else "cuda:0"
    if emulate:
        launcher = cpu_server_launcher()
        if launcher is None:
            return {"status": "skip", "reason": "emulated: this Python is not an SGLang environment of "
                                                "tools/setup_sglang.sh (no bin/sglang-server)"}
        launcher, argv = [str(launcher)], CPU_ARGV
    else:
        launcher, argv = None, GPU_ARGV
    model_dir = ensure_tiny_model("qwen")
    trainer = load_hf_model(model_dir).to(dev)
    skip = {"lm_head.weight"} if trainer.config.tie_word_embeddings else set()
    original = {n: t.detach().cpu().clone() for n, t in trainer.state_dict().items() if n not in skip}
    training = TrainingState(list(trainer.parameters()))
    training.offload()  # the cell starts serving rollouts: its training state is off the device
    base = used_mib()
    engine = SGLangEngine(model_dir, launcher=launcher, server_argv=argv, log_path=tmp / "sglang_f.log",
                          startup_timeout=max(60.0, deadline - time.monotonic())).start()
    out: dict = {"device": dev, "server_argv": argv}
    try:
        client = SGLangTensorClient(engine.client(timeout=120), dev, 1)
        cell = CellRoles(0, "engine-0", client, None, training)
        ref = client.generate(PROMPT, GREEDY)
        out["memory_gb_at_start"] = _memory_section(engine.url)
        started = used_mib()
        out["server_mib"] = started - base

        box: dict = {}
        long_run = threading.Thread(target=lambda: box.update(r=client.generate(
            [3, 1, 4, 1, 5], {"max_new_tokens": 900 if emulate else 15000, "ignore_eos": True},
            rid="phase-f-long")))
        long_run.start()
        t0 = time.monotonic()
        while held_requests(engine.url) < 1 and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        out["held_before_switch"] = held_requests(engine.url)

        rounds, after_rollout = [], []
        weights_for = [None, original]  # round 1: a stand-in update; round 2: the original weights back
        for k, wanted in enumerate(weights_for, start=1):
            reserved0, used0 = torch.cuda.memory_reserved() if not emulate else 0, used_mib()
            cell.to_train(None)
            if k == 1:
                long_run.join(60)
                out["long_request_aborted"] = bool(box.get("r") is not None and box["r"].aborted)
            held = held_requests(engine.url)
            # what the server gave back: the drop in use, plus what this process took for its restore
            freed = (used0 - used_mib()) + (((torch.cuda.memory_reserved() - reserved0) >> 20) if not emulate else 0)
            with torch.no_grad():
                if wanted is None:
                    g = torch.Generator(device=dev).manual_seed(k)
                    for p in trainer.parameters():
                        p.add_(0.02 * torch.randn(p.shape, generator=g, device=dev))
                else:
                    trainer.load_state_dict({n: t.to(dev) for n, t in wanted.items()}, strict=False)
            pushed = {n: t.detach().clone() for n, t in trainer.state_dict().items() if n not in skip}
            host = {n: t.cpu() for n, t in pushed.items()}
            cell.to_rollout(str(k), pushed)
            del pushed
            if not emulate:
                torch.cuda.empty_cache()
            after_rollout.append(used_mib())
            r = client.generate(PROMPT, GREEDY)
            lp_host = _host_logprobs(model_dir, host, PROMPT + r.output_ids, len(PROMPT))
            rounds.append({"held_after_switch": held, "freed_mib": freed,
                           "freed_fraction": round(freed / max(1, out["server_mib"]), 4),
                           "weight_version": r.weight_version,
                           "logprob_vs_host_max_abs_diff": _max_diff(r.output_logprobs, lp_host),
                           "logprob_vs_reference_max_abs_diff": _max_diff(r.output_logprobs, ref.output_logprobs),
                           "same_tokens_as_reference": r.output_ids == ref.output_ids})
        out.update(rounds=rounds, sessions=client.sessions, transitions=[
            {"direction": t.direction, "s": round(t.latency_s, 3)} for t in cell.transitions])
        out["growth_mib"] = after_rollout[1] - after_rollout[0]
    finally:
        engine.stop()
    first, second = out["rounds"]
    tol = HF_TOLERANCE["cpu" if emulate else "gpu"]
    checks = {
        "a running request was held, then aborted by the switch":
            out["held_before_switch"] >= 1 and out["long_request_aborted"],
        "nothing held after each switch": first["held_after_switch"] == second["held_after_switch"] == 0,
        "the server has weight-update sessions": out["sessions"] is True,
        "pushes carry their versions": (first["weight_version"], second["weight_version"]) == ("1", "2"),
        "log-probs follow the pushed weights": max(first["logprob_vs_host_max_abs_diff"],
                                                   second["logprob_vs_host_max_abs_diff"]) < tol,
        "the update changed the log-probs": first["logprob_vs_reference_max_abs_diff"] > 10 * SAME_TOLERANCE,
        "the original weights give the reference back": second["same_tokens_as_reference"]
            and second["logprob_vs_reference_max_abs_diff"] <= SAME_TOLERANCE,
    }
    if not emulate:
        checks["each release frees >= 80% of the server's memory"] = min(
            first["freed_fraction"], second["freed_fraction"]) >= 0.8
        checks["no growth from one cycle to the next (< 256 MiB)"] = out["growth_mib"] < 256
    out["failed_checks"] = [name for name, ok in checks.items() if not ok]
    return {"status": "fail" if out["failed_checks"] else "pass", **out}
