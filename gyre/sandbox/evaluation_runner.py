"""Evaluation commands in a sandbox of the task's environment.

:class:`SandboxCommandRunner` has the signature of :func:`gyre.evaluation.process.run_command` and
is given to an executable check (``command_runner``): each test command runs in a fresh sandbox of
the run's backend and the task's environment, where

* the evaluation directory (the workspace copy, the JUnit report, ``HOME``, ``TMPDIR``) is the one
  writable path;
* the evaluator-only files (the task's hidden paths and its directory) and the preserved workspace
  are bound read-only -- there, and in no harness's sandbox;
* the run directory is masked, the network is off (unless the run gives executions one), and the
  run's limits apply;
* the sandbox is torn down when the command ends (or is stopped at its limit).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from gyre.evaluation.process import CommandRun
from gyre.sandbox.base import BackendUnavailable, ExecutionBackend
from gyre.sandbox.spec import Environment, Limits, SandboxSpec, sandbox_name

__all__ = ["SandboxCommandRunner"]

_counter = itertools.count()


class SandboxCommandRunner:
    """Runs evaluation commands in sandboxes (module docstring).

    Args:
        backend: the run's execution backend.
        environment: the task's environment.
        run_label: names the sandboxes (a start-up sweep finds them).
        evaluator_files: paths bound read-only (the task's hidden paths and directory).
        masks: paths hidden (the run directory).
    """

    def __init__(self, backend: ExecutionBackend, environment: Environment, *, run_label: str,
                 evaluator_files: Sequence[Path] = (), masks: Sequence[Path] = (), network: bool = False,
                 limits: Limits | None = None, readonly: Sequence[Path] = ()) -> None:
        self.backend, self.environment, self.run_label = backend, environment, run_label
        self.evaluator_files, self.masks = tuple(evaluator_files), tuple(masks)
        self.network, self.limits = network, limits or Limits()
        self.readonly = tuple(readonly)

    def __call__(self, argv: Sequence[str], *, cwd: str | os.PathLike[str], env: Mapping[str, str], timeout_s: float,
                 stdout_path: str | os.PathLike[str], stderr_path: str | os.PathLike[str], grace_s: float = 2.0,
                 readonly_paths: Sequence[str | os.PathLike[str]] = ()) -> CommandRun:
        """Run ``argv`` in a new sandbox; the evaluation directory is ``cwd``'s parent.

        Raises:
            ValueError: ``timeout_s <= 0``. OSError: the sandbox could not be made or the command
            not started.
        """
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        work = Path(cwd)
        eval_dir = work.parent
        spec = SandboxSpec(
            name=sandbox_name(self.run_label, f"{eval_dir.name}-{next(_counter)}", "e"), run_label=self.run_label,
            environment=self.environment, writable=(eval_dir,), readonly=(*self.readonly, *self.evaluator_files),
            masks=self.masks, protected=tuple(Path(p) for p in readonly_paths), network=self.network,
            limits=self.limits, workdir=work)
        start = time.monotonic()
        try:
            sandbox = self.backend.create(spec)
        except (BackendUnavailable, RuntimeError) as exc:
            raise OSError(f"evaluation sandbox could not be created: {exc}") from exc
        with sandbox:
            proc = sandbox.start(argv, env=env, cwd=work, log_path=stdout_path, stderr_path=stderr_path,
                                 kill_grace_s=grace_s)
            ex = proc.wait(timeout_s)
        return CommandRun(returncode=ex.returncode, timed_out=ex.timed_out, duration_s=time.monotonic() - start,
                          readonly_applied=bool(readonly_paths) and not ex.isolation_failed,
                          readonly_failed=ex.isolation_failed)
