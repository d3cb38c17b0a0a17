"""The main job on the small real policy, SmolLM2-135M-Instruct (gyre/real_model.py): one optimizer
step through `torchrun pretrain_gyre.py` with each trainer, and the engine's behaviour log-probs equal
the trainer's (fp32).

One task, four samples of at most 12 tokens, one rank. The reward is a digest of the reply
(tests/integration/reply_digest.py), so the group's advantages are not all zero and the step trains.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GLOG_minloglevel="2",
           TRANSFORMERS_VERBOSITY="error", PYTHONPATH=str(ROOT))
SAMPLES = 4


def write_task(path: Path) -> Path:
    task = {"id": "smollm2-fruit", "instruction": "Name one fruit.", "timeout_s": 120,
            "evaluator": {"type": "executable", "command": ["{python}", "-c", "pass"], "timeout_s": 30,
                          "scoring": "tests.integration.reply_digest:reply_digest"}}
    path.write_text(json.dumps(task) + "\n")
    return path


def behaviour_vs_reference(run: Path, model_dir: Path) -> tuple[int, float]:
    """Targets of the run's records, and the largest |engine log-prob - HF log-prob| over them (the HF
    model of ``model_dir`` is the policy of step 1's rollouts)."""
    from gyre.embedded_model import load_hf_model
    from gyre.trajectory.store import read_records

    hf = load_hf_model(model_dir)
    n, worst = 0, 0.0
    for path in sorted((run / "records").glob("*.jsonl")):
        for rec in read_records(path):
            ids = torch.tensor(list(rec.input_ids) + list(rec.output_ids), dtype=torch.long)[None]
            with torch.no_grad():
                logp = hf(ids).logits[0].float().log_softmax(-1)
            k = len(rec.input_ids)
            ref = logp[k - 1:-1].gather(-1, ids[0, k:, None])[:, 0]
            worst = max(worst, (ref - torch.from_numpy(rec.output_logprobs.astype("float32"))).abs().max().item())
            n += len(rec.output_ids)
    return n, worst


@pytest.mark.parametrize("backend", ["hf", "megatron"])
def test_one_step_of_smollm2_with_exact_behaviour_logprobs(tmp_path, smollm2_model_dir, backend):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(ROOT / "pretrain_gyre.py"), "--config", str(ROOT / "examples" / "cpu_smollm2.yaml"),
           "--run-dir", str(run), "--no-progress", "--model-dir", str(smollm2_model_dir),
           "--training-backend", backend, "--tasks", str(write_task(tmp_path / "fruit.tasks.jsonl")),
           "--train-steps", "1", "--n-samples-per-prompt", str(SAMPLES), "--rollout-max-new-tokens", "12"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-5000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["executions_trained"] == SAMPLES, summary
    assert summary["tokens_trained"] > 0
    rows, _ = read_metrics(run / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1]
    row = rows[0]
    targets = row["targets_per_execution"] * row["executions_trained"]
    assert targets > 0 and math.isfinite(row["loss"]) and row["grad_norm"] > 0
    # the trainer's log-probs of the sampled tokens equal the engine's: mean |l - b|, and max(l - b)
    # through rho_max = min(exp(max(l - b)), C)
    assert row["train_inference_mismatch"] < 1e-4, row
    assert row["rho_max"] < math.exp(1e-4), row
    # and every target's behaviour log-prob equals a plain HF forward of the converted model
    n, worst = behaviour_vs_reference(run, smollm2_model_dir)
    assert n == targets and worst < 1e-4, (n, worst)
    # the step's weights are written as an HF checkpoint of the same architecture
    ck = json.loads((run / "checkpoints" / "iter_0000001" / "hf" / "config.json").read_text())
    assert ck["model_type"] == "llama" and ck["tie_word_embeddings"] and ck["vocab_size"] == 49152
    shutil.rmtree(run / "checkpoints")  # 1.6 GB (weights and optimizer state), not kept in pytest's temporary dirs
