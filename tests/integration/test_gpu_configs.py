"""GPU configurations are checked on a machine without a GPU: every ``examples/gpu/`` config passes
``pretrain_gyre.py --check-config`` for its world, inconsistent ones exit 2 with one line, and the
Slurm script parses and checks its config in its dry-run mode."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "gyre_multinode.sbatch"
#: config -> (WORLD_SIZE, ranks per node) it is written for
GPU_CONFIGS = {"node8_cells8.yaml": (8, 8), "node8_cells2_tp4.yaml": (8, 8), "multinode_cells.yaml": (256, 8),
               "one_gpu_embedded.yaml": (2, 2)}


def check(config: str, world, per_node, *extra: str):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GPUS_PER_NODE")}
    env.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(per_node), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "pretrain_gyre.py", "--config", f"examples/gpu/{config}", *extra,
                           "--check-config"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_every_gpu_example_is_listed():
    assert sorted(p.name for p in (ROOT / "examples" / "gpu").glob("*.yaml")) == sorted(GPU_CONFIGS)


@pytest.mark.parametrize("config", sorted(GPU_CONFIGS))
def test_gpu_examples_pass_the_check_without_a_gpu(config):
    r = check(config, *GPU_CONFIGS[config])
    assert r.returncode == 0, r.stderr
    errors = [line for line in r.stderr.splitlines() if not line.startswith("note: ")]
    assert errors == []


@pytest.mark.parametrize("config,world,per_node,extra,line", [
    ("node8_cells2_tp4.yaml", 16, 8, (), "argument --num-cells: WORLD_SIZE=16 must be --num-cells x TP x PP = 2 x 4 x 1 = 8 (no data parallelism inside a cell)"),
    ("node8_cells2_tp4.yaml", 12, 6, ("--num-cells", "3"),
     "argument --num-cells: a cell of TP x PP = 4 GPUs neither fits in a node of 6 nor is made of whole nodes"),
    ("node8_cells2_tp4.yaml", 8, 8, ("--sglang-tp-size", "2"),
     "argument --sglang-tp-size: a cell sets --tp-size from its layout (TP x PP = 4 GPUs per SGLang server); remove it"),
    ("node8_cells2_tp4.yaml", 8, 8, ("--sglang-base-gpu-id", "0"),
     "argument --sglang-base-gpu-id: a cell sets --base-gpu-id from its layout (TP x PP = 4 GPUs per SGLang server); "
     "remove it"),
    ("node8_cells2_tp4.yaml", 8, 8, ("--sglang-extra-args", "--dp-size 2 --log-level info"),
     "argument --sglang-extra-args: a cell sets --dp-size from its layout (TP x PP = 4 GPUs per SGLang server); "
     "remove it"),
    ("node8_cells8.yaml", 8, 8, ("--distributed-backend", "gloo"),
     "argument --distributed-backend: SGLang cells need a GPU per rank (nccl); gloo is for embedded engines "
     "sharing one GPU"),
    ("one_gpu_embedded.yaml", 2, 2, ("--sglang-mem-fraction-static", "0.5"),
     "argument --sglang-mem-fraction-static: only SGLang cells use it (--rollout-engine sglang)"),
    ("one_gpu_embedded.yaml", 2, 2, ("--rollout-shared-kv-store", "head:50051"),
     "argument --rollout-shared-kv-store: only SGLang cells use the shared KV store (--rollout-engine sglang)"),
    ("node8_cells8.yaml", 8, 0, (), "argument --num-cells: LOCAL_WORLD_SIZE='0' is not a positive number of GPUs "
                                    "per node"),
    ("node8_cells8.yaml", "abc", 8, (), "argument --num-cells: WORLD_SIZE='abc' is not a positive integer"),
    ("node8_cells2_tp4.yaml", 8, 8, ("--rollout-engine", "embedded"),
     "argument --rollout-engine: the embedded engine serves from one GPU; cells of several GPUs serve with "
     "--rollout-engine sglang"),
    ("node8_cells8.yaml", 8, 8, ("--standalone-engines", "2", "--standalone-concurrency", "4"),
     "argument --standalone-engines: the standalone pool runs embedded engines on CPU (--backend cpu)"),
    ("one_gpu_embedded.yaml", 2, 2, ("--standalone-engines", "1", "--standalone-concurrency", "4"),
     "argument --standalone-engines: the standalone pool runs embedded engines on CPU (--backend cpu)"),
])
def test_inconsistent_gpu_configs_exit_2_with_one_line(config, world, per_node, extra, line):
    r = check(config, world, per_node, *extra)
    assert r.returncode == 2
    assert [x for x in r.stderr.splitlines() if not x.startswith("note: ")] == [f"pretrain_gyre.py: error: {line}"]


def test_sglang_cells_are_checked_against_a_local_model(tiny_model_dir):
    r = check("node8_cells8.yaml", 8, 8, "--model-dir", str(tiny_model_dir), "--sglang-context-length", "40000")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "pretrain_gyre.py: error: argument --sglang-context-length: 40000 is beyond the model's "
        "max_position_embeddings 32768 (set RoPE scaling in its config.json for longer contexts)"]
    assert check("node8_cells8.yaml", 8, 8, "--model-dir", str(tiny_model_dir), "--sglang-context-length", "32768",
                 "--seq-length", "32768").returncode == 0


def test_the_sglang_server_must_split_the_heads():
    from types import SimpleNamespace

    from gyre.runtime.gpu_cells import check_model_for_sglang

    args = SimpleNamespace(tensor_model_parallel_size=8, pipeline_model_parallel_size=4, sglang_context_length=None)
    cfg = SimpleNamespace(num_attention_heads=64, max_position_embeddings=40960, rope_scaling=None)
    assert check_model_for_sglang(args, cfg) == []
    cfg.num_attention_heads = 40
    assert check_model_for_sglang(args, cfg) == [
        "argument --tensor-model-parallel-size: a cell's SGLang server runs --tp-size TP x PP = 32, which does not "
        "divide the model's 40 attention heads"]
    cfg.num_attention_heads, args.sglang_context_length = 64, 131072
    assert len(check_model_for_sglang(args, cfg)) == 1
    cfg.rope_scaling = {"rope_type": "yarn", "factor": 4.0}
    assert check_model_for_sglang(args, cfg) == []


def test_sglang_cells_on_the_cpu_need_the_sglang_environment():
    r = check("one_gpu_embedded.yaml", 2, 2, "--backend", "cpu", "--rollout-engine", "sglang")
    assert r.returncode == 2 and "SGLang cells on the CPU run from the SGLang environment" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_sbatch_parses():
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True).returncode == 0


def sbatch_dry_run(*args, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full.update(OMP_NUM_THREADS="1", **env)
    return subprocess.run(["bash", str(SBATCH), "--dry-run", *args], capture_output=True, text=True, env=full,
                          timeout=300, cwd=ROOT)


def test_sbatch_dry_run_prints_each_nodes_command_and_checks_the_config():
    r = sbatch_dry_run("--config", "examples/gpu/multinode_cells.yaml", NNODES="32", GPUS_PER_NODE="8",
                       MASTER_ADDR="head", SHARED_KV="1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "nodes: 32 x 8 GPUs (WORLD_SIZE=256), rendezvous head:29500"
    assert lines[1] == "node 0: mooncake_master --port 50051"
    assert lines[2].startswith("node 0: torchrun --nnodes 32 --nproc-per-node 8 --node-rank 0 --master-addr head "
                               "--master-port 29500 ")
    assert lines[3].startswith("node 31: torchrun --nnodes 32 --nproc-per-node 8 --node-rank 31 ")
    assert lines[2].endswith("--config examples/gpu/multinode_cells.yaml --rollout-shared-kv-store head:50051")


def test_sbatch_dry_run_refuses_a_world_the_config_does_not_fit():
    r = sbatch_dry_run("--config", "examples/gpu/multinode_cells.yaml", NNODES="16", GPUS_PER_NODE="8")
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == ("pretrain_gyre.py: error: argument --num-cells: WORLD_SIZE=128 must be "
                                         "--num-cells x TP x PP = 8 x 8 x 4 = 256 (no data parallelism inside a cell)")
    r = sbatch_dry_run()
    assert r.returncode == 2 and "at least --config FILE" in r.stderr
    r = sbatch_dry_run("--config", "examples/gpu/node8_cells8.yaml", NNODES="abc")
    assert r.returncode == 2 and r.stderr.strip() == "gyre_multinode.sbatch: error: NNODES=abc is not a positive integer"
    r = sbatch_dry_run("--config", "examples/gpu/node8_cells8.yaml", GYRE_SLURM_ENV="examples/slurm/none.env")
    assert r.returncode == 2 and r.stderr.strip() == (f"gyre_multinode.sbatch: error: GYRE_SLURM_ENV="
                                                      f"{ROOT}/examples/slurm/none.env is not a file")


def test_sbatch_dry_run_of_the_cpu_profile():
    r = sbatch_dry_run("--config", "examples/cpu_tiny.yaml", "--num-cells", "4", NNODES="2", MASTER_ADDR="n1",
                       GYRE_SLURM_ENV="examples/slurm/cpu.env")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "nodes: 2 x 2 CPU ranks (WORLD_SIZE=4), rendezvous n1:29500"
    assert lines[1].startswith("node 0: torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr n1 ")
    r = sbatch_dry_run("--config", "examples/cpu_tiny.yaml", NNODES="2", GYRE_SLURM_ENV="examples/slurm/cpu.env")
    assert r.returncode == 2  # 3 cells do not fill 2 nodes x 2 ranks
    assert "WORLD_SIZE=4 must be --num-cells x TP x PP" in r.stderr.splitlines()[-1]


def test_sbatch_dry_run_anywhere_on_the_line_and_without_the_shared_store_by_default():
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "SHARED_KV"}
    r = subprocess.run(["bash", str(SBATCH), "--config", "examples/gpu/node8_cells8.yaml", "--dry-run"],
                       capture_output=True, text=True, env=dict(full, NNODES="1", OMP_NUM_THREADS="1"), timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "mooncake_master" not in r.stdout and "--rollout-shared-kv-store" not in r.stdout
    assert r.stdout.splitlines()[1].endswith("--config examples/gpu/node8_cells8.yaml")
    assert not (ROOT / "runs" / "gyre-dry").exists()  # the dry run creates nothing


def test_sbatch_under_a_fake_slurm_runs_torchrun_on_every_node(tmp_path):
    """The submitted path, with ``srun``/``scontrol``/``torchrun``/``mooncake_master`` replaced by
    recorders: the check runs first, then each node gets its node rank and the same flags."""
    bin_dir, env_dir = tmp_path / "bin", tmp_path / "venv"
    (env_dir / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    (env_dir / "bin" / "activate").write_text(f"export PATH={bin_dir}:$PATH\n")
    log = tmp_path / "calls.log"
    fakes = {
        "scontrol": "echo head; seq 1 50000",  # a long node list: reading only its first line would SIGPIPE
        # srun runs its command once per node (or once for a one-task step), with SLURM_NODEID set
        "srun": '''n=2; [[ "$*" == *"--ntasks=1"* ]] && n=1
while [[ "$1" == -* ]]; do case "$1" in -w) shift 2;; *) shift;; esac; done
for i in $(seq 0 $((n - 1))); do SLURM_NODEID=$i "$@"; done''',
        "torchrun": f'echo "torchrun $*" >> {log}',
        "mooncake_master": f'echo "mooncake_master $*" >> {log}',
        "python": f'echo "python $*" >> {log}; exec {sys.executable} "$@"',
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_JOB_NUM_NODES="2", SLURM_GPUS_PER_NODE="h200:8", SLURM_JOB_NODELIST="head,n1",
               SLURM_JOB_ID="77", SLURM_JOB_NAME="gyre", GYRE_ENV=str(env_dir), RUN_DIR=str(tmp_path / "run"),
               SHARED_KV="1",
               PATH=f"{bin_dir}:{os.environ['PATH']}", OMP_NUM_THREADS="1")
    r = subprocess.run(["bash", str(SBATCH), "--config", "examples/gpu/node8_cells8.yaml", "--num-cells", "16",
                        "--lr", "2e-6"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    assert calls[0].startswith("python pretrain_gyre.py --run-dir ") and calls[0].endswith("--check-config")
    assert calls[1] == "mooncake_master --port 50051"
    flags = (f"pretrain_gyre.py --run-dir {tmp_path / 'run'} --config examples/gpu/node8_cells8.yaml --num-cells 16 "
             f"--lr 2e-6 --rollout-shared-kv-store head:50051")
    assert calls[2:] == [f"torchrun --nnodes 2 --nproc-per-node 8 --node-rank {i} --master-addr head "
                         f"--master-port 29500 {flags}" for i in (0, 1)]


def test_sbatch_resumes_a_run_directory_that_holds_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    r = sbatch_dry_run("--config", "examples/gpu/node8_cells8.yaml", NNODES="1", RUN_DIR=str(run))
    assert "--load" not in r.stdout
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("1")
    r = sbatch_dry_run("--config", "examples/gpu/node8_cells8.yaml", NNODES="1", RUN_DIR=str(run))
    assert r.stdout.splitlines()[1].endswith(f"--config examples/gpu/node8_cells8.yaml --load {run}")
    r = sbatch_dry_run("--config", "examples/gpu/node8_cells8.yaml", "--load", "elsewhere", NNODES="1",
                       RUN_DIR=str(run))
    assert r.stdout.splitlines()[1].endswith("--load elsewhere")  # an explicit --load is kept, not doubled


def test_sbatch_says_what_failed_and_how_to_resume(tmp_path):
    """A failing step (a fake ``srun`` that exits as if a node's task was killed): the script exits
    with srun's status and one line naming the checkpoint a requeued job resumes from."""
    bin_dir, env_dir, run = tmp_path / "bin", tmp_path / "venv", tmp_path / "run"
    (env_dir / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    (env_dir / "bin" / "activate").write_text(f"export PATH={bin_dir}:$PATH\n")
    fakes = {"scontrol": "echo n1; echo n2", "srun": "echo 'srun: error: n2: task 1: Killed' >&2; exit 137",
             "python": "exit 0"}  # the configuration check passes (tested above)
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="n[1-2]", SLURM_JOB_ID="9", GYRE_ENV=str(env_dir),
               GYRE_SLURM_ENV="examples/slurm/cpu.env", RUN_DIR=str(run), PATH=f"{bin_dir}:{os.environ['PATH']}")
    argv = ["bash", str(SBATCH), "--config", "examples/cpu_tiny.yaml", "--num-cells", "4"]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 137
    assert r.stderr.splitlines()[-1] == (
        f"gyre_multinode.sbatch: error: a node's ranks failed (srun exit status 137; srun's lines above name the node "
        f"and task) and the job step was ended on every node; {run} holds no checkpoint yet: a requeued job starts "
        f"the run over")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    r = subprocess.run(argv, capture_output=True, text=True, env=dict(env, SLURM_RESTART_COUNT="1"), cwd=ROOT,
                       timeout=300)
    assert r.returncode == 137
    assert f"gyre_multinode.sbatch: job 9 attempt 2 on n[1-2] (2 x 2 CPU ranks), run directory {run}, resumed" \
        in r.stdout
    assert r.stderr.splitlines()[-1].endswith(f"{run} keeps the checkpoint of step 2: scontrol requeue 9 (or a new "
                                              f"sbatch with RUN_DIR={run}) resumes from it")
