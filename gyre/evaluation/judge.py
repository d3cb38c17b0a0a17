"""Agentic judge: a model assesses the preserved workspace against a rubric.

:class:`AgenticJudge` calls an OpenAI-compatible Chat Completions endpoint (in a Gyre run, the
proxy's ``/v1``) with the execution's key and ``x-gyre-role: evaluator``, so the proxy records
its output tokens with ``Provenance.EVALUATOR`` and never trains on them. The model gets the
task instruction, the rubric, a listing of the workspace and two read-only tools confined to
the preserved workspace, for at most ``max_turns`` calls; :func:`parse_score` reads the score
from its final reply.

Anything that yields no valid score is :class:`~gyre.evaluation.Unresolved`, never 0.
"""

from __future__ import annotations

import json
import math
import re
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from gyre.evaluation.assessment import Assessment, EvaluationTarget, Evaluator, Unresolved

__all__ = ["AgenticJudge", "parse_score", "JUDGE_TOOLS", "ROLE_HEADER", "EVALUATOR_ROLE"]

ROLE_HEADER = "x-gyre-role"
EVALUATOR_ROLE = "evaluator"

DEFAULT_SYSTEM_PROMPT = (
    "You are the evaluator of a software task. Inspect the workspace with the tools "
    "list_files and read_file, judge the work against the rubric, and finish with one line "
    "'SCORE: <number from 0 to {scale}>' (or a JSON object {{\"score\": <number>}}).\n\nRubric:\n{rubric}"
)

JUDGE_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "list_files",
        "description": "List files and directories under a path of the workspace (relative).",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "default": "."}}},
    }},
    {"type": "function", "function": {
        "name": "read_file",
        "description": "Read a text file of the workspace (relative path), from a byte offset.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "offset": {"type": "integer", "default": 0}},
            "required": ["path"]},
    }},
]

_THINK = re.compile(r"<think>.*?</think>", re.S | re.I)
_FENCED = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.S)
_OBJ = re.compile(r"\{[^{}]*\}", re.S)
_LINE = re.compile(r"(?im)^[\s>*_#-]*score[\s*_]*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?)(?:\s*/\s*(\d+(?:\.\d+)?))?")


def parse_score(text: str, scale: float = 1.0) -> float:
    """Score in ``[0, 1]`` from a judge reply (``{"score": x}``, fenced or bare, or a
    line ``SCORE: x``; ``x/y`` is read as a fraction of ``y``; ``<think>...</think>`` blocks are
    ignored); the last score given wins.

    Raises:
        Unresolved: no score, or a score outside ``[0, scale]``.
    """
    if not isinstance(text, str):
        raise Unresolved("judge reply has no text")
    body = _THINK.sub("", text)
    value: float | None = None
    denom = float(scale)
    candidates = _FENCED.findall(body) + _OBJ.findall(body)
    for raw in reversed(candidates):
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if isinstance(obj, dict) and "score" in obj:
            try:
                value = float(obj["score"])
            except (TypeError, ValueError):
                raise Unresolved(f"judge score is not a number: {obj['score']!r}") from None
            break
    if value is None:
        matches = _LINE.findall(body)
        if not matches:
            raise Unresolved("no score in the judge reply")
        num, den = matches[-1]
        value = float(num)
        if den:
            denom = float(den)
    if not (math.isfinite(value) and denom > 0 and 0.0 <= value <= denom):
        raise Unresolved(f"judge score {value!r} outside [0, {denom:g}]")
    return value / denom


