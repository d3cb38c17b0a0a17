"""Preserved workspaces: snapshot a live workspace at execution closure, and tree digests.

At execution closure the workspace is preserved, then assessed. The harness launcher calls
:func:`preserve_workspace` once the harness has exited (or been killed); the snapshot is what every
assessment attempt -- retries included -- sees, so the
live directory can be reused or deleted. The snapshot id is a content digest of the tree
(:func:`tree_digest`), which is also how tests and the executable check verify that an
evaluation left the snapshot untouched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PreservedWorkspace", "preserve_workspace", "tree_digest"]

_CHUNK = 1 << 20


def tree_digest(root: str | os.PathLike[str]) -> str:
    """``"sha256:<hex>"`` over a directory tree: relative paths (sorted), entry types, the
    owner-executable bit, file bytes and symlink targets (links are not followed).

    Cost: reads every file once (O(bytes)). Ownership, timestamps and other mode bits are
    not part of the digest.

    Raises:
        FileNotFoundError: ``root`` is not a directory.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"not a directory: {root}")
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        entries = sorted(filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))])
        h.update(b"D\0" + rel_dir.encode("utf-8", "surrogateescape") + b"\0")
        for name in entries:
            full = os.path.join(dirpath, name)
            rel = os.path.join(rel_dir, name).encode("utf-8", "surrogateescape")
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                h.update(b"L\0" + rel + b"\0" + os.readlink(full).encode("utf-8", "surrogateescape") + b"\0")
            elif stat.S_ISREG(st.st_mode):
                h.update(b"F\0" + rel + b"\0" + (b"x" if st.st_mode & stat.S_IXUSR else b"-"))
                h.update(st.st_size.to_bytes(8, "little"))
                with open(full, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        h.update(chunk)
            else:  # fifo, socket, device: type only
                h.update(b"O\0" + rel + b"\0")
    return "sha256:" + h.hexdigest()


@dataclass(slots=True, frozen=True)
class PreservedWorkspace:
    """A workspace snapshot to assess.

    * ``path`` -- directory holding the snapshot (treat as read-only);
    * ``ref`` -- its snapshot id / artifact version (``sha256:<tree digest>`` when made by
      :func:`preserve_workspace`);
    * ``branch`` -- branch ref of the artifact, ``""`` if none.
    """

    path: Path
    ref: str
    branch: str = ""


def preserve_workspace(live: str | os.PathLike[str], dest: str | os.PathLike[str], *, branch: str = "",
                       symlinks: bool = True) -> PreservedWorkspace:
    """Copy the live workspace ``live`` to ``dest`` (must not exist) and return the snapshot.

    Symlinks are copied as links (``symlinks=True``), never followed out of the tree.
    The snapshot's ``ref`` is :func:`tree_digest` of the copy.

    Raises:
        FileNotFoundError: ``live`` is not a directory.
        FileExistsError: ``dest`` exists.
    """
    live, dest = Path(live), Path(dest)
    if not live.is_dir():
        raise FileNotFoundError(f"workspace not found: {live}")
    if dest.exists():
        raise FileExistsError(f"snapshot destination exists: {dest}")
    shutil.copytree(live, dest, symlinks=symlinks)
    return PreservedWorkspace(path=dest, ref=tree_digest(dest), branch=branch)
