"""Backends by name, and the default a user expects: ``bwrap`` where it works, else ``local`` with a warning."""

from __future__ import annotations

import logging
from typing import Any

from gyre.sandbox.apptainer import ApptainerBackend
from gyre.sandbox.base import BackendUnavailable, ExecutionBackend
from gyre.sandbox.bwrap import BwrapBackend, bwrap_unavailable_reason
from gyre.sandbox.local import LocalBackend
from gyre.sandbox.podman import DockerBackend, PodmanBackend

__all__ = ["BACKENDS", "make_backend", "resolve_backend_name"]

logger = logging.getLogger(__name__)

BACKENDS: dict[str, type[ExecutionBackend]] = {
    "local": LocalBackend, "bwrap": BwrapBackend, "podman": PodmanBackend, "docker": DockerBackend,
    "apptainer": ApptainerBackend,
}


def resolve_backend_name(name: str) -> str:
    """``auto`` -> ``bwrap`` where bubblewrap runs sandboxes here, else ``local`` (one warning line);
    any other name is returned as is.

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        reason = bwrap_unavailable_reason()
        if reason is None:
            return "bwrap"
        logger.warning("executions run unsandboxed (local backend): %s", reason)
        return "local"
    if name not in BACKENDS:
        raise ValueError(f"unknown execution backend {name!r} (known: auto, {', '.join(BACKENDS)})")
    return name


def make_backend(name: str, **options: Any) -> ExecutionBackend:
    """The backend ``name`` (after :func:`resolve_backend_name`) with its options.

    Raises:
        ValueError: an unknown name. BackendUnavailable: the backend cannot run here.
    """
    backend = BACKENDS[resolve_backend_name(name)](**options)
    reason = backend.unavailable_reason()
    if reason:
        raise BackendUnavailable(f"execution backend {backend.name}: {reason}")
    return backend
