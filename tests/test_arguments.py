import subprocess
import sys
import textwrap

import pytest

from gyre.arguments import build_parser, parse_args


def run_cli(*argv, cwd=None):
    code = "import sys; from gyre.arguments import parse_args; a = parse_args(sys.argv[1:]); print(a.steps_per_burst, a.extra_dispatch)"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=cwd)


def write(tmp_path, text, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def test_defaults_follow_design_doc():
    a = parse_args([])
    assert (a.n_samples_per_prompt, a.global_batch_groups, a.extra_dispatch, a.steps_per_burst) == (4, 2, 0.0, 1)
    assert a.max_trajectories_per_execution == 5
    assert (a.token_is_cap, a.seq_clip_low, a.seq_clip_high) == (5.0, 0.005, 0.005)
    assert (a.lr, a.adam_beta1, a.adam_beta2, a.adam_eps, a.weight_decay, a.clip_grad) == (1e-6, 0.9, 0.95, 1e-15, 0.01, 1.0)
    assert a.role_priority == ["main", "subagent", "compaction", "auxiliary"]
    assert a.placement == "elastic"


def test_yaml_keys_with_dash_or_underscore_and_cli_override(tmp_path):
    cfg = write(tmp_path, """
        steps-per-burst: 3
        extra_dispatch: 0.5
        global-batch-groups: 4
        role-priority: [main, compaction]
        advantage_std_scaling: false
    """)
    a = parse_args(["--config", cfg, "--steps-per-burst", "2"])
    assert a.steps_per_burst == 2  # the flag wins over the file
    assert a.extra_dispatch == 0.5
    assert a.global_batch_groups == 4
    assert a.role_priority == ["main", "compaction"]
    assert a.advantage_std_scaling is False
    # derived values
    assert a.queue_depth_groups == (0.5 + 2) * 4
    assert a.expected_staleness == 0.5 + (2 - 1) / 2
    assert a.executions_per_step == 4 * 4


@pytest.mark.parametrize("yaml_text, message", [
    ("bogus-key: 1\n", "config key 'bogus-key': unknown"),
    ("steps-per-burst: 2.5\n", "config key 'steps-per-burst': invalid value 2.5"),
    ("placement: sideways\n", "config key 'placement': invalid choice 'sideways'"),
    ("train-undelivered: 3\n", "config key 'train-undelivered': expected true or false"),
    ("n-samples-per-prompt: true\n", "config key 'n-samples-per-prompt': expected a number"),
    ("role-priority: [main, evaluator]\n", "argument --role-priority: evaluator tokens are never trainable"),
    ("- a\n- b\n", "expected a mapping"),
    ("a: [\n", "not valid YAML"),
])
def test_bad_config_exits_2_with_one_line(tmp_path, yaml_text, message):
    cfg = write(tmp_path, yaml_text)
    r = run_cli("--config", cfg)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert message in lines[0]


@pytest.mark.parametrize("argv, message", [
    (["--n-samples-per-prompt", "1"], "argument --n-samples-per-prompt: N must be >= 2"),
    (["--global-batch-groups", "0"], "argument --global-batch-groups: B must be >= 1"),
    (["--steps-per-burst", "0"], "argument --steps-per-burst: mu must be >= 1"),
    (["--extra-dispatch", "-1"], "argument --extra-dispatch: phi must be >= 0"),
    (["--max-trajectories-per-execution", "0"], "J_max must be >= 1"),
    (["--num-cells", "0"], "argument --num-cells: K must be >= 1"),
    (["--proxy-workers", "0"], "argument --proxy-workers: must be >= 1"),
    (["--placement", "colocate", "--extra-dispatch", "1"], "colocate requires phi = 0"),
    (["--standalone-handoff"], "argument --standalone-handoff: is for --placement colocate"),
    (["--placement", "colocate", "--standalone-handoff"], "needs a standalone pool"),
    (["--placement", "async", "--num-cells", "1"], "async needs >= 2 cells"),
    (["--placement", "async", "--num-cells", "3", "--train-cells", "3"], "argument --train-cells: must be in [1, 2]"),
    (["--proxy-max-body-bytes", "lots"], "argument --proxy-max-body-bytes: not a size: 'lots'"),
    (["--proxy-max-body-bytes", "0"], "argument --proxy-max-body-bytes: must be at least 1 byte"),
    (["--proxy-max-json-depth", "0"], "argument --proxy-max-json-depth: must be >= 1"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--config", "/nonexistent/x.yaml"], "config /nonexistent/x.yaml"),
])
def test_invalid_values_exit_2_with_one_line(argv, message):
    r = run_cli(*argv)
    assert r.returncode == 2, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert message in lines[0]


def test_proxy_request_limits_come_from_their_flags():
    from gyre.proxy.request_body import RequestLimits, limits_from_args
    from gyre.proxy.server import ProxyConfig

    assert limits_from_args(parse_args([])) == RequestLimits() == ProxyConfig().request_limits()
    a = parse_args(["--proxy-max-body-bytes", "1m", "--proxy-max-json-depth", "9", "--proxy-max-messages", "7",
                    "--proxy-max-tools", "3", "--proxy-max-tool-results", "2"])
    want = RequestLimits(1 << 20, 9, 7, 3, 2)
    assert limits_from_args(a) == want
    assert ProxyConfig(model_name="x").with_limits(want).request_limits() == want


def test_valid_cli_prints_values():
    r = run_cli("--steps-per-burst", "3", "--extra-dispatch", "0.5")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["3", "0.5"]


def test_add_gyre_args_works_as_megatron_extra_args_provider():
    import argparse

    from gyre.arguments import add_gyre_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=3e-4)  # stands for Megatron's own flags
    parser = add_gyre_args(parser)
    a = parser.parse_args(["--lr", "1e-5", "--placement", "async", "--n-samples-per-prompt", "16"])
    assert (a.lr, a.placement, a.n_samples_per_prompt) == (1e-5, "async", 16)


def test_help_lists_groups():
    text = build_parser(prog="pretrain_gyre.py").format_help()
    for title in ("rollout:", "placement:", "admission:", "objective:", "evaluation:", "harness:", "run:",
                  "optimizer (Megatron-LM names):"):
        assert title in text


def _main_job_parser():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("pretrain_gyre_main", Path(__file__).resolve().parents[1] / "pretrain_gyre.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return build_parser(mod.extra_args_provider, prog="pretrain_gyre.py")


def test_every_flag_has_help():
    parser = _main_job_parser()
    missing = [a.option_strings for a in parser._actions
               if a.dest not in ("help", "config") and not (a.help or "").strip()]
    assert missing == []
    assert len(parser._actions) > 80  # the Megatron-named, Gyre, SGLang and main-job flags are all there


def test_help_shows_defaults():
    import re

    text = " ".join(_main_job_parser().format_help().split())  # unwrap argparse's line breaks
    assert "--n-samples-per-prompt N_SAMPLES_PER_PROMPT N: executions per rollout group. (default: 4)" in text
    assert "--lr LR Learning rate (constant after the warm-up). (default: 1e-06)" in text
    assert "--seed SEED Random seed of the task order" in text and "(default: 1234)" in text
    assert "--placement {elastic,async,colocate} elastic (waterlevel)" in text and "(default: elastic)" in text
    # an unset (None) default is not printed; the help text says what unset means
    assert "(default: None)" not in text
    assert re.search(r"--run-dir RUN_DIR Output directory \(default runs/<timestamp>\)\. --", text)
    # BooleanOptionalAction names its default once
    assert text.count("A_i = (R_i - mean) / (std + eps) (on) or R_i - mean (off). (default: True)") == 1


def test_help_shows_config_file_values_as_defaults(tmp_path):
    cfg = write(tmp_path, "steps-per-burst: 3\n")
    proc = subprocess.run([sys.executable, "-c", "from gyre.arguments import parse_args; parse_args()",
                           "--config", cfg, "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "--steps-per-burst STEPS_PER_BURST mu: optimizer steps between two weight publications. (default: 3)" in text


def test_strict_tasks_flag_and_config_key(tmp_path):
    assert parse_args([]).strict_tasks is False
    assert parse_args(["--strict-tasks"]).strict_tasks is True
    assert parse_args(["--config", write(tmp_path, "strict-tasks: true\n")]).strict_tasks is True
    assert "--strict-tasks" in build_parser(prog="pretrain_gyre.py").format_help()


def test_streaming_and_standalone_handoff_reach_the_scheduler():
    from gyre.scheduler import SchedulerConfig

    c = SchedulerConfig.from_args(parse_args([]))
    assert c.streaming is True and c.standalone_handoff is False
    a = parse_args(["--placement", "colocate", "--standalone-handoff", "--extra-dispatch", "0.5",
                    "--global-batch-groups", "2", "--standalone-engines", "1", "--standalone-concurrency", "2",
                    "--no-streaming-training", "--num-cells", "2"])
    c = SchedulerConfig.from_args(a)
    assert (c.placement, c.phi, c.streaming, c.standalone_handoff, c.standalone_concurrency) == \
        ("colocate", 0.5, False, True, 2)
