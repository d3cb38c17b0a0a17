"""``local``: commands run as ordinary processes of this machine, as Gyre always ran them.

With isolation (``unshare``: its own mount and pid namespace, see :mod:`gyre.sandbox.process`) the
masked paths are hidden, ``/tmp`` is private and nothing the command leaves behind survives it;
without it only the process group holds the command together. Either way the command shares the
machine's network, user id and the rest of its file system: this backend hides paths, it is not a
security boundary. It runs only the ``host`` environment.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from gyre.sandbox.base import ExecutionBackend, Sandbox
from gyre.sandbox.process import ISOLATION_SETUP_FAILED, ISOLATION_SETUP_MARKER, isolation_argv, isolation_supported
from gyre.sandbox.spec import Environment, SandboxSpec, python_runtime_paths

__all__ = ["LocalBackend", "LocalSandbox", "copy_path"]


def copy_path(src: str | os.PathLike[str], dest: str | os.PathLike[str]) -> None:
    """Copy a file or a directory tree (symbolic links kept as links), creating ``dest``'s parent."""
    src, dest = Path(src), Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True)
    else:
        shutil.copy2(src, dest, follow_symlinks=False)


class LocalSandbox(Sandbox):
    """A ``local`` sandbox: the spec's first writable path is the execution's own directory."""

    def command(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path) -> tuple[list[str], dict[str, str]]:
        if not self.backend.isolated or not self.spec.writable:
            return [str(a) for a in argv], dict(env)
        # a private /tmp would hide a runtime that lives there (a checkout and its .venv under /tmp)
        tmp = Path("/tmp").resolve()
        needed = (*python_runtime_paths(), *self.spec.readonly)
        private_tmp = None if any(p == tmp or tmp in p.parents for p in needed) else self.spec.private_tmp_size
        return isolation_argv(argv, own_dir=self.spec.writable[0], cwd=cwd, masks=self.spec.masks,
                              private_tmp=private_tmp), dict(env)

    def setup_failed(self, returncode: int, log_tail: str) -> bool:
        return self.backend.isolated and returncode == ISOLATION_SETUP_FAILED and ISOLATION_SETUP_MARKER in log_tail

    def copy_in(self, src: str | os.PathLike[str], dest: str) -> None:
        copy_path(src, dest)

    def copy_out(self, src: str, dest: str | os.PathLike[str]) -> None:
        copy_path(src, dest)


class LocalBackend(ExecutionBackend):
    """Ordinary processes (module docstring).

    Args:
        isolation: ``"auto"`` (mask paths where ``unshare`` works), ``"require"`` (unavailable
            without it) or ``"off"``.
    """

    name = "local"

    def __init__(self, *, isolation: str = "auto", max_starts: int | None = None) -> None:
        super().__init__(max_starts=max_starts)
        if isolation not in ("auto", "require", "off"):
            raise ValueError(f"isolation must be auto, require or off, got {isolation!r}")
        self.isolation = isolation

    @property
    def isolated(self) -> bool:
        """Whether commands run under the isolation wrapper."""
        return self.isolation != "off" and isolation_supported()

    def unavailable_reason(self, environment: Environment | None = None) -> str | None:
        if environment is not None and not environment.is_host:
            return f"runs only the host environment, not {environment.describe()}"
        if self.isolation == "require" and not isolation_supported():
            return "isolation required but unavailable (unshare --mount --pid failed)"
        return None

    def _create(self, spec: SandboxSpec) -> LocalSandbox:
        return LocalSandbox(self, spec)
