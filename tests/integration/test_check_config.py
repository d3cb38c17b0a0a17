"""`pretrain_gyre.py --check-config` checks what the run will load: the model directories and the task files.

Each case calls the entry point's ``main`` with WORLD_SIZE=3 (as `examples/run_cpu_tiny.sh` runs it
before torchrun), in this process, its exit status and streams captured; the first case runs it as a
process. A bad model directory or a refused task file exits 2 with one stderr line.
"""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

import pretrain_gyre
from gyre.embedded_model import model_dir_problem

ROOT = Path(__file__).resolve().parents[2]
EXE = {"type": "executable", "command": "true", "scoring": "exit_code"}


def check_env(rank: str | None, world: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    env.update(WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    if rank is not None:
        env["RANK"] = rank
    return env


def check_config(*extra: str, rank: str | None = None, world: int = 3) -> subprocess.CompletedProcess:
    """``pretrain_gyre.py --config examples/cpu_tiny.yaml *extra --check-config``, in this process."""
    argv = ["--config", str(ROOT / "examples" / "cpu_tiny.yaml"), *extra, "--check-config"]
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, check_env(rank, world), clear=True), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = pretrain_gyre.main(argv)
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


@pytest.fixture
def model_copy(tmp_path, tiny_model_dir):
    """A copy of the embedded tiny model, free to break."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def test_missing_model_dir_exits_2_with_one_line():
    r = subprocess.run([sys.executable, str(ROOT / "pretrain_gyre.py"), "--config", str(ROOT / "examples" / "cpu_tiny.yaml"),
                        "--model-dir", "/nonexistent", "--check-config"], capture_output=True, text=True, cwd=ROOT,
                       env=check_env(None, 3), timeout=300)
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["pretrain_gyre.py: error: argument --model-dir: /nonexistent: no such directory"]
    assert r.stdout == ""


def test_complete_model_dir_passes_silently(model_copy):
    r = check_config("--model-dir", str(model_copy))
    assert (r.returncode, r.stderr) == (0, "")


def _no_weights(d: Path):
    (d / "model.safetensors").unlink()


def _no_tokenizer(d: Path):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / name).unlink()


def _broken_config(d: Path):
    (d / "config.json").write_text('{"model_type": "qwen3", "hidden_size": \n')


@pytest.mark.parametrize("breakage, reason", [
    (_no_weights, "no weight files (model.safetensors, model.safetensors.index.json, pytorch_model.bin, "
                  "pytorch_model.bin.index.json)"),
    (_no_tokenizer, "no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, vocab.txt)"),
    (_broken_config, "config.json: not valid JSON (Expecting value: line 2 column 1 (char 40))"),
])
def test_broken_model_dir_exits_2_with_one_line(model_copy, breakage, reason):
    breakage(model_copy)
    r = check_config("--model-dir", str(model_copy))
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"pretrain_gyre.py: error: argument --model-dir: {model_copy}: {reason}"]


def test_load_checks_the_checkpoints_hf_dir(tmp_path, tiny_model_dir):
    ck = tmp_path / "run" / "checkpoints" / "iter_0000002"
    shutil.copytree(tiny_model_dir, ck / "hf")
    (ck / "controller.json").write_text(json.dumps({"iteration": 2, "training_backend": "megatron"}))
    (tmp_path / "run" / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    r = check_config("--load", str(tmp_path / "run"))
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"pretrain_gyre.py: error: argument --load: {ck} holds the optimizer state of cells of another size than "
        "TP x PP = 1 (missing ['optimizer.pt'])"]
    (ck / "optimizer.pt").write_bytes(b"")
    assert check_config("--load", str(tmp_path / "run")).returncode == 0
    (ck / "hf" / "model.safetensors").write_bytes((ck / "hf" / "model.safetensors").read_bytes()[:100_000])
    r = check_config("--load", str(tmp_path / "run"))
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"pretrain_gyre.py: error: argument --load: {ck / 'hf'}: weight file model.safetensors: not readable "
        "(Error while deserializing header: incomplete metadata, file not fully covered)"]


@pytest.fixture
def half_bad_tasks(tmp_path):
    """4 task lines, 2 malformed (line 2 not JSON, line 4 without an evaluator)."""
    f = tmp_path / "tasks.jsonl"
    f.write_text("\n".join([json.dumps({"id": "a", "instruction": "x", "evaluator": EXE}), "{broken",
                            json.dumps({"id": "b", "instruction": "y", "evaluator": EXE}),
                            json.dumps({"id": "c", "instruction": "z"})]) + "\n")
    return f


def test_malformed_task_lines_are_warned_with_file_and_line(half_bad_tasks):
    f = half_bad_tasks
    r = check_config("--tasks", str(f))
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [
        f"warning: {f}:2: task #2: not valid JSON (Expecting property name enclosed in double quotes at column 2)",
        f"warning: {f}:4: task 'c' field 'evaluator': missing (every task needs a way to be scored)",
        "warning: argument --tasks: 2 tasks loaded, 2 skipped, 2 problem(s) (--strict-tasks refuses such a run)"]
    # at run start every rank checks; only rank 0 reports
    assert check_config("--tasks", str(f), rank="0").stderr == r.stderr
    r1 = check_config("--tasks", str(f), rank="1")
    assert (r1.returncode, r1.stderr) == (0, "")


def test_strict_tasks_refuses_malformed_lines(half_bad_tasks, tmp_path):
    f = half_bad_tasks
    r = check_config("--tasks", str(f), "--strict-tasks")
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"pretrain_gyre.py: error: argument --strict-tasks: 2 problem(s) in the task files (2 task(s) would be "
        f"skipped), the first: {f}:2: task #2: not valid JSON (Expecting property name enclosed in double quotes "
        "at column 2)"]
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"id": "a", "instruction": "x", "evaluator": EXE}) + "\n")
    r = check_config("--tasks", str(good), "--strict-tasks")
    assert (r.returncode, r.stderr) == (0, "")


# ------------------------------------------------------------------ model_dir_problem, in process


def test_model_dir_problem_accepts_the_embedded_model(tiny_model_dir):
    assert model_dir_problem(tiny_model_dir) is None


def test_model_dir_problem_config_cases(model_copy, tmp_path):
    assert model_dir_problem(tmp_path / "model" / "config.json") == "not a directory"
    (model_copy / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert model_dir_problem(model_copy) == "config.json: no model_type (not a transformers model config)"
    (model_copy / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    assert model_dir_problem(model_copy) == "config.json: model_type 'no-such-model' is unknown to this transformers"
    (model_copy / "config.json").write_text(json.dumps({"model_type": "clip_vision_model"}))
    assert model_dir_problem(model_copy) == "config.json: model_type 'clip_vision_model' has no causal-LM class in transformers"
    (model_copy / "config.json").unlink()
    assert model_dir_problem(model_copy) == "no config.json"


def test_model_dir_problem_weight_cases(model_copy):
    (model_copy / "model.safetensors").rename(model_copy / "model-00001-of-00002.safetensors")
    assert model_dir_problem(model_copy) == (
        "no weight files (model.safetensors, model.safetensors.index.json, pytorch_model.bin, "
        "pytorch_model.bin.index.json); model-00001-of-00002.safetensors not loadable by transformers under those names")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    assert model_dir_problem(model_copy) == "weight file model-00002-of-00002.safetensors is missing"
    (model_copy / "model.safetensors.index.json").write_text("{}")
    assert model_dir_problem(model_copy) == "model.safetensors.index.json: not a readable shard index ('weight_map')"
    (model_copy / "model.safetensors.index.json").unlink()
    (model_copy / "model-00001-of-00002.safetensors").unlink()
    (model_copy / "pytorch_model.bin").write_bytes(b"")
    assert model_dir_problem(model_copy) == "weight file pytorch_model.bin is empty"
    (model_copy / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + b"\0" * 100)
    assert model_dir_problem(model_copy) == "weight file pytorch_model.bin is truncated (broken zip archive)"
    import torch

    torch.save({"w": torch.zeros(2)}, model_copy / "pytorch_model.bin")
    assert model_dir_problem(model_copy) is None


def test_model_dir_problem_broken_tokenizer(model_copy):
    (model_copy / "tokenizer.json").write_text("{not json")
    problem = model_dir_problem(model_copy)
    assert problem.startswith("tokenizer: cannot load it offline (") and "\n" not in problem


def test_custom_rm_path_is_loaded_at_check_time():
    assert check_config("--custom-rm-path", "gyre.evaluation:stdout_score_rule").returncode == 0
    r = check_config("--custom-rm-path", "no_such_module_here:score")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == ["pretrain_gyre.py: error: argument --custom-rm-path: cannot load "
                                     "'no_such_module_here:score': ModuleNotFoundError: No module named "
                                     "'no_such_module_here'"]
    r = check_config("--custom-rm-path", "gyre.evaluation:no_such_rule")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1
    assert "argument --custom-rm-path: cannot load 'gyre.evaluation:no_such_rule': AttributeError" in r.stderr


@pytest.mark.parametrize("argv, line", [
    (["--judge-base-url", "localhost:8000"],
     "argument --judge-base-url: must be an http(s) URL, got 'localhost:8000'"),
    (["--judge-api-key-env", "GYRE_TEST_JUDGE_KEY"],
     "argument --judge-api-key-env: needs --judge-base-url (the run's proxy takes the execution's key)"),
    (["--judge-base-url", "http://127.0.0.1:9/v1", "--judge-api-key-env", "GYRE_TEST_UNSET_JUDGE_KEY"],
     "argument --judge-api-key-env: $GYRE_TEST_UNSET_JUDGE_KEY is not set"),
])
def test_bad_judge_flags_exit_2_with_one_line(argv, line):
    r = check_config(*argv)
    assert r.returncode == 2 and r.stderr.splitlines() == [f"pretrain_gyre.py: error: {line}"]


def test_judge_tasks_pass_the_check():
    r = check_config("--tasks", str(ROOT / "examples" / "tasks" / "judge"), "--strict-tasks")
    assert (r.returncode, r.stderr) == (0, "")


def test_standalone_pool_is_accepted_and_needs_a_concurrency():
    r = check_config("--standalone-engines", "2", "--standalone-concurrency", "4")
    assert (r.returncode, r.stderr) == (0, "")
    r = check_config("--standalone-engines", "2")
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["pretrain_gyre.py: error: argument --standalone-concurrency: --standalone-engines 2 "
                                     "needs --standalone-concurrency > 0 (the executions the pool serves at once)"]


def test_cells_of_several_ranks_are_checked_against_the_model_and_the_checkpoint(tmp_path, tiny_model_dir):
    tp2 = ("--config", str(ROOT / "examples" / "cpu_tp2.yaml"))
    assert check_config(*tp2, world=4).returncode == 0
    r = check_config("--num-cells", "1", "--tensor-model-parallel-size", "4", world=4)
    assert r.returncode == 2 and r.stderr.strip().endswith("does not split into TP 4 x PP 1: "
                                                           "num_key_value_heads=2 is not divisible by 4")
    r = check_config("--num-cells", "1", "--pipeline-model-parallel-size", "4", world=4)
    assert r.returncode == 2 and "--pipeline-model-parallel-size" in r.stderr and "num_hidden_layers=2" in r.stderr
    r = check_config(*tp2, "--training-backend", "hf", world=4)
    assert r.stderr.splitlines() == ["pretrain_gyre.py: error: argument --tensor-model-parallel-size: cells of "
                                     "several ranks train with --training-backend megatron"]
    r = check_config(*tp2, world=8)
    assert r.returncode == 2 and "(no data parallelism inside a cell)" in r.stderr
    # a checkpoint of cells of 2 pipeline stages does not load into cells of TP 2
    ck = tmp_path / "run" / "checkpoints" / "iter_0000001"
    shutil.copytree(tiny_model_dir, ck / "hf")
    (ck / "controller.json").write_text(json.dumps({"iteration": 1, "training_backend": "megatron"}))
    (tmp_path / "run" / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("1")
    for name in ("optimizer.pt", "optimizer_shard1.pt"):
        (ck / name).write_bytes(b"")
    (ck / "parallel_layout.json").write_text(json.dumps({"tensor_model_parallel_size": 1,
                                                         "pipeline_model_parallel_size": 2}))
    assert check_config("--config", str(ROOT / "examples" / "cpu_pp2.yaml"), "--load", str(tmp_path / "run"),
                        world=4).returncode == 0
    r = check_config(*tp2, "--load", str(tmp_path / "run"), world=4)
    assert r.stderr.splitlines() == [f"pretrain_gyre.py: error: argument --load: {ck} holds the optimizer state of "
                                     "cells of TP 1 x PP 2; this run asks for TP 2 x PP 1"]
