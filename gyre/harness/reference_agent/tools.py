"""The reference agent's tools: shell and file tools working in the workspace, and the
sub-agent delegation tool's schema (the agent runs delegation itself).

Every tool returns text for a ``tool`` message; a bad call (unknown tool, bad arguments,
missing file) returns an ``error: ...`` text the model can react to, never raises.
Relative paths are resolved against the workspace; this is not a sandbox (the harness
launcher's isolation is).
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TOOL_SCHEMAS", "ALL_TOOLS", "Toolbox", "truncate"]

ALL_TOOLS = ("bash", "read_file", "write_file", "edit_file", "delegate")


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


#: OpenAI function schemas by tool name.
TOOL_SCHEMAS: dict[str, dict[str, Any]] = {
    "bash": _fn("bash", "Run a bash command in the workspace; returns its exit code and output.",
                {"command": {"type": "string", "description": "the command"}}, ["command"]),
    "read_file": _fn("read_file", "Read a text file.", {"path": {"type": "string"}}, ["path"]),
    "write_file": _fn("write_file", "Write a text file (created or replaced).",
                      {"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]),
    "edit_file": _fn("edit_file", "Replace the one occurrence of old_text in a file with new_text.",
                     {"path": {"type": "string"}, "old_text": {"type": "string"}, "new_text": {"type": "string"}},
                     ["path", "old_text", "new_text"]),
    "delegate": _fn("delegate", "Give a self-contained sub-task to a sub-agent with a fresh context; "
                    "returns its final answer.", {"task": {"type": "string"}}, ["task"]),
}


def truncate(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, keeping its head and tail."""
    if len(text) <= limit:
        return text
    half = max(1, limit // 2)
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters omitted ...]\n{text[-half:]}"


@dataclass(slots=True)
class Toolbox:
    """Shell and file tools rooted at ``workdir``.

    * ``bash_timeout_s`` -- limit of one command (seconds; its process group is killed);
    * ``max_output_chars`` -- tool results are truncated to this length.
    """

    workdir: Path
    bash_timeout_s: float = 60.0
    max_output_chars: int = 8000

    def _path(self, p: Any) -> Path:
        if not isinstance(p, str) or not p:
            raise ValueError("path must be a non-empty string")
        path = Path(p)
        return path if path.is_absolute() else self.workdir / path

    def run(self, name: str, args: dict[str, Any]) -> str:
        """Run tool ``name`` (not ``delegate``) with parsed ``args``; returns the result text."""
        try:
            if name == "bash":
                return self.bash(args.get("command"))
            if name == "read_file":
                return truncate(self._path(args.get("path")).read_text(errors="replace"), self.max_output_chars)
            if name == "write_file":
                content = args.get("content")
                if not isinstance(content, str):
                    raise ValueError("content must be a string")
                path = self._path(args.get("path"))
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(content)
                return f"wrote {len(content)} characters to {args['path']}"
            if name == "edit_file":
                old, new = args.get("old_text"), args.get("new_text")
                if not isinstance(old, str) or not old or not isinstance(new, str):
                    raise ValueError("old_text (non-empty) and new_text must be strings")
                path = self._path(args.get("path"))
                text = path.read_text()
                n = text.count(old)
                if n != 1:
                    return f"error: old_text occurs {n} times in {args['path']} (it must occur exactly once)"
                path.write_text(text.replace(old, new, 1))
                return f"edited {args['path']}"
            return f"error: unknown tool {name!r}"
        except (OSError, ValueError, UnicodeError) as exc:
            return f"error: {exc}"

    def bash(self, command: Any) -> str:
        if not isinstance(command, str) or not command.strip():
            return "error: command must be a non-empty string"
        proc = subprocess.Popen(["bash", "-c", command], cwd=self.workdir, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=self.bash_timeout_s)
            head = f"exit code: {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            head = f"error: command timed out after {self.bash_timeout_s:g} s (killed)"
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # background leftovers
        except (ProcessLookupError, PermissionError):
            pass
        return truncate(f"{head}\n{out.decode(errors='replace')}", self.max_output_chars)
