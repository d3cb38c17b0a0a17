"""materialize_workspace: directory copy, git checkout, inline files, clean failure."""

from __future__ import annotations

import subprocess

import pytest

from gyre.tasks import GitSource, WorkspaceError, WorkspaceSpec, materialize_workspace


def test_empty_and_inline_files(tmp_path):
    ws = materialize_workspace(WorkspaceSpec(files=(("a/b/c.txt", "hi\n"), ("top.py", "x = 1\n"))), tmp_path / "w")
    assert (ws / "a/b/c.txt").read_text() == "hi\n" and (ws / "top.py").read_text() == "x = 1\n"


def test_dir_copy_with_overlay(tmp_path):
    src = tmp_path / "src"
    (src / "pkg" / "__pycache__").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("good\n")
    (src / "pkg" / "__pycache__" / "mod.pyc").write_bytes(b"stale")
    (src / "link").symlink_to("pkg/mod.py")
    ws = materialize_workspace(WorkspaceSpec(dir=src, files=(("pkg/mod.py", "buggy\n"),)), tmp_path / "w")
    assert (ws / "pkg/mod.py").read_text() == "buggy\n"
    assert (src / "pkg/mod.py").read_text() == "good\n"          # the source is untouched
    assert not (ws / "pkg" / "__pycache__").exists()
    assert (ws / "link").is_symlink()


def test_git_checkout(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "f.txt").write_text("v1\n")
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    first = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (repo / "f.txt").write_text("v2\n")
    subprocess.run([*git, "commit", "-qam", "two"], check=True)
    ws = materialize_workspace(WorkspaceSpec(git=GitSource(repo, first)), tmp_path / "w")
    assert (ws / "f.txt").read_text() == "v1\n" and (ws / ".git").is_dir()
    with pytest.raises(WorkspaceError, match="git checkout failed"):
        materialize_workspace(WorkspaceSpec(git=GitSource(repo, "deadbeef")), tmp_path / "w2")
    assert not (tmp_path / "w2").exists()


def test_failures_leave_nothing(tmp_path):
    with pytest.raises(WorkspaceError, match="not found"):
        materialize_workspace(WorkspaceSpec(dir=tmp_path / "missing"), tmp_path / "w")
    assert not (tmp_path / "w").exists()
    (tmp_path / "exists").mkdir()
    with pytest.raises(WorkspaceError, match="exists"):
        materialize_workspace(WorkspaceSpec(), tmp_path / "exists")
    src = tmp_path / "src"
    src.mkdir()
    (src / "out").symlink_to(tmp_path)
    with pytest.raises(WorkspaceError, match="outside the workspace"):
        materialize_workspace(WorkspaceSpec(dir=src, files=(("out/evil.txt", "x"),)), tmp_path / "w3")
    assert not (tmp_path / "w3").exists() and not (tmp_path / "evil.txt").exists()
