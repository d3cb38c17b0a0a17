"""What one sandbox is made of: its environment, its mounts, its network, its limits (pure data).

An :class:`Environment` is the root file system a command sees:

* ``host`` -- the machine's own root, read-only (the default of a task that names none);
* ``image`` -- an OCI image by name (``localhost/gyre-test:bookworm``, ``python:3.11``);
* ``dockerfile`` -- a Dockerfile, built once into an image tagged by the digest of its text;
* ``rootfs`` -- a directory holding an unpacked root file system.

A :class:`SandboxSpec` says which paths are bound in (each at its own path, so the commands, the
``HOME`` and the workspace paths a launcher writes stay valid inside), which are hidden, whether the
sandbox has a network, how it reaches the proxy without one, and its :class:`Limits`.
"""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["python_runtime_paths", "ENVIRONMENT_KINDS", "Environment", "Limits", "ProxyTarget", "SandboxSpec",
           "IN_SANDBOX_PROXY_SOCKET", "parse_size", "sandbox_name"]

ENVIRONMENT_KINDS = ("host", "image", "dockerfile", "rootfs")

#: Where a sandbox without a network finds its proxy socket.
IN_SANDBOX_PROXY_SOCKET = "/run/gyre/proxy.sock"

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_NAME_RE = re.compile(r"[^a-zA-Z0-9_.-]")


def parse_size(text: str | int | None) -> int | None:
    """``"512m"`` -> 536870912 (k, m, g, t are powers of 1024; a bare number is bytes).

    Raises:
        ValueError: not a size.
    """
    if text is None or isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 512m, 4g)")
    scale = 1024 ** " kmgt".index((m.group(2) or " ").lower())
    return int(float(m.group(1)) * scale)


def python_runtime_paths() -> tuple[Path, ...]:
    """What running this interpreter and Gyre's own modules needs: the virtual environment, the
    base installation it points to, and the directory holding the ``gyre`` package."""
    paths = [Path(sys.prefix), Path(sys.base_prefix), Path(__file__).resolve().parents[2]]
    return tuple(dict.fromkeys(p.resolve() for p in paths))


def sandbox_name(run_label: str, execution_id: str, role: str = "x") -> str:
    """The name of a sandbox (container, cgroup): ``gyre-<run>-<role>-<execution>``, safe characters only."""
    return _NAME_RE.sub("_", f"gyre-{run_label}-{role}-{execution_id}")


@dataclass(slots=True, frozen=True)
class Environment:
    """The root file system of a sandbox (module docstring).

    Raises:
        ValueError: an unknown ``kind``, or a ``ref`` missing where the kind needs one.
    """

    kind: str = "host"
    ref: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ENVIRONMENT_KINDS:
            raise ValueError(f"environment kind must be one of {', '.join(ENVIRONMENT_KINDS)}, got {self.kind!r}")
        if self.kind != "host" and not self.ref:
            raise ValueError(f"a {self.kind} environment needs a reference (image name or path)")

    @property
    def is_host(self) -> bool:
        return self.kind == "host"

    def dockerfile_tag(self) -> str:
        """The image tag a Dockerfile environment is built as: the digest of the file's text."""
        digest = hashlib.sha256(Path(self.ref).read_bytes()).hexdigest()[:16]
        return f"localhost/gyre-task:{digest}"

    def describe(self) -> str:
        """``host`` or ``KIND:REF`` (what :meth:`parse` reads)."""
        return "host" if self.is_host else f"{self.kind}:{self.ref}"

    @classmethod
    def parse(cls, text: str) -> "Environment":
        """``host``, ``image:NAME``, ``dockerfile:PATH`` or ``rootfs:PATH`` (paths made absolute).

        Raises:
            ValueError: any other text.
        """
        if text.strip() == "host":
            return cls()
        kind, sep, ref = text.partition(":")
        if not sep or kind not in ENVIRONMENT_KINDS or kind == "host":
            raise ValueError(f"an environment is host, image:NAME, dockerfile:PATH or rootfs:PATH, got {text!r}")
        if kind in ("dockerfile", "rootfs"):
            ref = str(Path(ref).resolve())
        return cls(kind, ref)


@dataclass(slots=True, frozen=True)
class Limits:
    """Per-sandbox limits; ``None`` is no limit.

    * ``pids`` -- processes and threads at once (a cgroup's ``pids.max``);
    * ``memory_bytes`` -- resident memory (a cgroup's memory limit; the kernel's OOM killer ends
      the sandbox's largest process when it is reached);
    * ``workspace_bytes`` -- the size of the execution's directory, checked by the launcher while
      the command runs (:func:`gyre.sandbox.limits.directory_size`).
    """

    pids: int | None = 1024
    memory_bytes: int | None = None
    workspace_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("pids", "memory_bytes", "workspace_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise ValueError(f"limit {name} must be a positive integer or None, got {v!r}")


@dataclass(slots=True, frozen=True)
class ProxyTarget:
    """Where the proxy listens on the launcher's machine (``host``:``port``). A sandbox without a
    network reaches it through a Unix socket of its own bound at :data:`IN_SANDBOX_PROXY_SOCKET`,
    with a forwarder listening on ``127.0.0.1:port`` inside (:attr:`inside_port`), so a harness's
    proxy URL is the same inside and outside."""

    host: str
    port: int

    @property
    def inside_port(self) -> int:
        """The forwarder's port inside: the proxy's own, or ``20000 + port`` for a port below 1024,
        which a sandboxed user without capabilities cannot listen on."""
        return self.port if self.port >= 1024 else 20000 + self.port


@dataclass(slots=True, frozen=True)
class SandboxSpec:
    """One sandbox.

    * ``name`` -- unique per run (:func:`sandbox_name`); ``run_label`` -- names the run, so a
      start-up sweep finds what an earlier crash left;
    * ``writable`` -- paths bound read-write at their own path (the execution's directory);
    * ``readonly`` -- paths bound read-only at their own path, applied before ``masks`` (the
      harness's runtime: an interpreter, a checkout, an install cache; evaluator-only files);
    * ``masks`` -- paths hidden (an empty directory or ``/dev/null`` over them), for the host root;
    * ``protected`` -- paths bound read-only last, over the masks and the writable paths (files of
      the execution directory the launcher writes; the preserved workspace an evaluation reads);
    * ``network`` -- ordinary networking (off: only a loopback device of its own);
    * ``proxy`` -- the proxy to reach without a network (``None``: no proxy);
    * ``workdir`` -- the initial working directory;
    * ``private_tmp_size`` -- the size of the sandbox's own ``/tmp`` (``None``: the host's ``/tmp``
      stays visible, for a harness whose files live there; only the ``local`` backend honours it).
    """

    name: str
    run_label: str
    environment: Environment = field(default_factory=Environment)
    writable: tuple[Path, ...] = ()
    readonly: tuple[Path, ...] = ()
    masks: tuple[Path, ...] = ()
    protected: tuple[Path, ...] = ()
    network: bool = False
    proxy: ProxyTarget | None = None
    workdir: Path | None = None
    limits: Limits = field(default_factory=Limits)
    private_tmp_size: str | None = "2g"
