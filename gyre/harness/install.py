"""Install real harnesses from their package registries into a cache (never into Gyre's venv).

:class:`PackagedHarness` is the base of the adapters of such harnesses (install, locate, "not
installed" error); the ones here are Claude Code, Codex and mini-swe-agent.
:func:`ensure_package` installs one :class:`HarnessPackage` -- npm packages with
``npm install --prefix``, PyPI packages into a separate virtual environment -- under
:func:`~gyre.harness.execution.harness_cache_dir`.

When the registry does not answer, the harness is :class:`~gyre.harness.HarnessUnavailable`
("registry unreachable"), so tests can skip; a failure *after* the registry answered is a real
error (:class:`HarnessInstallError`).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from gyre.harness.base import Harness, HarnessUnavailable
from gyre.harness.execution import harness_cache_dir

__all__ = ["HarnessPackage", "HarnessInstallError", "PackagedHarness", "harness_cache_dir", "ensure_package",
           "installed_bin"]

logger = logging.getLogger(__name__)

_MARKER = ".gyre-complete"


class HarnessInstallError(RuntimeError):
    """The registry answered but the install failed (message: the installer's last lines)."""


@dataclass(slots=True, frozen=True)
class HarnessPackage:
    """A harness distribution: ``kind`` ``npm`` or ``pypi``, the package ``name`` and exact
    ``version``, the executable ``bin`` it provides, and ``slug`` naming its cache directory."""

    kind: str
    name: str
    version: str
    bin: str
    slug: str

    @property
    def spec(self) -> str:
        return f"{self.name}@{self.version}" if self.kind == "npm" else f"{self.name}=={self.version}"


def _dest(pkg: HarnessPackage, cache: Path) -> Path:
    return cache / f"{pkg.slug}-{pkg.version}"


def installed_bin(pkg: HarnessPackage, cache: Path | None = None) -> Path:
    """Where ``pkg``'s executable is once installed (it may not exist yet)."""
    d = _dest(pkg, cache or harness_cache_dir())
    return d / "node_modules" / ".bin" / pkg.bin if pkg.kind == "npm" else d / "venv" / "bin" / pkg.bin


def _run(argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
                          env=env)


def _tail(res: subprocess.CompletedProcess, n: int = 3) -> str:
    lines = [ln for ln in (res.stderr + res.stdout).splitlines() if ln.strip() and "WARNING: Location" not in ln]
    return " | ".join(lines[-n:]) or f"exit {res.returncode}"


def _probe(pkg: HarnessPackage, timeout_s: float) -> None:
    """Ask the registry for the exact version; HarnessUnavailable when it does not answer."""
    try:
        if pkg.kind == "npm":
            npm = shutil.which("npm")
            if npm is None:
                raise HarnessUnavailable(f"{pkg.name}: npm is not installed (needs Node.js >= 18)")
            res = _run([npm, "view", pkg.spec, "version"], timeout_s)
            ok = res.returncode == 0 and pkg.version in res.stdout
        else:
            with tempfile.TemporaryDirectory(prefix="gyre-probe-") as tmp:
                res = _run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, pkg.spec],
                           timeout_s)
            ok = res.returncode == 0
    except subprocess.TimeoutExpired:
        raise HarnessUnavailable(f"{pkg.spec}: package registry unreachable (no answer in {timeout_s:.0f} s)") \
            from None
    if not ok:
        raise HarnessUnavailable(f"{pkg.spec}: package registry unreachable or version missing ({_tail(res, 2)})")


