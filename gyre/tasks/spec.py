"""Task specs: the data of one query and its validation.

A task is plain data -- a mapping read from YAML or JSONL (:mod:`gyre.tasks.loader`) with an
``id``, an ``instruction``, an optional ``workspace`` (a directory, a git commit, inline
files), an ``evaluator`` spec, and optional ``timeout_s``, ``hidden`` paths and ``metadata``;
the fields are described in :class:`TaskSpec`.

:func:`validate_task` is the pure core: it takes one raw mapping and returns either a
:class:`TaskSpec` or the list of :class:`TaskProblem` found (every problem, not just the
first), each naming the task id and the field. Filesystem checks (``dir``/``git``/``hidden``
exist) are made against the task file's directory.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from gyre.sandbox.spec import Environment

__all__ = [
    "TASK_ID_RE",
    "TASK_FIELDS",
    "GitSource",
    "WorkspaceSpec",
    "TaskSpec",
    "TaskProblem",
    "validate_task",
]

#: Task ids name directories (workspaces, logs), so they use a safe alphabet.
TASK_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

#: Top-level fields of a task mapping; any other key is reported as a problem.
TASK_FIELDS = ("id", "instruction", "workspace", "evaluator", "timeout_s", "hidden", "metadata", "environment")
_ENVIRONMENT_FIELDS = ("image", "dockerfile", "rootfs")

_WORKSPACE_FIELDS = ("dir", "git", "files")
_GIT_FIELDS = ("repo", "commit")
_EVALUATOR_TYPES = ("executable", "judge", "composite")
_EXECUTABLE_FIELDS = ("type", "command", "scoring", "timeout_s", "env", "junit_skipped", "readonly_source", "name")
_JUDGE_FIELDS = ("type", "rubric", "model", "timeout_s", "max_turns", "max_tokens", "score_scale", "name",
                 "base_url")
_COMPOSITE_FIELDS = ("type", "components", "name")
_BUILTIN_RULES = ("junit", "fraction_passed", "exit_code", "stdout_score")
_COMMIT_RE = re.compile(r"^[0-9a-fA-F]{4,64}$")


@dataclass(slots=True, frozen=True)
class TaskProblem:
    """One problem found in a task file.

    * ``source`` -- ``path:line`` (or ``path`` when the line is unknown);
    * ``task_id`` -- the task's id, or ``None`` when it has none (then ``index`` says which);
    * ``field`` -- dotted field name (``evaluator.command``, ``workspace.files.a/b.py``), or
      ``""`` for a problem with the file itself;
    * ``message`` -- what is wrong.
    """

    source: str
    task_id: str | None
    field: str
    message: str
    index: int | None = None

    def __str__(self) -> str:
        """One line (control characters in names and messages are escaped)."""
        if self.task_id is not None:
            who = f"task {self.task_id!r}"
        elif self.index is not None:
            who = f"task #{self.index + 1}"
        else:
            who = "file"
        where = f" field '{_one_line(self.field)}'" if self.field else ""
        return f"{_one_line(self.source)}: {who}{where}: {_one_line(self.message)}"


def _one_line(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


@dataclass(slots=True, frozen=True)
class GitSource:
    """A local git repository and the commit to check out (``repo`` is absolute)."""

    repo: Path
    commit: str


@dataclass(slots=True, frozen=True)
class WorkspaceSpec:
    """How a task's workspace is created: a copied directory *or* a git checkout (or
    nothing), then ``files`` (relative POSIX path -> text) written on top."""

    dir: Path | None = None
    git: GitSource | None = None
    files: tuple[tuple[str, str], ...] = ()


@dataclass(slots=True, frozen=True)
class TaskSpec:
    """One validated task. The raw mapping it is made from::

        id: fix-median                       # [A-Za-z0-9][A-Za-z0-9._-]{0,127}, unique in a task set
        instruction: "The median of ..."     # what the harness is told (non-empty)
        workspace:                           # optional; an empty directory when absent
          dir: repo                          #   copy this directory (relative to the task file) ...
          git: {repo: path, commit: 3f2a..}  #   ... or check out this commit of a local git repository
          files: {path/in/ws.py: "text"}     #   inline files written on top (overrides)
        evaluator:                           # gyre.evaluation.evaluator_from_spec's spec
          type: executable                   #   executable | judge | composite
          command: ["{python}", "-m", "pytest", "-q", "--junitxml={junit_xml}", "{task_dir}/hidden_tests"]
          scoring: junit                     #   junit | exit_code | stdout_score | pkg.mod:fn
        timeout_s: 300                       # optional execution budget (s); default --execution-timeout-s
        hidden: [hidden_tests]               # optional paths (relative to the task file) the harness must
                                             #   never see (evaluator-only tests, solutions)
        metadata: {difficulty: easy}         # optional, free-form; passed to the evaluator target
        environment: {image: "localhost/gyre-test:bookworm"}
                                             # optional: where the harness and the evaluator's commands
                                             #   run: host (default: the machine's root, read-only),
                                             #   {image: name}, {dockerfile: path} (built offline) or
                                             #   {rootfs: directory}; paths relative to the task file

    ``{task_dir}`` in evaluator commands and ``env`` values is replaced at load time by the
    absolute directory of the task file (shell-quoted inside a shell-string command); the
    evaluator's own placeholders (``{python}``, ``{junit_xml}``, ``{workspace}``,
    ``{eval_dir}``) are left for :class:`~gyre.evaluation.ExecutableCheck`.

    Fields:

    * ``evaluator`` -- the evaluator spec with ``{task_dir}`` substituted, ready for
      :func:`gyre.evaluation.evaluator_from_spec` (see :meth:`build_evaluator`);
    * ``timeout_s`` -- execution budget in seconds, ``None`` for the run's default;
    * ``hidden`` -- absolute paths the harness must not see;
    * ``environment`` -- the :class:`~gyre.sandbox.spec.Environment` its commands run in (``None``:
      the task names none; the run's ``--task-environment`` applies, by default the host's root);
    * ``source`` -- ``path:line`` the task came from; ``task_dir`` -- its file's directory.
    """

    id: str
    instruction: str
    workspace: WorkspaceSpec
    evaluator: dict[str, Any]
    timeout_s: float | None = None
    hidden: tuple[Path, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    task_dir: Path = Path(".")
    environment: Environment | None = None

    def build_evaluator(self, **kwargs: Any):
        """The task's designated evaluator: :func:`gyre.evaluation.evaluator_from_spec` on
        :attr:`evaluator` (``kwargs``: ``default_rule``, ``default_timeout_s``,
        ``judge_base_url``, ``judge_model``, ``judge_api_key``, ``eval_root``).

        Raises:
            ValueError: from ``evaluator_from_spec`` (e.g. a judge without ``judge_base_url``).
        """
        from gyre.evaluation import evaluator_from_spec

        return evaluator_from_spec(self.evaluator, **kwargs)


# --------------------------------------------------------------------------- validation


class _Collector:
    def __init__(self, source: str, task_id: str | None, index: int | None) -> None:
        self.source, self.task_id, self.index = source, task_id, index
        self.problems: list[TaskProblem] = []

    def add(self, field_name: str, message: str) -> None:
        self.problems.append(TaskProblem(self.source, self.task_id, field_name, message, self.index))


def _type_name(v: Any) -> str:
    return {dict: "mapping", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), type(v).__name__)


def _positive_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and v != float("inf")


def _is_path_text(p: Any) -> bool:
    """Whether ``p`` can name a file at all: a non-empty string without NUL (the OS refuses NUL)."""
    return isinstance(p, str) and bool(p) and "\0" not in p


def _safe_relpath(p: str) -> str | None:
    """Why ``p`` is not a safe relative POSIX path inside a workspace, or ``None``."""
    if not p or p.strip() != p:
        return "must be a non-empty path without surrounding spaces"
    if "\\" in p or "\0" in p:
        return "must be a POSIX path (no backslashes or NUL)"
    pp = PurePosixPath(p)
    if pp.is_absolute():
        return "must be relative to the workspace"
    if any(part == ".." for part in pp.parts):
        return "must not contain '..'"
    if pp.parts and pp.parts[0] == ".git":
        return "must not write inside .git"
    return None


def _subst_task_dir(value: Any, task_dir: Path, shell: bool) -> Any:
    text = shlex.quote(str(task_dir)) if shell else str(task_dir)
    return value.replace("{task_dir}", text) if isinstance(value, str) else value


def _check_evaluator(spec: Any, where: str, c: _Collector, task_dir: Path, check_imports: bool) -> dict | None:
    """Validate an evaluator spec; return it with ``{task_dir}`` substituted (or None)."""
    if not isinstance(spec, Mapping):
        c.add(where, f"must be a mapping, got {_type_name(spec)}")
        return None
    kind = spec.get("type")
    if kind not in _EVALUATOR_TYPES:
        c.add(f"{where}.type", f"must be one of {', '.join(_EVALUATOR_TYPES)}, got {kind!r}")
        return None
    out = dict(spec)
    allowed = {"executable": _EXECUTABLE_FIELDS, "judge": _JUDGE_FIELDS, "composite": _COMPOSITE_FIELDS}[kind]
    for key in spec:
        if key not in allowed:
            c.add(f"{where}.{key}", f"unknown field for a {kind} evaluator (allowed: {', '.join(allowed)})")
    if "timeout_s" in spec and not _positive_number(spec["timeout_s"]):
        c.add(f"{where}.timeout_s", f"must be a number > 0, got {spec['timeout_s']!r}")
    if "name" in spec and not (isinstance(spec["name"], str) and spec["name"]):
        c.add(f"{where}.name", "must be a non-empty string")
    if kind == "executable":
        _check_executable(spec, where, c, task_dir, check_imports, out)
    elif kind == "judge":
        _check_judge(spec, where, c)
    else:  # composite
        _check_composite(spec, where, c, task_dir, check_imports, out)
    return out


def _check_executable(spec: Mapping, where: str, c: _Collector, task_dir: Path, check_imports: bool,
                      out: dict) -> None:
    """The fields of an ``executable`` evaluator: its command and env (``{task_dir}`` substituted
    into ``out``), junit and read-only-source options, and its scoring rule (importable when
    ``check_imports``)."""
    cmd = spec.get("command")
    if cmd is None:
        c.add(f"{where}.command", "missing (a shell string or a list of arguments)")
    elif isinstance(cmd, str):
        if not cmd.strip():
            c.add(f"{where}.command", "must not be empty")
        out["command"] = _subst_task_dir(cmd, task_dir, shell=True)
    elif isinstance(cmd, list):
        if not cmd or not all(isinstance(a, str) for a in cmd):
            c.add(f"{where}.command", "must be a non-empty list of strings")
        else:
            out["command"] = [_subst_task_dir(a, task_dir, shell=False) for a in cmd]
    else:
        c.add(f"{where}.command", f"must be a string or a list of strings, got {_type_name(cmd)}")
    env = spec.get("env")
    if env is not None:
        if not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, (str, int, float))
                                                  and not isinstance(v, bool) for k, v in env.items()):
            c.add(f"{where}.env", "must be a mapping of names to strings")
        else:
            out["env"] = {k: _subst_task_dir(str(v), task_dir, shell=False) for k, v in env.items()}
    if "junit_skipped" in spec and spec["junit_skipped"] not in ("fail", "exclude"):
        c.add(f"{where}.junit_skipped", f"must be fail or exclude, got {spec['junit_skipped']!r}")
    if "readonly_source" in spec and spec["readonly_source"] not in ("auto", "require", "off"):
        c.add(f"{where}.readonly_source", f"must be auto, require or off, got {spec['readonly_source']!r}")
    scoring = spec.get("scoring")
    if scoring is not None:
        if not isinstance(scoring, str) or not scoring.strip():
            c.add(f"{where}.scoring", "must be junit, exit_code, stdout_score or a dotted path 'pkg.mod:fn'")
        elif scoring not in _BUILTIN_RULES and check_imports:
            from gyre.evaluation import load_callable

            try:
                load_callable(scoring)
            except Exception as exc:  # any import failure is the task's problem
                c.add(f"{where}.scoring", f"cannot load {scoring!r}: {type(exc).__name__}: {exc}")


def _check_judge(spec: Mapping, where: str, c: _Collector) -> None:
    """The fields of a ``judge`` evaluator: rubric, turn and token limits, model, URL, score scale."""
    rubric = spec.get("rubric")
    if not isinstance(rubric, str) or not rubric.strip():
        c.add(f"{where}.rubric", "missing or empty (the judge's rubric text)")
    for key in ("max_turns", "max_tokens"):
        if key in spec and not (isinstance(spec[key], int) and not isinstance(spec[key], bool) and spec[key] > 0):
            c.add(f"{where}.{key}", f"must be an integer > 0, got {spec[key]!r}")
    if "model" in spec and not (isinstance(spec["model"], str) and spec["model"].strip()):
        c.add(f"{where}.model", f"must be a non-empty string, got {spec['model']!r}")
    if "base_url" in spec and not (isinstance(spec["base_url"], str)
                                   and spec["base_url"].startswith(("http://", "https://"))):
        c.add(f"{where}.base_url", f"must be an http(s) URL, got {spec['base_url']!r}")
    if "score_scale" in spec and not _positive_number(spec["score_scale"]):
        c.add(f"{where}.score_scale", f"must be a number > 0, got {spec['score_scale']!r}")


def _check_composite(spec: Mapping, where: str, c: _Collector, task_dir: Path, check_imports: bool,
                     out: dict) -> None:
    """The components of a ``composite`` evaluator, each checked as an evaluator with its weight
    (into ``out["components"]``)."""
    comps = spec.get("components")
    if not isinstance(comps, list) or not comps:
        c.add(f"{where}.components", "must be a non-empty list of evaluator specs with weights")
    else:
        built = []
        for i, comp in enumerate(comps):
            cw = f"{where}.components.{i}"
            if isinstance(comp, Mapping) and "weight" in comp and not (
                    isinstance(comp["weight"], (int, float)) and not isinstance(comp["weight"], bool)
                    and 0 < comp["weight"] < float("inf")):
                c.add(f"{cw}.weight", f"must be a number > 0, got {comp['weight']!r}")
            inner = {k: v for k, v in comp.items() if k != "weight"} if isinstance(comp, Mapping) else comp
            sub = _check_evaluator(inner, cw, c, task_dir, check_imports)
            if sub is not None and isinstance(comp, Mapping) and "weight" in comp:
                sub["weight"] = comp["weight"]
            built.append(sub)
        out["components"] = built


def _check_workspace(ws: Any, c: _Collector, task_dir: Path) -> WorkspaceSpec | None:
    if ws is None:
        return WorkspaceSpec()
    if not isinstance(ws, Mapping):
        c.add("workspace", f"must be a mapping with dir, git and/or files, got {_type_name(ws)}")
        return None
    for key in ws:
        if key not in _WORKSPACE_FIELDS:
            c.add(f"workspace.{key}", f"unknown field (allowed: {', '.join(_WORKSPACE_FIELDS)})")
    ok = True
    src_dir: Path | None = None
    git: GitSource | None = None
    if "dir" in ws and "git" in ws:
        c.add("workspace", "give either 'dir' or 'git', not both")
        ok = False
    if "dir" in ws:
        d = ws["dir"]
        if not _is_path_text(d):
            c.add("workspace.dir", "must be a path (relative to the task file)")
            ok = False
        else:
            src_dir = (task_dir / d).resolve()
            if not src_dir.is_dir():
                c.add("workspace.dir", f"not a directory: {src_dir}")
                ok = False
    if "git" in ws:
        g = ws["git"]
        if not isinstance(g, Mapping):
            c.add("workspace.git", "must be a mapping {repo: path, commit: sha}")
            ok = False
        else:
            for key in g:
                if key not in _GIT_FIELDS:
                    c.add(f"workspace.git.{key}", "unknown field (allowed: repo, commit)")
            repo, commit = g.get("repo"), g.get("commit")
            if not _is_path_text(repo):
                c.add("workspace.git.repo", "missing (path of a local git repository)")
                ok = False
            elif not (task_dir / repo).resolve().exists():
                c.add("workspace.git.repo", f"not found: {(task_dir / repo).resolve()}")
                ok = False
            if not isinstance(commit, str) or not _COMMIT_RE.match(commit):
                c.add("workspace.git.commit", f"must be a commit id (4-64 hex digits), got {commit!r}")
                ok = False
            if ok:
                git = GitSource((task_dir / repo).resolve(), commit)
    files: list[tuple[str, str]] = []
    if "files" in ws:
        fs = ws["files"]
        if not isinstance(fs, Mapping):
            c.add("workspace.files", f"must be a mapping of relative paths to text, got {_type_name(fs)}")
            ok = False
        else:
            for p, text in fs.items():
                why = _safe_relpath(p) if isinstance(p, str) else "must be a string"
                if why:
                    c.add(f"workspace.files.{p}", f"path {why}")
                    ok = False
                elif not isinstance(text, str):
                    c.add(f"workspace.files.{p}", f"content must be text, got {_type_name(text)}")
                    ok = False
                else:
                    files.append((str(PurePosixPath(p)), text))
    return WorkspaceSpec(src_dir, git, tuple(files)) if ok else None


def _check_environment(env: Any, c: _Collector, task_dir: Path) -> Environment | None:
    if env == "host":
        return Environment()
    if not isinstance(env, Mapping) or len(env) != 1 or next(iter(env)) not in _ENVIRONMENT_FIELDS:
        c.add("environment", "must be 'host' or a mapping with one of image, dockerfile, rootfs, got "
                             f"{env!r}"[:200])
        return None
    kind, ref = next(iter(env.items()))
    if not isinstance(ref, str) or not ref.strip() or "\0" in ref:
        c.add(f"environment.{kind}", "must be a non-empty string without NUL")
        return None
    if kind == "image":
        return Environment("image", ref.strip())
    path = (task_dir / ref).resolve()
    if kind == "dockerfile" and not path.is_file():
        c.add("environment.dockerfile", f"not a file: {path}")
        return None
    if kind == "rootfs" and not path.is_dir():
        c.add("environment.rootfs", f"not a directory: {path}")
        return None
    return Environment(kind, str(path))


def validate_task(raw: Any, *, source: str, task_dir: str | os.PathLike[str], index: int | None = None,
                  check_imports: bool = True) -> TaskSpec | list[TaskProblem]:
    """Validate one raw task mapping (the format is in :class:`TaskSpec`); pure apart from the filesystem
    existence checks of ``workspace.dir``, ``workspace.git.repo`` and ``hidden``, and the
    import of a dotted-path scoring rule (``check_imports``).

    Args:
        raw: the mapping as parsed from YAML/JSON.
        source: ``path:line`` used in problems and kept on the spec.
        task_dir: directory relative paths are resolved against (the task file's).
        index: position of the task in its file (names tasks without a usable id).

    Returns:
        the :class:`TaskSpec`, or every :class:`TaskProblem` found (never raises for bad data).
    """
    task_dir = Path(task_dir).resolve()
    if not isinstance(raw, Mapping):
        return [TaskProblem(source, None, "", f"a task must be a mapping, got {_type_name(raw)}", index)]
    tid = raw.get("id")
    c = _Collector(source, tid if isinstance(tid, str) and TASK_ID_RE.match(tid) else None, index)
    if tid is None:
        c.add("id", "missing")
    elif not isinstance(tid, str) or not TASK_ID_RE.match(tid):
        c.add("id", f"must match {TASK_ID_RE.pattern}, got {tid!r}")
    for key in raw:
        if key not in TASK_FIELDS:
            c.add(str(key), f"unknown field (allowed: {', '.join(TASK_FIELDS)})")
    instr = raw.get("instruction")
    if instr is None:
        c.add("instruction", "missing")
    elif not isinstance(instr, str) or not instr.strip():
        c.add("instruction", "must be a non-empty string")
    ws = _check_workspace(raw.get("workspace"), c, task_dir)
    evaluator = None
    if "evaluator" not in raw:
        c.add("evaluator", "missing (every task needs a way to be scored)")
    else:
        evaluator = _check_evaluator(raw["evaluator"], "evaluator", c, task_dir, check_imports)
    timeout = raw.get("timeout_s")
    if timeout is not None and not _positive_number(timeout):
        c.add("timeout_s", f"must be a number of seconds > 0, got {timeout!r}")
    hidden: list[Path] = []
    h = raw.get("hidden", [])
    if isinstance(h, str):
        h = [h]
    if not isinstance(h, list) or not all(_is_path_text(p) for p in h):
        c.add("hidden", "must be a list of paths (relative to the task file)")
    else:
        for p in h:
            full = (task_dir / p).resolve()
            if not full.exists():
                c.add("hidden", f"not found: {full}")
            else:
                hidden.append(full)
    environment = None if raw.get("environment") is None else _check_environment(raw["environment"], c, task_dir)
    meta = raw.get("metadata", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, Mapping):
        c.add("metadata", f"must be a mapping, got {_type_name(meta)}")
    if c.problems:
        return c.problems
    assert ws is not None and evaluator is not None and isinstance(tid, str) and isinstance(instr, str)
    return TaskSpec(
        id=tid, instruction=instr, workspace=ws, evaluator=evaluator,
        timeout_s=float(timeout) if timeout is not None else None,
        hidden=tuple(dict.fromkeys(hidden)), metadata=dict(meta), source=source, task_dir=task_dir,
        environment=environment,
    )