class AgenticJudge(Evaluator):
    """Model-with-a-rubric evaluator.

    Requests go to ``POST {base_url}/chat/completions`` with the headers
    ``Authorization: Bearer <execution key>`` (ties the call to the execution assessed; ``api_key``
    instead when one is given),
    ``x-gyre-role: evaluator`` (the proxy gives its output tokens ``Provenance.EVALUATOR``;
    never training targets, and a critique that reaches a later policy request keeps that
    provenance) and ``x-gyre-execution-id`` / ``x-gyre-attempt`` (for the proxy's logs).

    Tools: ``list_files(path)`` and ``read_file(path, offset)``, confined to the preserved
    workspace (paths resolving outside it, symlinks included, are refused). The final reply
    must hold a score (:func:`parse_score`); the reward is ``x / score_scale``.

    Unresolved, never 0: HTTP/transport errors or timeouts, a non-JSON or malformed response,
    no parsable score, a score out of range, or no final answer within ``max_turns``.

    Args:
        base_url: OpenAI-compatible base URL, e.g. ``http://127.0.0.1:8000/v1``.
        rubric: the task's rubric.
        model: ``model`` field of the requests.
        api_key: the endpoint's own key (a judge endpoint other than the run's proxy); when given
            it is sent instead of the target's ``execution_key``.
        timeout_s: limit of one attempt, all turns together (seconds).
        max_turns: model calls per attempt.
        max_read_bytes: bytes returned by one ``read_file`` call.
        max_listing: entries shown by the initial listing and by ``list_files``.
        score_scale: the score range the rubric uses (e.g. 10); the reward is ``x / scale``.
        system_prompt: template with ``{rubric}`` and ``{scale}``.
        temperature / max_tokens: sampling settings of the judge calls.
        transport: an ``httpx`` transport (tests); ``clock``: monotonic seconds.
    """

    def __init__(
        self,
        base_url: str,
        *,
        rubric: str,
        model: str = "policy",
        api_key: str | None = None,
        timeout_s: float = 300.0,
        max_turns: int = 8,
        max_read_bytes: int = 32_768,
        max_listing: int = 200,
        score_scale: float = 1.0,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        temperature: float = 0.0,
        max_tokens: int = 1024,
        name: str = "judge",
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not timeout_s > 0 or max_turns < 1 or not score_scale > 0:
            raise ValueError("timeout_s and score_scale must be > 0 and max_turns >= 1")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.rubric = rubric
        self.model = model
        self.api_key = api_key
        self.timeout_s = float(timeout_s)
        self.max_turns = int(max_turns)
        self.max_read_bytes = int(max_read_bytes)
        self.max_listing = int(max_listing)
        self.score_scale = float(score_scale)
        self.system_prompt = system_prompt
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.name = name
        self.transport = transport
        self.clock = clock

    # ------------------------------------------------------------------ tools (read-only, confined)

    @staticmethod
    def _confined(root: Path, rel: str) -> Path:
        base = root.resolve()
        p = (base / rel).resolve()
        if p != base and base not in p.parents:
            raise PermissionError(f"{rel!r} is outside the workspace")
        return p

    def _list(self, root: Path, rel: str = ".") -> str:
        p = self._confined(root, rel)
        if not p.is_dir():
            raise FileNotFoundError(f"not a directory: {rel}")
        base = root.resolve()
        out: list[str] = []
        for child in sorted(p.rglob("*")):
            if len(out) >= self.max_listing:
                out.append(f"... (more than {self.max_listing} entries)")
                break
            r = child.relative_to(base).as_posix()
            if child.is_symlink():
                out.append(f"{r} -> (symlink)")
            elif child.is_dir():
                out.append(r + "/")
            else:
                out.append(f"{r} ({child.stat().st_size} bytes)")
        return "\n".join(out) if out else "(empty)"

    def _read(self, root: Path, rel: str, offset: int = 0) -> str:
        p = self._confined(root, rel)
        if not p.is_file():
            raise FileNotFoundError(f"not a file: {rel}")
        with open(p, "rb") as f:
            f.seek(max(0, int(offset)))
            data = f.read(self.max_read_bytes + 1)
        text = data[: self.max_read_bytes].decode("utf-8", errors="replace")
        if len(data) > self.max_read_bytes:
            text += f"\n... (truncated; continue with offset={int(offset) + self.max_read_bytes})"
        return text

    def _call_tool(self, root: Path, name: str, arguments: str) -> str:
        try:
            args = json.loads(arguments or "{}")
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
            if name == "list_files":
                return self._list(root, str(args.get("path", ".")))
            if name == "read_file":
                return self._read(root, str(args["path"]), int(args.get("offset", 0)))
            return f"error: unknown tool {name!r}"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"error: {exc}"

    # ------------------------------------------------------------------ evaluate

    def evaluate(self, target: EvaluationTarget, *, timeout_s: float | None = None) -> Assessment:
        start = self.clock()
        limit = self.timeout_s if timeout_s is None else min(self.timeout_s, float(timeout_s))
        details: dict[str, Any] = {"evaluator": self.name, "model": self.model, "turns": 0, "tool_calls": []}
        ref = target.assessed_ref

        def unresolved(reason: str) -> Assessment:
            return Assessment.unresolved(reason, ref, details, self.clock() - start)

        root = target.workspace
        if not root.is_dir():
            return unresolved(f"preserved workspace not found: {root}")
        key = self.api_key or target.execution_key or "none"
        headers = {"Authorization": f"Bearer {key}", ROLE_HEADER: EVALUATOR_ROLE,
                   "x-gyre-execution-id": target.execution_id, "x-gyre-attempt": str(target.attempt)}
        try:
            messages: list[dict[str, Any]] = [
                {"role": "system",
                 "content": self.system_prompt.format(rubric=self.rubric, scale=f"{self.score_scale:g}")},
                {"role": "user", "content": (f"Task instruction:\n{target.instruction}\n\n"
                                             f"Workspace (artifact {ref}):\n{self._list(root)}")},
            ]
            with httpx.Client(transport=self.transport, headers=headers) as client:
                for _ in range(self.max_turns):
                    left = limit - (self.clock() - start)
                    if left <= 0:
                        return unresolved(f"judge ran past its {limit:g} s limit")
                    body = {"model": self.model, "messages": messages, "tools": JUDGE_TOOLS,
                            "temperature": self.temperature, "max_tokens": self.max_tokens}
                    resp = client.post(self.url, json=body, timeout=left)
                    details["turns"] += 1
                    if resp.status_code != 200:
                        return unresolved(f"judge endpoint returned HTTP {resp.status_code}: {resp.text[:300]}")
                    try:
                        message = resp.json()["choices"][0]["message"]
                    except (ValueError, KeyError, IndexError, TypeError):
                        return unresolved(f"malformed chat completion: {resp.text[:300]}")
                    calls = message.get("tool_calls") or []
                    if calls:
                        messages.append({"role": "assistant", "content": message.get("content"), "tool_calls": calls})
                        for call in calls:
                            fn = call.get("function") or {}
                            result = self._call_tool(root, str(fn.get("name")), fn.get("arguments") or "{}")
                            details["tool_calls"].append({"name": fn.get("name"), "arguments": fn.get("arguments")})
                            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": result})
                        continue
                    content = message.get("content") or ""
                    details["reply"] = content[-4000:]
                    try:
                        score = parse_score(content, self.score_scale)
                    except Unresolved as exc:
                        return unresolved(str(exc))
                    return Assessment.valid_score(score, ref, details, self.clock() - start)
        except httpx.TimeoutException:
            return unresolved(f"judge ran past its {limit:g} s limit")
        except httpx.HTTPError as exc:
            return unresolved(f"judge endpoint unreachable: {type(exc).__name__}: {exc}")
        except Exception as exc:
            details["traceback"] = traceback.format_exc(limit=8)
            return unresolved(f"judge crashed: {type(exc).__name__}: {exc}")
        return unresolved(f"no final answer within {self.max_turns} turns")