def ensure_package(pkg: HarnessPackage, cache: Path | None = None, *, timeout_s: float = 1200.0,
                   probe_timeout_s: float = 90.0) -> Path:
    """Install ``pkg`` into the cache unless it is there; return its executable's path.

    * npm packages (``@anthropic-ai/claude-code``, ``@openai/codex``):
      ``npm install --prefix <cache>/<name>-<version> <package>@<version>``;
    * PyPI packages (``mini-swe-agent``): a separate virtual environment
      ``<cache>/<name>-<version>/venv`` (made with this interpreter's ``venv``), so the harness's
      dependencies never touch Gyre's.

    Before installing, the registry is asked for the exact version (``npm view`` /
    ``pip download --no-deps``). An install is complete when its directory holds
    ``.gyre-complete``; concurrent installers serialise on a lock file, and a half-finished
    directory is removed and redone.

    Raises:
        HarnessUnavailable: the registry is unreachable (or npm/Node.js is missing).
        HarnessInstallError: the install failed although the registry answered.
    """
    cache = cache or harness_cache_dir()
    dest, exe = _dest(pkg, cache), installed_bin(pkg, cache)
    if (dest / _MARKER).exists() and exe.exists():
        return exe
    with FileLock(cache / f".{dest.name}.lock"):
        if (dest / _MARKER).exists() and exe.exists():
            return exe
        _probe(pkg, probe_timeout_s)
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        t0 = time.monotonic()
        logger.info("installing %s into %s", pkg.spec, dest)
        try:
            if pkg.kind == "npm":
                res = _run([shutil.which("npm") or "npm", "install", "--prefix", str(dest), "--no-audit", "--no-fund",
                            "--loglevel=error", "--no-save", pkg.spec], timeout_s)
            else:
                res = _run([sys.executable, "-m", "venv", str(dest / "venv")], timeout_s)
                if res.returncode == 0:
                    res = _run([str(dest / "venv" / "bin" / "python"), "-m", "pip", "install", "--quiet",
                                "--disable-pip-version-check", pkg.spec], timeout_s)
        except subprocess.TimeoutExpired:
            shutil.rmtree(dest, ignore_errors=True)
            raise HarnessInstallError(f"installing {pkg.spec} took longer than {timeout_s:.0f} s") from None
        if res.returncode != 0 or not exe.exists():
            shutil.rmtree(dest, ignore_errors=True)
            raise HarnessInstallError(f"installing {pkg.spec} failed: {_tail(res)}")
        (dest / _MARKER).write_text(f"{pkg.spec} installed in {time.monotonic() - t0:.1f} s\n")
        logger.info("installed %s in %.1f s", pkg.spec, time.monotonic() - t0)
        return exe


class PackagedHarness(Harness):
    """An adapter of a harness installed from a registry, or of a preinstalled executable.

    Subclasses set :attr:`package` (the pinned distribution), :attr:`binary_env` (the environment
    variable naming a preinstalled executable) and :attr:`title` (its name in errors).

    Args:
        version: version to install (default: ``package.version``).
        binary: a preinstalled executable (default ``$<binary_env>``, else the cache).
        **kwargs: :class:`~gyre.harness.Harness` options.
    """

    package: HarnessPackage
    binary_env: str = ""
    title: str = ""

    def __init__(self, *, version: str | None = None, binary: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        p = type(self).package
        self.package = HarnessPackage(p.kind, p.name, version or p.version, p.bin, p.slug)
        self.binary = binary or os.environ.get(self.binary_env)

    def executable(self) -> Path:
        """The preinstalled binary, else where the cache holds (or will hold) the package's."""
        return Path(self.binary) if self.binary else installed_bin(self.package)

    def ensure_installed(self) -> None:
        """Check the preinstalled binary exists, else install the package (:func:`ensure_package`)."""
        if self.binary:
            if not Path(self.binary).exists():
                raise HarnessUnavailable(f"{self.package.bin} binary not found: {self.binary}")
            return
        ensure_package(self.package)

    def installed_executable(self) -> Path:
        """:meth:`executable`; raises :class:`~gyre.harness.HarnessUnavailable` when it is missing."""
        exe = self.executable()
        if not exe.exists():
            raise HarnessUnavailable(f"{self.title} is not installed at {exe} (call ensure_installed())")
        return exe
