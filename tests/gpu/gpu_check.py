"""The GPU check: what the CPU suite cannot show, run on one CUDA machine in a few minutes.

    python tests/gpu/gpu_check.py --out gpu_check.json [--phases a,b,c,d,e,f]

(``tests/gpu/gpu_check.sh`` installs what is missing first and calls this.)  Each phase runs in
its own process with its own time limit, so one failure or hang does not hide the others; the
result is one JSON object ``{"phases": {name: {"status": "pass"|"fail"|"skip", ...}}, "passed":
bool, ...}`` printed and written to ``--out`` (``passed``: every phase ran and passed, but f, which
may be skipped where SGLang is not installed; the exit status is 0 only then).  No model is downloaded: the embedded tiny Qwen3
(or a larger one built from a config with random weights for the memory phase) is used.

Phases:
  a  the Megatron train step on CUDA equals the HF step on CUDA (loss and gradients within 1e-5 in
     fp32), also with the fused attention kernels (no dense mask; gradients within 1e-4); the same
     step in bf16 gives finite loss and gradients;
  b  2 cells x TP 2 on one GPU (4 ranks, gloo over CUDA tensors): the main job's streaming step
     equals the single-process step (``tests/integration/tp_cells_worker.py --device cuda``);
  c  the training-state hand-over (fp32, and bf16 with fp32 main parameters) frees >= 90% of the
     trainer's GPU memory (nvidia-smi) and restores it bit-identically; GB/s each way;
  d  a weight push by CUDA IPC (flattened buckets) into an embedded engine process on the GPU: the
     engine's log-probs equal the trainer's, 20 pushes with no memory growth;
  e  ``torchrun --nproc-per-node 2 pretrain_gyre.py --backend gpu`` (embedded CUDA engines, gloo)
     runs 2 steps with role changes;
  f  SGLang 0.5.23, when ``import sglang`` works (else skipped): a cell's server with the memory
     saver and CUDA graphs on through two rollout -> training -> rollout cycles, weights pushed by
     CUDA IPC inside weight-update sessions (memory freed, log-probs follow each push and equal the
     first rollout's once the original weights are back; ``tests/gpu/sglang_cycle.py``), then
     ``tests/gpu/test_sglang_shared_kv.py`` (a prompt moved to a second server finds its prefix in
     the shared Mooncake store) with the time left.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

#: ``--emulate-on-cpu`` (a test of this script on a machine without a GPU): the phases run their
#: code on CPU with gloo, and the GPU-only measurements (nvidia-smi) are left out.
EMULATE = os.environ.get("GYRE_GPU_CHECK_EMULATE") == "1"
DEV = "cpu" if EMULATE else "cuda"
#: Weight pushes of phase d (GPU memory is read after each; emulated on CPU, fewer show the code runs).
PUSHES = 5 if EMULATE else 20
#: Steps of phase e's main job (emulated on CPU, one shows the code runs).
MAIN_JOB_STEPS = 1 if EMULATE else 2

#: phase -> (what, seconds allowed)
PHASES = {"a": ("megatron_step_equals_hf_step", 150), "b": ("cells_tp2_on_one_gpu", 80),
          "c": ("training_state_offload", 90), "d": ("cuda_ipc_weight_push", 50),
          "e": ("main_job_backend_gpu", 110), "f": ("sglang", 50)}  # 530 s in all at most
#: SGLang's phase (f, last) may also use what (a)-(e) left of this many seconds (it starts 3 servers).
TOTAL_S = 530


def _limit(name: str) -> int:
    """Seconds phase ``name`` may take: the GPU machine's (16 cores) limit, 4x when emulating on a
    small CPU box."""
    return PHASES[name][1] * (4 if os.environ.get("GYRE_GPU_CHECK_EMULATE") == "1" else 1)


def _gpu_used_mib() -> int:
    """Memory in use on this process's GPU 0 by every process, MiB, as nvidia-smi reports it (the
    device's index taken from ``CUDA_VISIBLE_DEVICES``); the driver's own count
    (``torch.cuda.mem_get_info``) where nvidia-smi does not answer; 0 when emulating."""
    if EMULATE:
        return 0
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", first],
                             capture_output=True, text=True, check=True, timeout=20).stdout
        return int(out.strip().splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        import torch

        free, total = torch.cuda.mem_get_info(0)
        return (total - free) >> 20


def _micro_steps(hf, seed: int):
    from gyre.buffer.packing import PackingConfig, pack_rows
    from tests.training.test_step import trace_batch, with_behaviour_near_policy

    rows = with_behaviour_near_policy(hf, trace_batch(ROOT / "tests" / "data" / "traces", scale=1 / 96, seed=seed),
                                      seed=seed)
    return lambda: pack_rows(rows, PackingConfig(100_000, "pack", tree=True)).micro_steps


def phase_a() -> dict:
    import copy

    import torch

    from gyre.embedded_model import ensure_tiny_model, load_hf_model
    from gyre.training.checkpoint_conversion import megatron_to_hf
    from gyre.training.hf_step import HFTrainStep
    from gyre.training.megatron_model import init_process_group_from_env, initialize_megatron_cpu
    from gyre.training.megatron_step import build_megatron_train_step

    if not EMULATE:
        torch.cuda.set_device(0)
    init_process_group_from_env("gloo" if EMULATE else "nccl")
    initialize_megatron_cpu(1, 1, seed=1234, cpu=EMULATE)
    hf_cpu = load_hf_model(ensure_tiny_model("local"))
    micro = _micro_steps(hf_cpu, seed=2)
    hf = copy.deepcopy(hf_cpu).to(DEV)
    ref = HFTrainStep(copy.deepcopy(hf))
    rh = ref(micro())
    step = build_megatron_train_step(hf)
    rm = step(micro())
    gpt = step.policy.gpt
    grads = megatron_to_hf({(0, 0): {n: p.main_grad.detach().float().cpu() for n, p in gpt.named_parameters()}},
                           hf.config)
    grads.pop("lm_head.weight", None)
    g_ref = {n: p.grad.detach().cpu() for n, p in ref.model.named_parameters()}
    grad_diff = max(float((grads[n] - g_ref[n]).abs().max()) for n in grads)
    loss_diff = abs(rm.metrics["loss"] - rh.metrics["loss"])
    out = {"loss_diff": loss_diff, "grad_max_abs_diff": grad_diff, "grad_norm": rh.metrics["grad_norm"],
           "device": "cpu (emulated)" if EMULATE else torch.cuda.get_device_name(0)}
    ok = loss_diff < 1e-5 and grad_diff < 1e-5
    if not EMULATE:  # fused attention (SDPA causal, FlexAttention block masks) trains on GPU only
        try:  # reported on its own: a failure here keeps the dense result above
            t0 = time.monotonic()
            fs = build_megatron_train_step(copy.deepcopy(hf_cpu).cuda(), attention="fused")
            rf = fs(micro())
            fg = megatron_to_hf({(0, 0): {n: p.main_grad.detach().float().cpu()
                                          for n, p in fs.policy.gpt.named_parameters()}}, hf.config)
            out["fused_attention_grad_max_abs_diff"] = max(float((fg[n] - g_ref[n]).abs().max()) for n in grads)
            out["fused_attention_loss_diff"] = abs(rf.metrics["loss"] - rh.metrics["loss"])
            out["fused_attention_s"] = round(time.monotonic() - t0, 1)
            ok = ok and out["fused_attention_loss_diff"] < 1e-5 and out["fused_attention_grad_max_abs_diff"] < 1e-4
        except Exception as exc:
            out["fused_attention_error"] = f"{type(exc).__name__}: {exc}"[-1500:]
            ok = False
    if not EMULATE:  # bf16 Megatron is a GPU path
        try:
            bf = build_megatron_train_step(copy.deepcopy(hf_cpu).cuda(), bf16=True)
            rb = bf(micro())
            bf_grads = [p.main_grad for p in bf.policy.gpt.parameters()]
            finite = all(bool(torch.isfinite(g).all()) for g in bf_grads) and all(
                v == v and abs(v) != float("inf") for v in (rb.metrics["loss"], rb.metrics["grad_norm"]))
            out.update(bf16_loss=rb.metrics["loss"], bf16_finite=finite)
            ok = ok and finite
        except Exception as exc:
            out["bf16_error"] = f"{type(exc).__name__}: {exc}"[-1500:]
            ok = False
    return {"status": "pass" if ok else "fail", **out}


def phase_b(tmp: Path) -> dict:
    out = tmp / "tp_cells.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "tests" / "integration" / "tp_cells_worker.py"), "--tp", "2", "--join", "0", "2", "-1",
           "--device", DEV, "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=_limit("b") - 10, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode != 0:
        return {"status": "fail", "error": r.stderr[-3000:]}
    steps = json.loads(out.read_text())["steps"]
    ok = all(s["normaliser"] == s["ref_normaliser"] and s["grad_diff"] < 1e-5 and s["weight_diff"] < 1e-6
             for s in steps)
    return {"status": "pass" if ok else "fail", "steps": steps}


def _handover(bf16: bool) -> dict:
    """Offload and restore the training state of a ~0.5B-parameter Megatron replica (a small one
    when emulating): GPU memory freed, bit-identical restore, GB/s each way."""
    import gc

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gyre.training.cell import TrainingState
    from gyre.training.megatron_step import build_megatron_train_step

    base = _gpu_used_mib()
    size = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2) if EMULATE else dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=8)
    cfg = Qwen3Config(vocab_size=32000, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=4096, tie_word_embeddings=True, **size)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(cfg)
    step = build_megatron_train_step(hf, bf16=bf16)
    del hf
    for p in step.params:  # optimizer state exists after a step: give every parameter a gradient
        p.main_grad.normal_()
    step.optimizer_step(1)
    if not EMULATE:
        torch.cuda.synchronize()
    state = TrainingState(step.params, step.optimizer, step.grad_buffers())

    def snapshot() -> list:
        """Host copies of every parameter, fp32 main parameter and optimizer state tensor."""
        ts = [*step.params, *state.main_params]
        for _, st in step.optimizer.state.items():
            ts += [st[k] for k in sorted(st) if isinstance(st[k], torch.Tensor)]
        return [t.detach().to("cpu", copy=True) for t in ts]

    before = snapshot()
    resident = _gpu_used_mib()
    t0 = time.perf_counter()
    state.offload()
    t_off = time.perf_counter() - t0
    offloaded = _gpu_used_mib()
    moved = sum(t.numel() * t.element_size() for t in [*state._saved, *state._saved_main]) + sum(
        v.numel() * v.element_size() for _, _, v, _ in state._saved_opt)
    t0 = time.perf_counter()
    state.restore()
    t_on = time.perf_counter() - t0
    freed = (resident - offloaded) / max(1, resident - base)
    after = snapshot()
    same = len(after) == len(before) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(after, before))
    del before, after
    out = {"ok": (freed >= 0.9 or EMULATE) and same, "trainer_mib": resident - base,
           "freed_fraction": round(freed, 4), "bit_identical": same,
           "param_gb": round(sum(p.numel() * p.element_size() for p in step.params) / 1e9, 3),
           "main_param_gb": round(sum(t.numel() * t.element_size() for t in state.main_params) / 1e9, 3),
           "moved_gb": round(moved / 1e9, 3), "offload_s": round(t_off, 3), "restore_s": round(t_on, 3),
           "offload_gb_per_s": round(moved / 1e9 / t_off, 2), "restore_gb_per_s": round(moved / 1e9 / t_on, 2)}
    step = state = None  # snapshot() holds them through its closure
    gc.collect()
    if not EMULATE:
        torch.cuda.empty_cache()
    return out


def phase_c() -> dict:
    import torch

    from gyre.training.megatron_model import init_process_group_from_env, initialize_megatron_cpu

    if not EMULATE:
        torch.cuda.set_device(0)
    init_process_group_from_env("gloo" if EMULATE else "nccl")
    initialize_megatron_cpu(1, 1, seed=1234, cpu=EMULATE)
    result = _handover(bf16=False)
    ok = result.pop("ok")
    if not EMULATE:  # bf16 with fp32 main parameters (Megatron's bf16 optimizer is GPU-only)
        result["bf16"] = _handover(bf16=True)
        ok = ok and result["bf16"].pop("ok")
    return {"status": "pass" if ok else "fail", **result}


def phase_d(tmp: Path) -> dict:
    import torch

    from gyre.embedded_model import ensure_tiny_model, load_hf_model
    from gyre.rollout.client.engine_client import EngineClient
    from gyre.rollout.sglang_driver.engine import SGLangEngine
    from gyre.rollout.sglang_driver.weights import SGLangTensorClient
    from gyre.rollout.tensor_bucket import LOAD_FORMAT, FlatBucket, engine_rank_payloads

    model_dir = ensure_tiny_model("local")
    dev = "cpu" if EMULATE else "cuda:0"
    engine = SGLangEngine(model_dir, launcher=[sys.executable, "-m", "gyre.rollout.embedded.serve", "--device", dev],
                          startup_timeout=120, log_path=tmp / "engine_d.log").start()
    try:
        client = SGLangTensorClient(EngineClient(engine.url, timeout=120), dev, 1, load_format=LOAD_FORMAT,
                                    serialize=lambda pairs, tp: engine_rank_payloads([FlatBucket.pack(pairs).serialize()], tp))
        trainer = load_hf_model(model_dir).to(dev)
        prompt = [17, 23, 99, 512, 7, 301, 44]
        greedy = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
        used, worst = [], 0.0
        g = torch.Generator(device=dev).manual_seed(0)
        for i in range(PUSHES):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(0.01 * torch.randn(p.shape, generator=g, device=dev))
            named = {n: t for n, t in trainer.state_dict().items() if n != "lm_head.weight"}
            client.update_weights_from_tensor(named, weight_version=str(i + 1))
            out = client.generate(prompt, {**greedy}, return_logprob=True)
            ids = prompt + out.output_ids
            with torch.no_grad():
                logits = trainer(torch.tensor([ids], device=dev)).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            mine = [float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(out.output_ids)]
            worst = max(worst, max(abs(a - b) for a, b in zip(mine, out.output_logprobs)))
            used.append(_gpu_used_mib())
        growth = used[-1] - used[1]
        ok = worst < 1e-4 and growth < 64
        return {"status": "pass" if ok else "fail", "pushes": PUSHES, "logprob_max_abs_diff": worst,
                "gpu_mib_after_push": used, "growth_mib": growth}
    finally:
        engine.stop()


def phase_e(tmp: Path) -> dict:
    run = tmp / "run_e"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "pretrain_gyre.py"), "--config", str(ROOT / "examples" / "gpu" / "one_gpu_embedded.yaml"),
           "--run-dir", str(run), "--train-steps", str(MAIN_JOB_STEPS), "--no-progress", "--attention-kernel", "dense",
           *(["--backend", "cpu"] if EMULATE else [])]  # (fused attention compiles at first use: phase a checks it)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=_limit("e") - 10, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="2"))
    if r.returncode != 0:
        return {"status": "fail", "error": r.stderr[-3000:]}
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    changes = summary.get("role_changes", 0)
    ok = summary.get("steps") == MAIN_JOB_STEPS and changes > 0
    return {"status": "pass" if ok else "fail", "steps": summary.get("steps"), "role_changes": changes,
            "wall_s": summary.get("wall_s")}


def phase_f(tmp: Path) -> dict:
    """SGLang 0.5.23 on the GPU (:mod:`tests.gpu.sglang_cycle`), then the shared KV store
    (``tests/gpu/test_sglang_shared_kv.py``) with the time left; skipped without SGLang."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        return {"status": "skip", "reason": "sglang is not importable in this Python: phase f needs an SGLang "
                                            "0.5.23 environment (requirements-gpu.txt); the prepared wheels carry none"}
    from tests.gpu.sglang_cycle import run_cycle

    end = time.monotonic() + int(os.environ.get("GYRE_GPU_CHECK_PHASE_S", _limit("f"))) - 15
    cycle = run_cycle(tmp, emulate=EMULATE, used_mib=_gpu_used_mib, deadline=end - (0 if EMULATE else 60))
    if EMULATE:
        kv = {"status": "skip", "reason": "needs a CUDA GPU (SGLang's hierarchical cache over a Mooncake store)"}
    else:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                            str(ROOT / "tests" / "gpu" / "test_sglang_shared_kv.py")],
                           capture_output=True, text=True, timeout=max(30, int(end - time.monotonic())), cwd=ROOT)
        ran = " passed" in r.stdout or " failed" in r.stdout or " error" in r.stdout
        kv = {"status": "pass" if r.returncode == 0 and ran else "skip" if r.returncode == 0 else "fail",
              "pytest_tail": r.stdout[-1500:]}
    statuses = {cycle["status"], kv["status"]}
    status = "fail" if "fail" in statuses else "skip" if cycle["status"] == "skip" else "pass"
    return {"status": status, "cycle": cycle, "shared_kv": kv}


