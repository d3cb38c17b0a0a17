"""Backends for the conformance suite: each test that takes ``backend`` runs against local, bwrap,
podman, docker (the docker CLI against podman's own Docker-compatible service, started here) and
apptainer (skipped where it is not installed: it is not packaged for this machine's Debian).

A backend whose tool is missing is skipped with one reason (``bash tools/setup_sandbox.sh`` installs
them); CI runs that script first, so there they all run."""

from __future__ import annotations

import http.server
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from gyre.sandbox import Environment, ExecutionBackend, Limits, ProxyTarget, SandboxSpec, make_backend
from gyre.sandbox.podman import TEST_IMAGE

BACKEND_NAMES = ["local", "bwrap", "podman", "docker", "apptainer"]
#: Container runtimes start a container per test (1-3 s each): outside the smoke tier.
CONTAINER_BACKENDS = ("podman", "docker", "apptainer")


@pytest.fixture(scope="session")
def podman_service():
    """``podman system service`` on a Unix socket of its own, for the docker CLI; ended after the session."""
    if shutil.which("podman") is None or shutil.which("docker") is None:
        pytest.skip("docker backend: the podman service or the docker CLI is not installed")
    sock_dir = Path(tempfile.mkdtemp(prefix="gyre-podsvc-"))
    sock = sock_dir / "podman.sock"
    proc = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{sock}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.skip("docker backend: podman system service did not start")
        time.sleep(0.05)
    yield f"unix://{sock}"
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.fixture(params=[pytest.param(n, marks=pytest.mark.slow) if n in CONTAINER_BACKENDS else n
                        for n in BACKEND_NAMES])
def backend(request) -> ExecutionBackend:
    name = request.param
    options = {}
    if name == "docker":
        options = {"host": request.getfixturevalue("podman_service"), "runtime": "runc"}
    try:
        b = make_backend(name, **options)
    except Exception as exc:
        hint = "" if name == "apptainer" else " (bash tools/setup_sandbox.sh installs it)"
        pytest.skip(f"{name} backend unavailable here: {exc}{hint}")
    if name in ("podman", "docker", "apptainer"):
        reason = b.unavailable_reason(Environment("image", TEST_IMAGE))
        if reason:
            pytest.skip(f"{name} backend: {reason}")
    yield b
    b.close()


@dataclass
class Layout:
    """A run directory with one execution's directory, like the launcher makes."""

    run: Path
    own: Path
    workspace: Path
    other: Path


@pytest.fixture
def layout(tmp_path) -> Layout:
    run = tmp_path / "run"
    own = run / "executions" / "e1"
    other = run / "executions" / "e2"
    for d in (own / "workspace", own / "home", own / "tmp", other / "workspace"):
        d.mkdir(parents=True)
    (other / "workspace" / "secret.txt").write_text("other execution's file\n")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "model.bin").write_text("weights\n")
    return Layout(run, own, own / "workspace", other)


def environment_for(backend: ExecutionBackend) -> Environment:
    return Environment("image", TEST_IMAGE) if backend.name in ("podman", "docker", "apptainer") else Environment()


def spec_for(backend: ExecutionBackend, layout: Layout, *, name: str = "e1", proxy: ProxyTarget | None = None,
             limits: Limits | None = None, label: str = "conformance") -> SandboxSpec:
    return SandboxSpec(name=f"gyre-{label}-{name}-{time.monotonic_ns()}", run_label=label,
                       environment=environment_for(backend), writable=(layout.own,), masks=(layout.run,),
                       proxy=proxy, limits=limits or Limits(pids=256, memory_bytes=512 << 20),
                       workdir=layout.workspace)


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"hello from the proxy"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    """An HTTP server on 127.0.0.1 standing for the proxy; yields its port."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()
