"""What travels from rank 0 to a fleet node with an execution: archives of directories, and the
task rewritten for the node's copy of its files (no Ray here; pure functions and tar files).

* :func:`pack_dir` / :func:`unpack` -- a directory as gzip'd tar bytes (symbolic links kept as
  links), and back; unpacking refuses members that would land outside the destination
  (``tarfile``'s ``data`` filter).
* :func:`workspace_archive` -- a task's initial workspace materialised once on rank 0
  (:func:`gyre.tasks.materialize_workspace`: a directory copy, a git checkout, inline files) and
  packed; the node unpacks it once and copies it per execution.
* :func:`relocate_task` -- the task as the node sees it: its directory (the evaluator's
  ``{task_dir}`` paths, its hidden paths, a ``dockerfile``/``rootfs`` environment under it) moved
  to the node's copy, its workspace a plain copy of the unpacked one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from gyre.sandbox.spec import Environment
from gyre.tasks import TaskSpec, WorkspaceSpec, materialize_workspace

__all__ = ["pack_dir", "unpack", "workspace_archive", "relocate_task", "outside_task_dir"]

_SKIP = ("__pycache__", ".pytest_cache")


def pack_dir(root: str | os.PathLike[str]) -> bytes:
    """The tree under ``root`` as gzip'd tar bytes (members relative to ``root``; ``__pycache__``
    and ``.pytest_cache`` left out).

    Raises:
        OSError: ``root`` cannot be read.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"not a directory: {root}")
    buf = io.BytesIO()

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if Path(info.name).name in _SKIP else info

    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        for child in sorted(root.iterdir()):
            tar.add(child, arcname=child.name, filter=keep)
    return buf.getvalue()


def unpack(data: bytes, dest: str | os.PathLike[str]) -> Path:
    """Unpack :func:`pack_dir` bytes into ``dest`` (created; it must not exist yet).

    Raises:
        FileExistsError: ``dest`` exists. tarfile.FilterError: a member would leave ``dest``.
    """
    dest = Path(dest)
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(dest, filter="data")
    return dest


def workspace_archive(task: TaskSpec) -> bytes:
    """``task``'s initial workspace, materialised here and packed (:func:`pack_dir`).

    Raises:
        gyre.tasks.WorkspaceError: the workspace cannot be materialised (as on rank 0 without a fleet).
    """
    with tempfile.TemporaryDirectory(prefix="gyre-fleet-ws-") as tmp:
        return pack_dir(materialize_workspace(task.workspace, Path(tmp) / "workspace"))


def digest(data: bytes) -> str:
    """A short content digest of archive bytes (names the node's unpacked copy)."""
    return hashlib.sha256(data).hexdigest()[:20]


def outside_task_dir(task: TaskSpec) -> list[Path]:
    """``task``'s hidden paths that do not lie under its directory (a node receives only the
    directory, so a fleet cannot run such a task's evaluator)."""
    root = task.task_dir.resolve()
    return [h for h in task.hidden if not (Path(h).resolve() == root or root in Path(h).resolve().parents)]


def _moved(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, list):
        return [_moved(v, old, new) for v in value]
    if isinstance(value, tuple):
        return tuple(_moved(v, old, new) for v in value)
    if isinstance(value, dict):
        return {k: _moved(v, old, new) for k, v in value.items()}
    return value


def _moved_path(path: Path, old: Path, new: Path) -> Path:
    try:
        return new / Path(path).resolve().relative_to(old)
    except ValueError:
        return Path(path)


def relocate_task(task: TaskSpec, task_dir: str | os.PathLike[str], workspace: str | os.PathLike[str]) -> TaskSpec:
    """``task`` with its directory at ``task_dir`` (the node's copy) and its workspace copied from
    ``workspace`` (the node's unpacked :func:`workspace_archive`): every occurrence of the old
    directory's path in the evaluator spec's strings is replaced, and the hidden paths and a
    ``dockerfile``/``rootfs`` environment under it are moved."""
    old, new = task.task_dir.resolve(), Path(task_dir)
    env = task.environment
    if env is not None and env.kind in ("dockerfile", "rootfs"):
        env = Environment(env.kind, str(_moved_path(Path(env.ref), old, new)))
    return dataclasses.replace(
        task, workspace=WorkspaceSpec(dir=Path(workspace)), evaluator=_moved(task.evaluator, str(old), str(new)),
        hidden=tuple(_moved_path(h, old, new) for h in task.hidden), task_dir=new, environment=env)
