"""The apptainer backend's command lines (Apptainer is not packaged here, so they are checked, not
run): isolation flags, binds in order, the proxy socket behind the forwarder, the environment in
APPTAINERENV_* variables of the client and not in its argv, image references, and its refusal
where apptainer is missing."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from gyre.sandbox import Environment, Limits, ProxyTarget, SandboxSpec
from gyre.sandbox.apptainer import ApptainerBackend, ApptainerSandbox
from gyre.sandbox.spec import IN_SANDBOX_PROXY_SOCKET


def sandbox(tmp_path, environment: Environment, **kw) -> ApptainerSandbox:
    spec = SandboxSpec(name="gyre-r-h-e1", run_label="r", environment=environment,
                       writable=(tmp_path / "run" / "executions" / "e1",), readonly=(tmp_path / "task",),
                       masks=(tmp_path / "run",), protected=(tmp_path / "run" / "executions" / "e1" / "execution.json",),
                       limits=Limits(), **kw)
    return ApptainerSandbox(ApptainerBackend(), spec, tmp_path / "gw" / "0.sock" if spec.proxy else None,
                            tmp_path / "empty")


def test_command_line(tmp_path):
    sb = sandbox(tmp_path, Environment("image", "python:3.11"), proxy=ProxyTarget("127.0.0.1", 8000))
    argv, env = sb.command(["mini", "-t", "fix it"], env={"OPENAI_API_KEY": "sk-secret", "PATH": "/usr/bin"},
                           cwd=tmp_path / "run" / "executions" / "e1" / "workspace")
    assert argv[1:6] == ["exec", "--containall", "--cleanenv", "--pwd", str(tmp_path / "run/executions/e1/workspace")]
    assert argv[6:9] == ["--net", "--network", "none"]
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
    own = tmp_path / "run" / "executions" / "e1"
    assert binds.index(f"{tmp_path / 'task'}:{tmp_path / 'task'}:ro") < binds.index(
        f"{tmp_path / 'empty'}:{tmp_path / 'run'}:ro") < binds.index(f"{own}:{own}:rw") < binds.index(
        f"{own / 'execution.json'}:{own / 'execution.json'}:ro")
    assert binds[-1] == f"{tmp_path / 'gw' / '0.sock'}:{IN_SANDBOX_PROXY_SOCKET}"
    image = argv.index("docker://python:3.11")
    assert argv[image + 1:image + 5] == [sys.executable, "-I", "-S", str(Path("gyre/sandbox/loopback.py").resolve())]
    assert argv[image + 5:] == ["8000", IN_SANDBOX_PROXY_SOCKET, "--", "mini", "-t", "fix it"]
    assert env["APPTAINERENV_OPENAI_API_KEY"] == "sk-secret" and "sk-secret" not in " ".join(argv)


def test_network_rootfs_and_sif(tmp_path):
    sb = sandbox(tmp_path, Environment("rootfs", str(tmp_path / "root")), network=True)
    argv, _ = sb.command(["true"], env={}, cwd=tmp_path)
    assert "--network" not in argv and argv[-2:] == [str(tmp_path / "root"), "true"]
    assert sandbox(tmp_path, Environment("image", "/images/task.sif")).image() == "/images/task.sif"


@pytest.mark.skipif(shutil.which("apptainer") is not None, reason="apptainer is installed here")
def test_unavailable_without_apptainer():
    reason = ApptainerBackend().unavailable_reason()
    assert reason and "not installed" in reason