#: What the phases import; a missing one fails the check at once (``preflight``).
PREFLIGHT_IMPORTS = ("numpy", "transformers", "fastapi", "uvicorn", "httpx", "pytest", "megatron.core.models.gpt",
                     "gyre.runtime.pretrain", "gyre.rollout.embedded.server", "gyre.transfer_engine")


def phase_preflight() -> dict:
    """Import what the phases need (run in a fresh process before them, seconds): the modules that
    fail, the Mooncake engine's availability, and whether a C compiler exists (triton needs one)."""
    import importlib

    failed = {}
    for module in (*PREFLIGHT_IMPORTS, "mooncake.engine"):
        try:
            importlib.import_module(module)
        except Exception as exc:
            failed[module] = f"{type(exc).__name__}: {exc}"[:300]
    mooncake = failed.pop("mooncake.engine", True)  # reported, not required: phases b and e say why
    return {"ok": not failed, "failed_imports": failed, "mooncake": mooncake,
            "c_compiler": shutil.which("cc") or shutil.which("gcc")}


def _run_phase_process(name: str, tmp: Path, limit: int) -> dict:
    """Phase ``name`` in its own process group, killed whole after ``limit`` seconds (its result
    kept if it had printed one)."""
    proc = subprocess.Popen([sys.executable, __file__, "--one", name, "--tmp", str(tmp)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True,
                            env=dict(os.environ, GYRE_GPU_CHECK_PHASE_S=str(limit)))
    timed_out = False
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
    lines = [x for x in (out or "").splitlines() if x.startswith("GYRE_PHASE_RESULT ")]
    if lines:
        return json.loads(lines[-1].split(" ", 1)[1])
    if timed_out:
        return {"status": "fail", "error": f"timed out after {limit} s", "stderr_tail": (err or "")[-2000:]}
    return {"status": "fail", "error": f"exit {proc.returncode}: {(err or '')[-2500:]}"}


def run_phase(name: str, tmp: Path) -> dict:
    fn = globals()[f"phase_{name}"]
    return fn(tmp) if "tmp" in fn.__code__.co_varnames[:fn.__code__.co_argcount] else fn()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one phase in this process
    ap.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--emulate-on-cpu", action="store_true",
                    help="run the phases' code on CPU (a test of this script; no GPU measurement)")
    a = ap.parse_args()
    if a.emulate_on_cpu:
        os.environ["GYRE_GPU_CHECK_EMULATE"] = "1"
    if a.one:
        try:
            result = run_phase(a.one, Path(a.tmp))
        except Exception as exc:  # reported, not raised: the parent collects every phase
            import traceback

            result = {"status": "fail", "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2500:]}
        print("GYRE_PHASE_RESULT " + json.dumps(result), flush=True)
        sys.stderr.flush()
        os._exit(0)  # the result is out: a hang at exit (a process group's threads) must not lose it
    import tempfile

    import torch

    tmp = Path(tempfile.mkdtemp(prefix="gyre-gpu-check-"))
    report = {"emulated_on_cpu": a.emulate_on_cpu, "torch": torch.__version__, "cuda": torch.version.cuda,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "phases": {}}
    started = time.monotonic()
    no_device = not torch.cuda.is_available() and not a.emulate_on_cpu
    if no_device:  # every phase is skipped: nothing would use what the preflight imports
        report["preflight"] = {"status": "skip", "reason": "no CUDA device"}
    else:
        report["preflight"] = _run_phase_process("preflight", tmp, 120)
    if not no_device and not report["preflight"].get("ok"):
        # every phase would fail the same way: stop before spending GPU time
        report["phases"] = {f"{n}_{PHASES[n][0]}": {"status": "fail", "error": "preflight failed"}
                            for n in a.phases.split(",")}
        a.phases = ""
    for name in filter(None, a.phases.split(",")):
        what, limit = PHASES[name][0], _limit(name)
        if name == "f":  # the last phase: what the others left, if that is more
            limit = max(limit, int(_limit("f") / PHASES["f"][1] * TOTAL_S - (time.monotonic() - started)))
        t0 = time.monotonic()
        if no_device:
            result = {"status": "skip", "reason": "no CUDA device"}
        else:
            result = _run_phase_process(name, tmp, limit)
        result["seconds"] = round(time.monotonic() - t0, 1)
        report["phases"][f"{name}_{what}"] = result
        print(f"gpu_check: {name} {what}: {result['status']} ({result['seconds']} s)", file=sys.stderr, flush=True)
    report["seconds"] = round(time.monotonic() - started, 1)
    # passed: every phase ran and passed, but SGLang's, which may be skipped where SGLang is not installed
    report["passed"] = all(p["status"] == "pass" or (name.startswith("f_") and p["status"] == "skip")
                           for name, p in report["phases"].items())
    text = json.dumps(report, indent=1)
    Path(a.out).write_text(text)
    print(text)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
