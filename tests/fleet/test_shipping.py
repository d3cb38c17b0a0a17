"""What a fleet node receives: directory archives and the task rewritten for the node's copy."""

from __future__ import annotations

import io
import tarfile

import pytest

from gyre.fleet.shipping import outside_task_dir, pack_dir, relocate_task, unpack, workspace_archive
from gyre.sandbox.spec import Environment
from gyre.tasks import TaskSpec, WorkspaceSpec


def test_pack_and_unpack_keep_files_and_links_and_skip_caches(tmp_path):
    src = tmp_path / "src"
    (src / "pkg" / "__pycache__").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("x = 1\n")
    (src / "pkg" / "__pycache__" / "a.pyc").write_bytes(b"\0")
    (src / "link").symlink_to("pkg/a.py")
    out = unpack(pack_dir(src), tmp_path / "out")
    assert (out / "pkg" / "a.py").read_text() == "x = 1\n"
    assert (out / "link").is_symlink() and (out / "link").read_text() == "x = 1\n"
    assert not (out / "pkg" / "__pycache__").exists()
    with pytest.raises(FileExistsError):
        unpack(pack_dir(src), out)


def test_unpack_refuses_a_member_outside_the_destination(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = b"evil"
        info = tarfile.TarInfo("../escaped")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(tarfile.FilterError):
        unpack(buf.getvalue(), tmp_path / "dest")
    assert not (tmp_path / "escaped").exists()


def test_relocate_moves_every_path_under_the_task_dir(tmp_path):
    old = tmp_path / "tasks" / "t1"
    (old / "hidden").mkdir(parents=True)
    (old / "Dockerfile").write_text("FROM scratch\n")
    task = TaskSpec("t1", "do", WorkspaceSpec(files=(("a.txt", "a"),)),
                    {"type": "executable", "command": ["pytest", f"{old}/hidden", "--rootdir", str(old)],
                     "env": {"DATA": f"{old}/hidden/data"}},
                    hidden=(old / "hidden",), task_dir=old, environment=Environment("dockerfile", str(old / "Dockerfile")))
    new = tmp_path / "node" / "copy"
    moved = relocate_task(task, new, tmp_path / "node" / "ws")
    assert moved.evaluator == {"type": "executable", "command": ["pytest", f"{new}/hidden", "--rootdir", str(new)],
                               "env": {"DATA": f"{new}/hidden/data"}}
    assert moved.hidden == (new / "hidden",) and moved.task_dir == new
    assert moved.environment == Environment("dockerfile", str(new / "Dockerfile"))
    assert moved.workspace == WorkspaceSpec(dir=tmp_path / "node" / "ws")
    assert (moved.id, moved.instruction) == (task.id, task.instruction)
    assert outside_task_dir(task) == []
    elsewhere = TaskSpec("t2", "do", WorkspaceSpec(), {}, hidden=(tmp_path / "secret",), task_dir=old)
    assert outside_task_dir(elsewhere) == [tmp_path / "secret"]


def test_the_workspace_archive_is_the_materialised_workspace(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "base.txt").write_text("base")
    task = TaskSpec("t", "do", WorkspaceSpec(dir=tmp_path / "ws", files=(("extra/b.txt", "b"),)), {}, task_dir=tmp_path)
    out = unpack(workspace_archive(task), tmp_path / "out")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == ["base.txt", "extra", "extra/b.txt"]
    assert (out / "extra" / "b.txt").read_text() == "b"


@pytest.mark.parametrize("url, rewrite", [
    ("http://127.0.0.1:8000", True), ("http://localhost:8000", True), ("http://[::1]:8000", True),
    ("http://0.0.0.0:8000", True), ("http://[::]:8000", True), ("http://10.1.2.3:8000", False),
    ("http://rank0.cluster:8000", False)])
def test_proxy_urls_nodes_elsewhere_cannot_use_are_rewritten_keeping_the_port(url, rewrite):
    from gyre.fleet.launcher import needs_advertised_host, with_host

    assert needs_advertised_host(url) is rewrite
    assert with_host(url, "10.9.8.7") == "http://10.9.8.7:8000"
    assert with_host("http://0.0.0.0:8000/v1", "fd00::5") == "http://[fd00::5]:8000/v1"
