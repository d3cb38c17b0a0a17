"""The proxy's settings from Gyre's flags: the main job (``pretrain_gyre.py``, rank 0's proxy) and
``serve_rollout`` build the same :class:`ProxyConfig` for the same flags."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import types
from pathlib import Path

import pytest

from gyre.arguments import parse_args
from gyre.proxy import serve
from gyre.proxy.config import ProxyConfig
from gyre.runtime.rank0 import rank0_proxy

ROOT = Path(__file__).resolve().parents[2]


def main_job_args(argv: list[str]):
    spec = importlib.util.spec_from_file_location("pretrain_gyre_cfg", ROOT / "pretrain_gyre.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return parse_args(argv, extra_args_provider=mod.extra_args_provider, prog="pretrain_gyre.py")


def main_job_config(argv: list[str], model_dir, run_dir: Path) -> ProxyConfig:
    """The settings rank 0 gives its proxy workers (the constructor starts no process)."""
    args = main_job_args([*argv, "--proxy-workers", "2", "--run-dir", str(run_dir)])
    return rank0_proxy(args, model_dir, run_dir, types.SimpleNamespace(roles=None)).spec.config


def serve_config(argv: list[str], model_dir, run_dir: Path) -> ProxyConfig:
    """The settings of the proxy serve_rollout starts (in front of an engine URL it never calls)."""
    args = serve.parse_args([*argv, "--engine-url", "http://127.0.0.1:9", "--run-dir", str(run_dir)])
    svc = serve.RolloutService(args, str(model_dir))
    try:
        return svc.start().config
    finally:
        svc.stop()


FLAGS = ["--rollout-max-new-tokens", "77", "--rollout-temperature", "0.5", "--rollout-top-p", "0.9",
         "--rollout-kv-migration", "--rollout-kv-transport", "http", "--proxy-max-tools", "5",
         "--proxy-max-body-bytes", "1m", "--admin-token", "s3cret", "--seq-length", "1024"]


@pytest.mark.parametrize("extra, context", [([], 1024), (["--rollout-max-context-tokens", "3000"], 3000)])
def test_main_job_and_serve_rollout_build_the_same_proxy_config(tmp_path, tiny_model_dir, extra, context):
    want = dataclasses.replace(
        ProxyConfig(), model_name="gyre-policy", default_max_tokens=77, max_tokens_cap=77, max_context_tokens=context,
        admin_token="s3cret", default_sampling={"temperature": 0.5, "top_p": 0.9}, kv_migration=True,
        kv_transport="http", max_tools=5, max_body_bytes=1 << 20)
    main = main_job_config(FLAGS + extra, tiny_model_dir, tmp_path / "main")
    served = serve_config(FLAGS + extra, tiny_model_dir, tmp_path / "serve")
    assert main == want
    assert served == want


def test_defaults_are_the_same_for_both(tmp_path, tiny_model_dir):
    positions = json.loads((Path(tiny_model_dir) / "config.json").read_text())["max_position_embeddings"]
    assert positions > 4096  # so that the --seq-length bound is what decides
    main = main_job_config([], tiny_model_dir, tmp_path / "main")
    served = serve_config([], tiny_model_dir, tmp_path / "serve")
    assert main == served
    assert (main.max_context_tokens, main.admin_token, main.kv_migration, main.default_max_tokens) == \
        (4096, None, False, 512)
    assert main.request_limits() == ProxyConfig().request_limits()


def test_context_limit_is_the_model_positions_at_most_seq_length(tmp_path):
    args = parse_args(["--seq-length", "8192"])
    model = tmp_path / "model"
    model.mkdir()
    assert ProxyConfig.from_args(args, model).max_context_tokens == 8192  # no config.json: --seq-length
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    assert ProxyConfig.from_args(args, model).max_context_tokens == 2048
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 65536}))
    assert ProxyConfig.from_args(args, model).max_context_tokens == 8192
    args = parse_args(["--seq-length", "8192", "--rollout-max-context-tokens", "100000"])
    assert ProxyConfig.from_args(args, model).max_context_tokens == 100000  # the flag is not bounded
