"""Harness installs: cache layout, the completion marker, and "registry unreachable" as
HarnessUnavailable (so tests skip) vs. a failed install as HarnessInstallError."""

from __future__ import annotations

import os

import pytest

from gyre.harness import HarnessPackage, HarnessUnavailable, ensure_package, harness_cache_dir
from gyre.harness.install import HarnessInstallError, installed_bin

PKG = HarnessPackage("npm", "@example/tool", "1.2.3", "tool", "tool")


def fake_npm(tmp_path, script: str):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    npm = bindir / "npm"
    npm.write_text("#!/bin/sh\n" + script)
    npm.chmod(0o755)
    return f"{bindir}{os.pathsep}{os.environ['PATH']}"


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("GYRE_HARNESS_CACHE", str(tmp_path / "c"))
    assert harness_cache_dir() == tmp_path / "c"
    assert installed_bin(PKG, tmp_path) == tmp_path / "tool-1.2.3" / "node_modules" / ".bin" / "tool"
    pypi = HarnessPackage("pypi", "mini-swe-agent", "2.4.6", "mini", "mini-swe-agent")
    assert installed_bin(pypi, tmp_path) == tmp_path / "mini-swe-agent-2.4.6" / "venv" / "bin" / "mini"
    assert pypi.spec == "mini-swe-agent==2.4.6" and PKG.spec == "@example/tool@1.2.3"


def test_complete_install_is_reused_without_the_registry(monkeypatch, tmp_path):
    exe = installed_bin(PKG, tmp_path)
    exe.parent.mkdir(parents=True)
    exe.write_text("")
    (tmp_path / "tool-1.2.3" / ".gyre-complete").write_text("ok")
    monkeypatch.setenv("PATH", fake_npm(tmp_path, "exit 99\n"))  # any registry use would fail
    assert ensure_package(PKG, tmp_path) == exe


def test_unreachable_registry_is_unavailable(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", fake_npm(tmp_path, 'echo "npm error code ENOTFOUND registry.npmjs.org" >&2; exit 1\n'))
    with pytest.raises(HarnessUnavailable, match="registry unreachable.*ENOTFOUND"):
        ensure_package(PKG, tmp_path / "cache")
    assert not (tmp_path / "cache" / "tool-1.2.3").exists()


def test_failed_install_is_an_error_and_leaves_nothing(monkeypatch, tmp_path):
    # `npm view` answers with the version, `npm install` fails
    monkeypatch.setenv("PATH", fake_npm(tmp_path, 'if [ "$1" = view ]; then echo 1.2.3; exit 0; fi\n'
                                                  'echo "npm error EACCES" >&2; exit 1\n'))
    with pytest.raises(HarnessInstallError, match="EACCES"):
        ensure_package(PKG, tmp_path / "cache")
    assert not (tmp_path / "cache" / "tool-1.2.3").exists()


def test_install_writes_marker(monkeypatch, tmp_path):
    script = ('if [ "$1" = view ]; then echo 1.2.3; exit 0; fi\n'
              'prefix=$3; mkdir -p "$prefix/node_modules/.bin" && touch "$prefix/node_modules/.bin/tool"\n')
    monkeypatch.setenv("PATH", fake_npm(tmp_path, script))
    exe = ensure_package(PKG, tmp_path / "cache")
    assert exe.exists() and (tmp_path / "cache" / "tool-1.2.3" / ".gyre-complete").exists()
