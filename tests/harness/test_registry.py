"""``--harness`` by dotted path: a harness class defined here, named ``tests.harness.test_registry:
EchoHarness`` on the command line or in the YAML config, is loaded by the scoring-rule loader and
runs an execution; a path that does not load exits 2 with one line; HarnessConfig holds the flags."""

from __future__ import annotations

import sys

import pytest

from gyre.arguments import parse_args
from gyre.harness import Harness, HarnessConfig, LaunchContext, LaunchSpec, ProxyEndpoint, RoleRules
from gyre.harness import harness_from_args, load_harness_class
from gyre.tasks import validate_task

DOTTED = "tests.harness.test_registry:EchoHarness"


def _dotted(cls: type) -> str:
    # pytest may import this file under another module name than the dotted path's
    return f"{cls.__module__}:{cls.__qualname__}"


class EchoHarness(Harness):
    """Writes the instruction, upper-cased, as its final message."""

    name = "echo"
    roles = RoleRules("echo")

    def build_command(self, ctx: LaunchContext) -> LaunchSpec:
        script = ("import os, pathlib; pathlib.Path(os.environ['FINAL']).write_text("
                  "os.environ['TEXT'].upper())")
        return LaunchSpec([sys.executable, "-c", script],
                          {"FINAL": str(ctx.dirs.final_message_path), "TEXT": ctx.task.instruction})


def test_dotted_harness_runs(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"harness: {DOTTED}\nharness-isolation: 'off'\nexecution-timeout-s: 30\n")
    for args in (parse_args(["--harness", DOTTED, "--harness-isolation", "off", "--execution-timeout-s", "30"]),
                 parse_args(["--config", str(cfg)])):
        h = harness_from_args(args)
        assert _dotted(type(h)) == DOTTED and h.isolation == "off" and h.default_timeout_s == 30.0
    task = validate_task({"id": "t", "instruction": "say hi", "evaluator": {"type": "executable", "command": "true"}},
                         source="s", task_dir=tmp_path)
    res = h.run(task, tmp_path / "run", "e-1", ProxyEndpoint("http://127.0.0.1:9", "sk-k"))
    assert res.exit_code == 0 and res.final_message == "SAY HI"


@pytest.mark.parametrize("value, reason", [
    ("tests.harness.no_such_module:EchoHarness", "ModuleNotFoundError"),
    ("tests.harness.test_registry:NoSuchClass", "AttributeError"),
    ("tests.harness.test_registry:test_dotted_harness_runs", "is not a gyre.harness.Harness subclass"),
    ("emacs", "unknown harness 'emacs'"),
])
def test_bad_harness_exits_2_with_one_line(tmp_path, capsys, value, reason):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"harness: '{value}'\n")
    for argv in (["--harness", value], ["--config", str(cfg)]):
        with pytest.raises(SystemExit) as info:
            parse_args(argv, prog="pretrain_gyre.py")
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.count("\n") == 1
        assert err.startswith("pretrain_gyre.py: error: argument --harness: ") and reason in err


def test_harness_config_from_args():
    args = parse_args(["--harness", "codex", "--harness-max-turns", "3", "--seq-length", "2048",
                       "--reference-tools", "bash", "--rollout-max-new-tokens", "64"])
    assert HarnessConfig.from_args(args) == HarnessConfig(
        harness="codex", isolation="auto", execution_timeout_s=600.0, max_turns=3, reference_tools="bash",
        reference_compact_threshold_tokens=None, reference_system_prompt=None, max_new_tokens=64, seq_length=2048)
    assert HarnessConfig.from_args(parse_args([])) == HarnessConfig()
    assert load_harness_class("codex").name == "codex" and _dotted(load_harness_class(DOTTED)) == DOTTED
