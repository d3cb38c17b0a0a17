"""What each real-harness adapter launches: command line, environment, generated config --
checked without the harness installed (a stand-in executable)."""

from __future__ import annotations

import json
import sys

import pytest

from gyre.harness import (
    ClaudeCodeHarness,
    CodexHarness,
    ExecutionDir,
    HarnessUnavailable,
    LaunchContext,
    MiniSweAgentHarness,
    ProxyEndpoint,
    ReferenceHarness,
    codex_config_toml,
    harness_from_args,
)
from gyre.harness.claude_code import last_json_object
from gyre.tasks import validate_task

EP = ProxyEndpoint("http://127.0.0.1:8100", "sk-key", model="policy-m")


@pytest.fixture
def ctx(tmp_path):
    task = validate_task({"id": "t", "instruction": "Fix it.", "evaluator": {"type": "executable", "command": "true"}},
                         source="s", task_dir=tmp_path)
    dirs = ExecutionDir.create(tmp_path / "run", "e-1", task)
    return LaunchContext("e-1", task, dirs, EP, 60.0)


@pytest.fixture
def fake_bin(tmp_path):
    p = tmp_path / "fakebin"
    p.write_text("#!/bin/sh\n")
    p.chmod(0o755)
    return str(p)


def test_claude_code_command(ctx, fake_bin):
    spec = ClaudeCodeHarness(binary=fake_bin, max_turns=7).build_command(ctx)
    assert spec.argv == [fake_bin, "-p", "Fix it.", "--dangerously-skip-permissions", "--output-format", "json",
                         "--model", "policy-m", "--max-turns", "7"]
    assert spec.env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8100" and spec.env["ANTHROPIC_API_KEY"] == "sk-key"
    for k in ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "DISABLE_TELEMETRY", "DISABLE_AUTOUPDATER",
              "DISABLE_ERROR_REPORTING", "IS_SANDBOX"):
        assert spec.env[k] == "1"
    assert "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE" not in spec.env
    assert ClaudeCodeHarness(binary=fake_bin, autocompact_pct=5).build_command(ctx).env[
        "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE"] == "5"
    with pytest.raises(ValueError):
        ClaudeCodeHarness(autocompact_pct=0)
    ctx.dirs.log_path.write_text('noise\n{"type":"result","result":"All done."}\n')
    assert ClaudeCodeHarness(binary=fake_bin).final_message(ctx) == "All done."
    assert last_json_object("x\n{bad}\n") is None


def test_codex_command_and_config(ctx, fake_bin):
    spec = CodexHarness(binary=fake_bin, context_window=4096).build_command(ctx)
    assert spec.argv[:6] == [fake_bin, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                             "--json", "--output-last-message"]
    assert spec.argv[-1] == "Fix it."
    assert spec.env == {"CODEX_HOME": str(ctx.dirs.home / ".codex"), "GYRE_API_KEY": "sk-key"}
    cfg = (ctx.dirs.home / ".codex" / "config.toml").read_text()
    assert cfg == codex_config_toml("http://127.0.0.1:8100/v1", "policy-m", settings={
        "model_context_window": 4096, "model_auto_compact_token_limit": 3276})
    import tomllib

    data = tomllib.loads(cfg)
    assert data["model"] == "policy-m" and data["model_provider"] == "gyre" and data["model_context_window"] == 4096
    assert data["model_auto_compact_token_limit"] == 3276
    prov = data["model_providers"]["gyre"]
    assert prov["base_url"] == "http://127.0.0.1:8100/v1" and prov["wire_api"] == "responses"
    assert prov["env_key"] == "GYRE_API_KEY" and "sk-key" not in cfg
    assert data["analytics"]["enabled"] is False and data["otel"]["exporter"] == "none"
    assert data["approval_policy"] == "never" and data["check_for_update_on_startup"] is False


def test_mini_swe_agent_command(ctx, fake_bin):
    h = MiniSweAgentHarness(binary=fake_bin, step_limit=5, config=["agent.mode=yolo"])
    spec = h.build_command(ctx)
    a = spec.argv
    assert a[:6] == [fake_bin, "-m", "openai/policy-m", "-t", "Fix it.", "-y"]
    assert "model.model_kwargs.api_base=http://127.0.0.1:8100/v1" in a and "agent.step_limit=5" in a
    assert a[a.index("-o") + 1] == str(ctx.dirs.root / "trajectory.json") and "agent.mode=yolo" in a
    assert spec.env["OPENAI_API_KEY"] == "sk-key" and spec.env["MSWEA_COST_TRACKING"] == "ignore_errors"
    assert spec.env["MSWEA_GLOBAL_CONFIG_DIR"].startswith(str(ctx.dirs.home))
    (ctx.dirs.root / "trajectory.json").write_text(json.dumps({"info": {"submission": "patch"}}))
    assert h.final_message(ctx) == "patch"


def test_reference_command(ctx):
    spec = ReferenceHarness(max_turns=3, compact_threshold_tokens=500, tools=["write_file"], system_prompt="",
                            max_tokens=64).build_command(ctx)
    a = spec.argv
    assert a[:3] == [sys.executable, "-m", "gyre.harness.reference_agent"]
    assert a[a.index("--base-url") + 1] == "http://127.0.0.1:8100/v1" and a[a.index("--tools") + 1] == "write_file"
    assert a[a.index("--system-prompt") + 1] == "" and a[a.index("--max-tokens") + 1] == "64"
    assert (ctx.dirs.home / "instruction.txt").read_text() == "Fix it."
    assert spec.env["GYRE_API_KEY"] == "sk-key" and "sk-key" not in " ".join(a)
    with pytest.raises(ValueError):
        ReferenceHarness(tools=["nope"])


def test_missing_installs(ctx, tmp_path):
    for cls in (ClaudeCodeHarness, CodexHarness, MiniSweAgentHarness):
        with pytest.raises(HarnessUnavailable, match="not found"):
            cls(binary=str(tmp_path / "none")).ensure_installed()


def test_harness_from_args():
    from gyre.arguments import parse_args

    args = parse_args(["--harness", "reference", "--seq-length", "2048", "--reference-tools", "write_file",
                       "--harness-max-turns", "4", "--harness-isolation", "off"])
    h = harness_from_args(args)
    assert isinstance(h, ReferenceHarness) and h.tools == ["write_file"] and h.max_turns == 4
    assert h.compact_threshold_tokens == 1536 and h.isolation == "off"
    h = harness_from_args(parse_args(["--harness", "mini-swe-agent", "--harness-max-turns", "9"]))
    assert isinstance(h, MiniSweAgentHarness) and h.step_limit == 9
    h = harness_from_args(parse_args(["--harness", "codex", "--execution-timeout-s", "5", "--seq-length", "32768"]))
    assert isinstance(h, CodexHarness) and h.settings["model_context_window"] == 32768
    assert harness_from_args(parse_args(["--harness", "reference"]), context_window=1000).compact_threshold_tokens == 750


def test_tasks_flag_must_exist(tmp_path):
    from gyre.arguments import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--tasks", str(tmp_path / "missing.jsonl")])
    assert info.value.code == 2
    from pathlib import Path

    toy = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "toy" / "tasks.jsonl"
    assert parse_args(["--tasks", str(toy)]).tasks == str(toy)
