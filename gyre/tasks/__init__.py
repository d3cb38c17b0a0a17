"""Task spec loading (JSONL/YAML) and workspace materialisation.

Usage by the main job::

    result = load_tasks(args.tasks)          # TaskLoadError only when the path is missing
    result.log_problems()                    # one line per problem; bad tasks skipped and counted
    task = result.tasks[0]                   # TaskSpec
    evaluator = task.build_evaluator(default_rule=args.custom_rm_path, ...)

``python -m gyre.tasks PATH...`` checks task files and prints one line per problem.
Spec format: :mod:`gyre.tasks.spec`; file shapes: :mod:`gyre.tasks.loader`; workspaces:
:mod:`gyre.tasks.workspace`; the scoring rules of the example task sets: :mod:`gyre.tasks.rules`; a
generated task family with a seeded held-out split (small sums): :mod:`gyre.tasks.arithmetic`.
"""

from gyre.tasks.loader import TASK_FILE_SUFFIXES, TaskLoadError, TaskLoadResult, find_task_files, load_tasks
from gyre.tasks.spec import TASK_FIELDS, TASK_ID_RE, GitSource, TaskProblem, TaskSpec, WorkspaceSpec, validate_task
from gyre.tasks.workspace import WorkspaceError, materialize_workspace

__all__ = [
    "GitSource",
    "TASK_FIELDS",
    "TASK_FILE_SUFFIXES",
    "TASK_ID_RE",
    "TaskLoadError",
    "TaskLoadResult",
    "TaskProblem",
    "TaskSpec",
    "WorkspaceError",
    "WorkspaceSpec",
    "find_task_files",
    "load_tasks",
    "materialize_workspace",
    "validate_task",
]
