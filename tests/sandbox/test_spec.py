"""The pure parts of a sandbox's description: sizes, environments (flag and task forms), names, the
proxy's port inside, and the task format's ``environment`` field with its errors."""

from __future__ import annotations

import pytest

from gyre.sandbox import Environment, Limits, ProxyTarget, parse_size, sandbox_name
from gyre.tasks import validate_task


@pytest.mark.parametrize("text, value", [("512m", 512 << 20), ("4g", 4 << 30), ("4GiB", 4 << 30), ("100", 100),
                                         ("1.5k", 1536), (" 2 t ", 2 << 40)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "4x", "-1g", "1e3"])
def test_bad_size(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_environment_forms(tmp_path):
    assert Environment.parse("host") == Environment() and Environment().is_host
    assert Environment.parse("image:python:3.11") == Environment("image", "python:3.11")
    assert Environment.parse("dockerfile:env/Dockerfile").ref == str((tmp_path.cwd() / "env" / "Dockerfile").resolve())
    for bad in ("image", "host:x", "vm:foo", "image:"):
        with pytest.raises(ValueError):
            Environment.parse(bad)
    assert Environment("image", "x").describe() == "image:x"


def test_limits_and_names():
    with pytest.raises(ValueError, match="pids"):
        Limits(pids=0)
    assert sandbox_name("run1", "a0-g0000-e00001", "h") == "gyre-run1-h-a0-g0000-e00001"
    assert sandbox_name("r", "x/y z") == "gyre-r-x-x_y_z"
    assert ProxyTarget("127.0.0.1", 8000).inside_port == 8000
    assert ProxyTarget("127.0.0.1", 80).inside_port == 20080


def task(tmp_path, environment):
    raw = {"id": "t", "instruction": "x", "evaluator": {"type": "executable", "command": "true"}}
    if environment is not None:
        raw["environment"] = environment
    return validate_task(raw, source="tasks.yaml:1", task_dir=tmp_path)


def test_task_environment_field(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM debian:bookworm\n")
    (tmp_path / "root").mkdir()
    assert task(tmp_path, None).environment is None
    assert task(tmp_path, "host").environment == Environment()
    assert task(tmp_path, {"image": "localhost/x:1"}).environment == Environment("image", "localhost/x:1")
    assert task(tmp_path, {"dockerfile": "Dockerfile"}).environment == Environment(
        "dockerfile", str(tmp_path / "Dockerfile"))
    assert task(tmp_path, {"rootfs": "root"}).environment == Environment("rootfs", str(tmp_path / "root"))


@pytest.mark.parametrize("environment, field, message", [
    ("docker", "environment", "must be 'host' or a mapping"),
    ({"image": "a", "dockerfile": "b"}, "environment", "must be 'host' or a mapping"),
    ({"image": ""}, "environment.image", "non-empty"),
    ({"dockerfile": "missing"}, "environment.dockerfile", "not a file"),
    ({"rootfs": "missing"}, "environment.rootfs", "not a directory"),
])
def test_bad_task_environment(tmp_path, environment, field, message):
    problems = task(tmp_path, environment)
    assert isinstance(problems, list) and len(problems) == 1
    assert problems[0].field == field and message in problems[0].message
