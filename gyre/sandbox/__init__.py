"""Execution backends: where an execution's harness and its evaluation commands run.

One interface (:mod:`gyre.sandbox.base`), five backends: ``local`` (ordinary processes, paths
masked; :mod:`gyre.sandbox.local`), ``bwrap`` (bubblewrap over the host's root, no network, own
user, pid, ipc, uts and mount namespaces; :mod:`gyre.sandbox.bwrap`), ``podman`` and ``docker``
(one container per execution from the task's image or Dockerfile; :mod:`gyre.sandbox.podman`), and
``apptainer`` (:mod:`gyre.sandbox.apptainer`; its command lines are tested, it has not run here).
:mod:`gyre.sandbox.spec` describes a sandbox, :mod:`gyre.sandbox.registry` picks a backend,
:mod:`gyre.sandbox.gateway` and :mod:`gyre.sandbox.loopback` carry model calls from a sandbox
without a network to the proxy, :mod:`gyre.sandbox.cgroups` limits processes and memory,
:mod:`gyre.sandbox.process` is the child process every backend's command runs as,
:mod:`gyre.sandbox.evaluation_runner` runs evaluation commands in a sandbox, and
:mod:`gyre.sandbox.reaper` (its process: :mod:`gyre.sandbox.reaper_main`) removes a run's sandboxes
once their launcher is gone.
"""

from gyre.sandbox.base import BackendUnavailable, ExecutionBackend, Sandbox
from gyre.sandbox.process import ProcessExit, SandboxProcess, isolation_supported
from gyre.sandbox.registry import BACKENDS, make_backend, resolve_backend_name
from gyre.sandbox.spec import Environment, Limits, ProxyTarget, SandboxSpec, parse_size, sandbox_name

__all__ = ["BACKENDS", "BackendUnavailable", "Environment", "ExecutionBackend", "Limits", "ProcessExit", "ProxyTarget",
           "Sandbox", "SandboxProcess", "SandboxSpec", "isolation_supported", "make_backend", "parse_size",
           "resolve_backend_name", "sandbox_name"]
