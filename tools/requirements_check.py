"""Whether this interpreter's environment holds what requirement files ask for, markers evaluated
for its own Python (``tools/setup_sglang.sh`` uses it to decide that an SGLang environment can be
reused as it is).

    python tools/requirements_check.py requirements-sglang-env.txt [--also 'sglang==0.5.23' ...]

Exit status 0 when every requirement that applies to this Python is installed at a version it
allows; otherwise 1, with one line per requirement not met.  Only plain requirement lines are
read (comments and blank lines skipped); ``-r`` and other pip options are refused.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import platform
import sys
from pathlib import Path
from typing import Iterable, Mapping

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def parse(text: str) -> list[Requirement]:
    """The requirements of a requirements file's text.

    Raises:
        ValueError: a pip option (``-r``, ``--index-url``, ...) or a line ``packaging`` cannot parse.
    """
    out = []
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            raise ValueError(f"pip options are not read here: {line!r}")
        out.append(Requirement(line))
    return out


def applicable(requirements: Iterable[Requirement], python_version: str) -> list[Requirement]:
    """Those of ``requirements`` whose marker holds for ``python_version`` (``"3.11"``; the other
    marker variables are this machine's)."""
    env = {"python_version": python_version, "python_full_version": f"{python_version}.0"}
    return [r for r in requirements if r.marker is None or r.marker.evaluate(env)]


def unmet(requirements: Iterable[Requirement], installed: Mapping[str, str]) -> list[str]:
    """Each requirement that ``installed`` (canonical name -> version) does not satisfy, as a line."""
    out = []
    for r in requirements:
        version = installed.get(canonicalize_name(r.name))
        if version is None:
            out.append(f"{r}: not installed")
        elif not r.specifier.contains(version, prereleases=True):
            out.append(f"{r}: {version} installed")
    return out


def installed_distributions() -> dict[str, str]:
    """Canonical name -> version of every distribution this interpreter sees."""
    return {canonicalize_name(d.metadata["Name"]): d.version for d in md.distributions() if d.metadata["Name"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path, help="requirement files")
    ap.add_argument("--also", action="append", default=[], help="one more requirement (repeatable)")
    a = ap.parse_args(argv)
    reqs = [r for f in a.files for r in parse(f.read_text())] + [Requirement(x) for x in a.also]
    missing = unmet(applicable(reqs, ".".join(platform.python_version_tuple()[:2])), installed_distributions())
    for line in missing:
        print(line, file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
