"""Load task sets from JSONL / YAML / JSON files or directories, validating every task.

A bad task never crashes a run: :func:`load_tasks` validates each entry
(:func:`~gyre.tasks.spec.validate_task`), keeps the good ones, and returns every problem as a
:class:`~gyre.tasks.spec.TaskProblem` (file and line, task id, field, what is wrong) with the
number of entries skipped. Only a missing path is an error.

File shapes:

* ``*.jsonl`` -- one task mapping per line (blank lines and lines starting with ``#`` skipped);
* ``*.yaml`` / ``*.yml`` / ``*.json`` -- a list of tasks, a single task mapping, or
  ``{defaults: {...}, tasks: [...]}`` where ``defaults`` supplies fields a task does not set
  (``metadata`` mappings are merged, other fields are replaced by the task's own);
* a directory -- the task files below it (:func:`find_task_files`).

A task's source, and so its problems', is ``path:line`` (the line where the task starts;
``path[i]`` when a line cannot be told); a problem with the whole file names the path alone.

Task ids are unique across everything loaded by one call: a later duplicate is skipped.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gyre.tasks.spec import TASK_FIELDS, TaskProblem, TaskSpec, validate_task

__all__ = ["TaskLoadError", "TaskLoadResult", "load_tasks", "find_task_files", "TASK_FILE_SUFFIXES"]

logger = logging.getLogger(__name__)

TASK_FILE_SUFFIXES = (".jsonl", ".yaml", ".yml", ".json")


class TaskLoadError(Exception):
    """The task path does not exist or holds no task file (a configuration error; the
    message is one line naming the path)."""


@dataclass(slots=True)
class TaskLoadResult:
    """What :func:`load_tasks` found.

    * ``tasks`` -- valid tasks in file order;
    * ``problems`` -- every problem (``str(problem)`` is its one-line report);
    * ``skipped`` -- task entries not loaded (a file that could not be parsed counts as one);
    * ``files`` -- the task files read.
    """

    tasks: list[TaskSpec] = field(default_factory=list)
    problems: list[TaskProblem] = field(default_factory=list)
    skipped: int = 0
    files: list[Path] = field(default_factory=list)

    def by_id(self) -> dict[str, TaskSpec]:
        return {t.id: t for t in self.tasks}

    def log_problems(self, log: logging.Logger | None = None) -> None:
        """Log each problem as one WARNING line, then a summary line."""
        log = log or logger
        for p in self.problems:
            log.warning("%s", p)
        if self.problems:
            log.warning("tasks: %d loaded, %d skipped, %d problems", len(self.tasks), self.skipped,
                        len(self.problems))


def find_task_files(root: str | os.PathLike[str]) -> list[Path]:
    """Task files under a directory, sorted: every file named ``tasks.<ext>`` or
    ``<name>.tasks.<ext>`` below it (``ext`` one of ``jsonl``/``yaml``/``yml``/``json``), in
    sorted path order; dot-directories are skipped."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for name in sorted(filenames):
            stem, ext = os.path.splitext(name)
            if ext in TASK_FILE_SUFFIXES and (stem == "tasks" or stem.endswith(".tasks")):
                out.append(Path(dirpath) / name)
    return sorted(out)


