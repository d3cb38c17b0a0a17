"""Workspace materialisation: turn a task's :class:`~gyre.tasks.spec.WorkspaceSpec` into a directory.

Order: copy ``dir`` (symlinks copied as links; ``__pycache__``/``.pytest_cache`` left out) *or*
check out ``git.commit`` of the local repository ``git.repo`` (``git clone --no-checkout``,
then a detached ``git checkout``), *or* create an empty directory; then write the inline
``files`` on top. Any failure raises :class:`WorkspaceError` and leaves no partial directory
behind -- the caller turns it into a closure without assessable work (a placeholder:
reward 0 and an empty trajectory tree, :func:`gyre.evaluation.placeholder_tree`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from gyre.tasks.spec import WorkspaceSpec

__all__ = ["WorkspaceError", "materialize_workspace"]

_IGNORE = shutil.ignore_patterns("__pycache__", ".pytest_cache")


class WorkspaceError(Exception):
    """The workspace could not be created (source missing, bad commit, write failed)."""


def _git(args: list[str], cwd: Path | None, timeout_s: float) -> None:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_CONFIG_NOSYSTEM": "1"}
    try:
        res = subprocess.run(["git", "-c", "advice.detachedHead=false", *args], cwd=cwd, env=env,
                             capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise WorkspaceError("git is not installed") from None
    except subprocess.TimeoutExpired:
        raise WorkspaceError(f"git {args[0]} took longer than {timeout_s:.0f} s") from None
    if res.returncode != 0:
        msg = (res.stderr or res.stdout).strip().splitlines()
        raise WorkspaceError(f"git {args[0]} failed: {msg[-1] if msg else f'exit {res.returncode}'}")


def materialize_workspace(spec: WorkspaceSpec, dest: str | os.PathLike[str], *, git_timeout_s: float = 120.0) -> Path:
    """Create the workspace of ``spec`` at ``dest`` (which must not exist) and return its path.

    Raises:
        WorkspaceError: the source is missing, the git checkout failed, an inline file could
            not be written, or ``dest`` exists. ``dest`` is removed again on failure.
    """
    dest = Path(dest)
    if dest.exists():
        raise WorkspaceError(f"workspace destination exists: {dest}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        if spec.dir is not None:
            if not spec.dir.is_dir():
                raise WorkspaceError(f"workspace source directory not found: {spec.dir}")
            shutil.copytree(spec.dir, dest, symlinks=True, ignore=_IGNORE)
        elif spec.git is not None:
            if not spec.git.repo.exists():
                raise WorkspaceError(f"git repository not found: {spec.git.repo}")
            _git(["clone", "--quiet", "--no-checkout", "--no-hardlinks", str(spec.git.repo), str(dest)], None,
                 git_timeout_s)
            _git(["checkout", "--quiet", "--detach", spec.git.commit], dest, git_timeout_s)
        else:
            dest.mkdir()
        root = dest.resolve()
        for rel, text in spec.files:
            target = dest / rel
            parent = target.parent.resolve()
            if parent != root and root not in parent.parents:
                raise WorkspaceError(f"inline file {rel!r} would be written outside the workspace")
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_symlink():
                target.unlink()
            target.write_text(text, encoding="utf-8")
    except WorkspaceError:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    except OSError as exc:
        shutil.rmtree(dest, ignore_errors=True)
        raise WorkspaceError(f"cannot create workspace {dest}: {exc}") from exc
    return dest
