"""Every path, Python name and flag that a page under docs/ names exists.

Names are read from inline code spans and fenced code blocks: repository paths must exist,
dotted ``gyre.`` names must import (module, then attributes), and a ``--flag`` must appear in the
``--help`` of the script named last before it (``pretrain_gyre.py`` when none); ``-m gyre.x`` counts
as a script (``python -m gyre.x --help``), while the flags of other programs (``-m`` of another
package, ``claude``, ``codex``, ``mini``, ``curl``, ``bwrap``, ``podman``, ``docker``, ``mmdebstrap``,
``ray``, ``kubectl``, ``srun``)
are not checked.

Each package's docstring (``gyre/<package>/__init__.py``) is its map: it names every module of the
package (dotted, ``:mod:`` or ``name.py``), and every module it names exists.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
TOP_DIRS = ("gyre", "tools", "bench", "examples", "tests", "docs", "megatron_patches")
ROOT_FILE = re.compile(r"^[\w.-]+\.(py|md|txt|yaml|sh|toml|jsonl)$")
DOTTED = re.compile(r"^gyre(\.\w+)+$")
FLAG = re.compile(r"^--[a-z][a-z0-9-]*$")
#: Programs that are not Gyre's: their flags are not checked.
EXTERNAL = frozenset({"claude", "codex", "mini", "curl", "bwrap", "podman", "docker", "mmdebstrap", "ray", "kubectl",
                      "srun"})


def snippets(text: str) -> list[str]:
    """Inline code spans and the lines of fenced code blocks, in document order."""
    out: list[str] = []
    for m in re.finditer(r"```[^\n]*\n(.*?)```|`([^`\n]+)`", text, flags=re.S):
        if m.group(1) is not None:
            out += [line.split("#")[0] for line in m.group(1).splitlines()]
        else:
            out.append(m.group(2))
    return out


def tokens(snippet: str) -> list[str]:
    return [t.strip(".,;:()[]'\"") for t in snippet.split()]


def is_path(tok: str) -> bool:
    if any(c in tok for c in "<>*{}$"):
        return False
    return tok.split("/")[0] in TOP_DIRS and "/" in tok or (("/" not in tok) and bool(ROOT_FILE.match(tok))
                                                          and (ROOT / tok).exists() or tok in ("pretrain_gyre.py",))


@functools.lru_cache(maxsize=None)
def help_text(script: str) -> str:
    cmd = ["-m", script[3:]] if script.startswith("-m ") else [str(ROOT / script)]
    proc = subprocess.run([sys.executable, *cmd, "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, f"{script} --help failed: {proc.stderr[-2000:]}"
    return proc.stdout


def resolve(name: str) -> object:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def named(doc: Path) -> tuple[set[str], set[str], set[tuple[str, str]]]:
    """Paths, dotted names and ``(script, flag)`` pairs named in ``doc``.  A flag belongs to the
    script named last before it (in its span, else earlier in the page; ``pretrain_gyre.py`` when
    none); flags before a script in the same span (a launcher's, e.g. torchrun's) are skipped, and
    so are flags after another program (:data:`EXTERNAL`, ``-m`` of a non-Gyre module)."""
    paths, names, flags = set(), set(), set()
    last = "pretrain_gyre.py"
    for snip in snippets(doc.read_text()):
        toks = tokens(snip)
        cmds: dict[int, str | None] = {}  # token index -> script (None: a program whose flags are not checked)
        for i, t in enumerate(toks):
            if t.endswith(".py") and is_path(t) and (t.startswith(("tools/", "bench/"))
                                                     or t in ("pretrain_gyre.py", "tests/gpu/gpu_check.py")):
                cmds[i] = t
            elif t.endswith(".sbatch"):  # a Slurm script: its options are tested with it
                cmds[i] = None
            elif t == "-m" and i + 1 < len(toks):
                cmds[i] = f"-m {toks[i + 1]}" if DOTTED.match(toks[i + 1]) else None
            elif t in EXTERNAL:
                cmds[i] = None
        scripts = sorted(cmds)
        for i, tok in enumerate(toks):
            if FLAG.match(tok):
                before = [cmds[j] for j in scripts if j < i]
                if before:
                    if before[-1] is not None:
                        flags.add((before[-1], tok))
                elif not scripts:
                    flags.add((last, tok))
            elif DOTTED.match(tok):
                names.add(tok)
            elif is_path(tok):
                paths.add(tok)
        checked = [cmds[j] for j in scripts if cmds[j] is not None]
        if checked:
            last = checked[-1]
    return paths, names, flags


def test_docs_exist():
    assert {p.name for p in DOCS} >= {"architecture.md", "backends.md", "proxy.md", "simulator.md"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_named_path_exists(doc):
    paths, _, _ = named(doc)
    assert paths, f"{doc.name} names no path"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_named_python_object_exists(doc):
    _, names, _ = named(doc)
    missing = []
    for name in sorted(names):
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name} ({exc})")
    assert not missing, f"{doc.name} names objects that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_named_flag_is_in_its_commands_help(doc):
    _, _, flags = named(doc)
    missing = sorted(f"{script} {flag}" for script, flag in flags if flag not in help_text(script))
    assert not missing, f"{doc.name} names flags its command does not have: {missing}"


def test_the_checker_catches_what_does_not_exist(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("Run `tools/simulate.py --no-such-flag` on `gyre/no_such.py`; see `gyre.runtime.pipeline.nope`.\n"
                   "```\ntorchrun --nproc-per-node 3 pretrain_gyre.py --train-steps 3\n```\nthen `--load`.\n")
    paths, names, flags = named(doc)
    assert paths == {"tools/simulate.py", "gyre/no_such.py", "pretrain_gyre.py"}
    assert names == {"gyre.runtime.pipeline.nope"}
    assert flags == {("tools/simulate.py", "--no-such-flag"), ("pretrain_gyre.py", "--train-steps"),
                     ("pretrain_gyre.py", "--load")}
    assert "--no-such-flag" not in help_text("tools/simulate.py")
    with pytest.raises(AttributeError):
        resolve("gyre.runtime.pipeline.nope")
    assert resolve("gyre.runtime.pipeline.run_execution").__name__ == "run_execution"


def test_the_checker_knows_modules_and_other_programs(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("```\nK=1 python -m gyre.harness.reference_agent --base-url U\n    --max-turns 2\n"
                   "python -m sglang.launch_server --model-path M\nclaude -p x --output-format json\n```\n"
                   "`tools/simulate.py --help`, then `--no-such-flag`.\n")
    _, names, flags = named(doc)
    assert "gyre.harness.reference_agent" in names
    assert flags == {("-m gyre.harness.reference_agent", "--base-url"), ("-m gyre.harness.reference_agent", "--max-turns"),
                     ("tools/simulate.py", "--help"), ("tools/simulate.py", "--no-such-flag")}
    assert "--base-url" in help_text("-m gyre.harness.reference_agent")


PACKAGES = sorted(p.parent for p in (ROOT / "gyre").rglob("*/__init__.py"))
#: Packages whose maps are being rewritten with their modules' move into subpackages.
MAPS_IN_PROGRESS: dict[str, str] = {}
MAP_NAME = re.compile(r"\bgyre(?:\.\w+)+|\b[\w/]+\.py\b")


def package_map(pkg: Path) -> tuple[set[str], set[str]]:
    """The package's modules (files and subpackages, ``__main__`` aside) and the names its map
    gives: dotted ``gyre.`` names and ``*.py`` file names."""
    modules = {p.stem for p in pkg.glob("*.py") if p.stem not in ("__init__", "__main__")}
    modules |= {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()}
    doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text())) or ""
    return modules, set(MAP_NAME.findall(doc))


def map_problems(pkg: Path) -> list[str]:
    """Modules the map leaves out, and names in it that do not exist."""
    dotted = ".".join(pkg.relative_to(ROOT).parts)
    modules, names = package_map(pkg)
    problems = []
    for m in sorted(modules):
        if not any(n == f"{dotted}.{m}" or n.startswith(f"{dotted}.{m}.") or n.split("/")[-1] == f"{m}.py"
                   for n in names):
            problems.append(f"{dotted}.{m} is not in the map")
    for n in sorted(names):
        if n.endswith(".py"):
            if not ((ROOT / n).is_file() or (pkg / n).is_file()):
                problems.append(f"{n} does not exist")
        elif not (ROOT.joinpath(*n.split(".")).with_suffix(".py").is_file()
                  or ROOT.joinpath(*n.split("."), "__init__.py").is_file()):
            try:
                resolve(n)
            except (ImportError, AttributeError):
                problems.append(f"{n} does not exist")
    return problems


def _map_param(pkg: Path):
    dotted = ".".join(pkg.relative_to(ROOT).parts)
    reason = MAPS_IN_PROGRESS.get(dotted)
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(pkg, id=dotted, marks=marks)


@pytest.mark.parametrize("pkg", [_map_param(p) for p in PACKAGES])
def test_every_package_map_names_its_modules_and_nothing_else(pkg):
    assert map_problems(pkg) == []


def test_the_map_checker_catches_a_missing_module_and_a_stale_name(tmp_path, monkeypatch):
    pkg = tmp_path / "gyre" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Map: :mod:`gyre.demo.kept`, ``gone.py`` and :mod:`gyre.demo.stale`."""\n')
    (pkg / "kept.py").write_text("")
    (pkg / "left_out.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert map_problems(pkg) == ["gyre.demo.left_out is not in the map", "gone.py does not exist",
                                 "gyre.demo.stale does not exist"]