def _yaml_item_lines(text: str) -> tuple[dict[int, int], int | None]:
    """1-based line of each task item (by index) in a YAML document, and of the document."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}, None
    if node is None:
        return {}, None
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode) and k.value == "tasks" and isinstance(v, yaml.SequenceNode):
                return {i: n.start_mark.line + 1 for i, n in enumerate(v.value)}, node.start_mark.line + 1
        return {0: node.start_mark.line + 1}, node.start_mark.line + 1
    if isinstance(node, yaml.SequenceNode):
        return {i: n.start_mark.line + 1 for i, n in enumerate(node.value)}, node.start_mark.line + 1
    return {}, node.start_mark.line + 1


def _apply_defaults(raw: Any, defaults: Mapping[str, Any]) -> Any:
    if not isinstance(raw, Mapping) or not defaults:
        return raw
    merged = dict(defaults)
    for k, v in raw.items():
        if k == "metadata" and isinstance(v, Mapping) and isinstance(defaults.get("metadata"), Mapping):
            merged[k] = {**defaults["metadata"], **v}
        else:
            merged[k] = v
    return merged


def _entries(path: Path, res: TaskLoadResult) -> Iterable[tuple[Any, str, int]]:
    """Yield ``(raw task, source, index)`` of one file; file-level problems go to ``res``."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        res.problems.append(TaskProblem(str(path), None, "", f"cannot read: {exc}"))
        res.skipped += 1
        return
    if path.suffix == ".jsonl":
        index = 0
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                res.problems.append(TaskProblem(f"{path}:{lineno}", None, "", f"not valid JSON ({exc.msg} at column "
                                                                             f"{exc.colno})", index))
                res.skipped += 1
                index += 1
                continue
            yield raw, f"{path}:{lineno}", index
            index += 1
        return
    lines: dict[int, int] = {}
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            res.problems.append(TaskProblem(f"{path}:{exc.lineno}", None, "", f"not valid JSON ({exc.msg})"))
            res.skipped += 1
            return
        lines, _ = _yaml_item_lines(text)  # JSON is YAML: the same node marks give each task's line
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
            problem = getattr(exc, "problem", None) or "syntax error"
            res.problems.append(TaskProblem(where, None, "", f"not valid YAML ({problem})"))
            res.skipped += 1
            return
        lines, _ = _yaml_item_lines(text)
    if data is None:
        return
    defaults: Mapping[str, Any] = {}
    if isinstance(data, Mapping) and "tasks" in data:
        extra = [k for k in data if k not in ("tasks", "defaults")]
        if extra:
            res.problems.append(TaskProblem(str(path), None, "", f"unknown top-level keys {extra} "
                                                                 "(a task set has 'defaults' and 'tasks')"))
        defaults = data.get("defaults") or {}
        if not isinstance(defaults, Mapping):
            res.problems.append(TaskProblem(str(path), None, "defaults", "must be a mapping of task fields"))
            defaults = {}
        bad = [k for k in defaults if k not in TASK_FIELDS or k == "id"]
        if bad:
            res.problems.append(TaskProblem(str(path), None, "defaults", f"unknown or per-task fields {bad}"))
            defaults = {k: v for k, v in defaults.items() if k not in bad}
        items = data["tasks"]
        if not isinstance(items, list):
            res.problems.append(TaskProblem(str(path), None, "tasks", "must be a list of task mappings"))
            res.skipped += 1
            return
    elif isinstance(data, list):
        items = data
    else:
        items = [data]
    for i, raw in enumerate(items):
        line = lines.get(i)
        yield _apply_defaults(raw, defaults), f"{path}:{line}" if line else f"{path}[{i}]", i


def load_tasks(path: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], *,
               check_imports: bool = True) -> TaskLoadResult:
    """Load and validate every task under ``path`` (a file, a directory, or several of them).

    Args:
        check_imports: import dotted-path scoring rules to check them (a rule that cannot be
            imported is a problem of its task).

    Returns:
        :class:`TaskLoadResult` (valid tasks, problems, skipped count, files).

    Raises:
        TaskLoadError: a path does not exist, or a directory holds no task file.
    """
    paths = [Path(path)] if isinstance(path, (str, os.PathLike)) else [Path(p) for p in path]
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = find_task_files(p)
            if not found:
                raise TaskLoadError(f"no task files (tasks.jsonl, tasks.yaml, *.tasks.yaml ...) under {p}")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise TaskLoadError(f"task path not found: {p}")
    res = TaskLoadResult(files=files)
    first_seen: dict[str, str] = {}
    for f in files:
        task_dir = f.resolve().parent
        for raw, source, index in _entries(f, res):
            spec = validate_task(raw, source=source, task_dir=task_dir, index=index, check_imports=check_imports)
            if isinstance(spec, list):
                res.problems.extend(spec)
                res.skipped += 1
                continue
            if spec.id in first_seen:
                res.problems.append(TaskProblem(source, spec.id, "id", f"duplicate id (first defined at "
                                                                       f"{first_seen[spec.id]}); skipped"))
                res.skipped += 1
                continue
            first_seen[spec.id] = source
            res.tasks.append(spec)
    return res
