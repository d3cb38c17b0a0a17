"""Record real-harness request traces against a scripted model server on 127.0.0.1.

Installs Claude Code (npm ``@anthropic-ai/claude-code``), the Codex CLI (npm ``@openai/codex``)
and mini-swe-agent (PyPI, in its own venv) into the harness cache with
:func:`gyre.harness.install.ensure_package` (``--cache`` or ``$GYRE_HARNESS_CACHE``), launches
each one non-interactively with the command its Gyre adapter builds
(:mod:`gyre.harness.claude_code`, :mod:`gyre.harness.codex`, :mod:`gyre.harness.mini_swe_agent`),
pointed at :class:`tools.fake_llm.FakeLLMServer`, and writes every request the harness
made to ``<out>/<harness>/<scenario>.jsonl`` (record format: the :mod:`tools.fake_llm`
docstring).

The server's script (:class:`ScriptPolicy`) works out each request's kind and step from its
content: a prompt containing ``MAIN_TASK`` is the main agent (``main_text`` when no tools are
offered), one that starts from ``SUBAGENT_TASK`` is a sub-agent, a compaction prompt ("detailed
summary of the conversation" / "CONTEXT CHECKPOINT COMPACTION") is ``compaction`` and anything
else without tools is ``auxiliary``. The step is the number of assistant tool-call turns in the
context plus the ``step=N`` carried by a compaction summary (``SUMMARY-MARKER step=N``).

Sanitising: credential headers are replaced with ``<redacted>``; UUIDs and 64-hex ids found in
request headers and in the Anthropic ``metadata.user_id`` (sessions, threads, devices) are
replaced everywhere in the file by stable placeholders numbered in order of appearance, and so
are Claude Code's sub-agent ids (``x-claude-code-agent-id``). Working
and home directories (``--work-root``) and the server's port (``--port``) are fixed, so paths
and ``Host`` headers do not vary between recordings.

Usage::

    python tools/record_trace.py --list
    python tools/record_trace.py                      # every scenario into tests/data/traces
    python tools/record_trace.py --harness codex --scenario cx3_retry_drop --out /tmp/traces
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre.harness.execution import ExecutionDir, ProxyEndpoint  # noqa: E402
from gyre.harness.claude_code import ClaudeCodeHarness  # noqa: E402
from gyre.harness.codex import CodexHarness  # noqa: E402
from tools.fake_llm import FakeLLMServer, FakeRequest, Reply  # noqa: E402
from gyre.harness.install import ensure_package  # noqa: E402
from gyre.harness.mini_swe_agent import MiniSweAgentHarness  # noqa: E402

MAIN_PROMPT = "MAIN_TASK: follow the scripted steps. Run exactly the tool calls you are given, then stop."
SUBAGENT_PROMPT = "SUBAGENT_TASK: run pwd and report the directory."
SUBAGENT_RESULT = "SUBAGENT_RESULT: the directory was printed."
FINAL_TEXT = "All done. DONE_MARKER"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
COMPACTION_RE = re.compile(r"detailed summary of the conversation|CONTEXT CHECKPOINT COMPACTION")
SUMMARY_RE = re.compile(r"SUMMARY-MARKER step=(\d+)")
PATCH = "*** Begin Patch\n*** Add File: notes.txt\n+line one\n+line two\n*** End Patch\n"
ODD_SHELL = {"exec_command": '{\n "cmd" :  "echo hello && pwd"\n}', "bash": '{ "command" :  "echo hello && pwd" }'}


# ----------------------------------------------------------------------------- the script


def _user_text(req: FakeRequest) -> str:
    return req.texts()["any"]


def classify(req: FakeRequest) -> tuple[str, int]:
    """``(kind, step)`` of one model request (module docstring)."""
    texts = req.texts()
    anytext = texts["any"]
    steps = _tool_turns(req)
    carried = [int(m) for m in SUMMARY_RE.findall(anytext)]
    step = steps + (carried[-1] if carried else 0)
    if COMPACTION_RE.search(texts["last_user"]):
        return "compaction", step
    main_at, sub_at = anytext.find("MAIN_TASK"), anytext.find("SUBAGENT_TASK")
    if sub_at >= 0 and (main_at < 0 or sub_at < main_at):
        return "subagent", steps
    if main_at >= 0:
        return ("main" if req.tool_names else "main_text"), step
    return "auxiliary", 0


def _tool_turns(req: FakeRequest) -> int:
    """Assistant turns with tool calls in the context (text-based agents: assistant turns)."""
    b = req.body
    if req.api == "anthropic":
        return sum(1 for m in b.get("messages") or [] if m.get("role") == "assistant" and isinstance(
            m.get("content"), list) and any(isinstance(x, dict) and x.get("type") == "tool_use" for x in m["content"]))
    if req.api == "chat":
        if not b.get("tools"):
            return sum(1 for m in b.get("messages") or [] if m.get("role") == "assistant")
        return sum(1 for m in b.get("messages") or [] if m.get("role") == "assistant" and m.get("tool_calls"))
    turns, in_turn = 0, False
    for it in b.get("input") or [] if isinstance(b.get("input"), list) else []:
        t = it.get("type") if isinstance(it, dict) else None
        if t in ("function_call", "custom_tool_call"):
            if not in_turn:
                turns += 1
            in_turn = True
        elif t != "reasoning":
            in_turn = False
    return turns


def _tool(req: FakeRequest, name: str) -> dict[str, Any] | None:
    for t in req.body.get("tools") or []:
        if t.get("name") == name or (t.get("function") or {}).get("name") == name:
            return t
    return None


def _agent_id(req: FakeRequest) -> str | None:
    for out in req.tool_results():
        try:
            obj = json.loads(out)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("agent_id"), str):
            return obj["agent_id"]
    return None


@dataclass
class ScriptPolicy:
    """The scripted model: one reply per request, chosen from the request's kind and step.

    ``fail``: injected outcomes for the first model requests, in order (an HTTP status, ``T`` =
    answer only after ``delay_s``, ``D`` = cut the stream after its first event, ``ok``);
    ``inflate_step``/``inflate_tokens``: the main reply at that step reports that many input
    tokens (to trigger auto-compaction); ``workdir``: the harness's working directory (Claude
    Code's file tools want absolute paths); ``textbased``: answer chat requests with a
    ``mswea_bash_command`` block instead of tool calls."""

    workdir: Path
    fail: list[str] = field(default_factory=list)
    delay_s: float = 8.0
    inflate_step: int | None = None
    inflate_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, req: FakeRequest) -> Reply:
        kind, step = classify(req)
        reply = self.reply(req, kind, step)
        reply.kind, reply.step = kind, step
        with self._lock:
            outcome = self.fail.pop(0) if self.fail else "ok"
        if outcome == "T":
            reply.delay_s = self.delay_s
        elif outcome == "D":
            reply.drop = True
        elif outcome != "ok":
            reply.status = int(outcome)
        return reply

    # -- replies by API ---------------------------------------------------------------
    def reply(self, req: FakeRequest, kind: str, step: int) -> Reply:
        if kind == "compaction":
            return Reply(text=f"<summary>SUMMARY-MARKER step={step}. MAIN_TASK: carry on with the scripted "
                              f"steps from step {step}; notes.txt has been written.</summary>")
        if kind == "auxiliary":
            if "title" in req.texts()["any"].lower():
                return Reply(text=json.dumps({"title": "Fake session title"}))
            return Reply(text="ok")
        if req.api == "anthropic":
            r = self._anthropic(req, kind, step)
            thinking = req.body.get("thinking") or {}
            if thinking.get("type") in ("enabled", "adaptive"):
                r.thinking = f"Scripted thinking for step {step}."
        elif req.api == "responses":
            r = self._responses(req, kind, step)
            if "reasoning.encrypted_content" in (req.body.get("include") or []) and r.tool_calls:
                r.reasoning = f"Thinking about step {step}."
        else:
            r = self._chat(req, kind, step)
        if kind == "main" and step == self.inflate_step:
            r.input_tokens = self.inflate_tokens
        return r

    def _anthropic(self, req: FakeRequest, kind: str, step: int) -> Reply:
        notes = str(self.workdir / "notes.txt")

        def bash(cmd: str) -> tuple[str, dict[str, Any]]:
            return "Bash", {"description": "Run the scripted command", "command": cmd}  # not schema order

        if kind == "subagent":
            return Reply(tool_calls=[bash("pwd")]) if step == 0 else Reply(text=SUBAGENT_RESULT)
        script = [
            [bash("echo hello-from-bash && pwd")],
            [("Write", {"file_path": notes, "content": "line one\nline two\n"})],
            [("Read", {"file_path": notes})],
            [("Edit", {"file_path": notes, "old_string": "line two", "new_string": "line 2"})],
            [bash("ls -la"), ("Read", {"file_path": notes})],
            [("Agent", {"description": "Print the directory", "subagent_type": "general-purpose",
                        "prompt": SUBAGENT_PROMPT})] if _tool(req, "Agent") else [bash("echo no-agent-tool")],
            [bash("cat notes.txt")],
        ]
        if step < len(script):
            return Reply(text=f"Step {step}.", tool_calls=script[step])
        return Reply(text=FINAL_TEXT)

    def _responses(self, req: FakeRequest, kind: str, step: int) -> Reply:
        shell = "exec_command" if "exec_command" in req.tool_names else "shell"

        def sh(cmd: str) -> tuple[str, Any]:
            return (shell, {"cmd": cmd}) if shell == "exec_command" else (shell, {"command": ["bash", "-lc", cmd]})

        if kind == "subagent":
            return Reply(tool_calls=[sh("pwd")]) if step == 0 else Reply(text=SUBAGENT_RESULT)
        names = req.tool_names
        actions: list[list[tuple[Any, ...]]] = [[(shell, ODD_SHELL["exec_command"]) if shell == "exec_command"
                                                 else sh("echo hello && pwd")]]
        ap = _tool(req, "apply_patch")
        if ap is not None and ap.get("type") == "custom":
            actions.append([("apply_patch", PATCH, {"custom": True})])
        else:
            actions.append([sh("printf 'line one\\nline two\\n' > notes.txt")])
        actions.append([sh("cat notes.txt"), sh("ls -la")])
        if "update_plan" in names:
            actions.append([("update_plan", {"plan": [{"step": "write notes", "status": "completed"},
                                                       {"step": "count lines", "status": "in_progress"}]})])
        ns = "multi_agent_v1" if "multi_agent_v1.spawn_agent" in names else None
        if ns or "spawn_agent" in names:
            opts = {"namespace": ns} if ns else {}
            actions.append([("spawn_agent", {"message": SUBAGENT_PROMPT}, opts)])
            actions.append([("wait_agent", {"targets": [_agent_id(req) or "unknown"], "timeout_ms": 30000}, opts)])
        actions.append([sh("wc -l notes.txt")])
        if step < len(actions):
            return Reply(text="", tool_calls=actions[step])
        return Reply(text=FINAL_TEXT)

    def _chat(self, req: FakeRequest, kind: str, step: int) -> Reply:
        script: list[list[Any]] = [
            [ODD_SHELL["bash"]],
            ["printf 'line one\\nline two\\n' > notes.txt && cat notes.txt"],
            [{"command": "cat notes.txt"}, {"command": "ls -la"}],
            [SUBMIT],
        ]
        if step >= len(script):
            return Reply(text=FINAL_TEXT)
        cmds = script[step]
        if kind == "main_text":
            one = " && ".join(c["command"] if isinstance(c, dict) else (
                json.loads(c)["command"] if c.startswith("{") else c) for c in cmds)
            return Reply(text=f"THOUGHT: step {step}.\n\n```mswea_bash_command\n{one}\n```")
        calls = [("bash", c if isinstance(c, (dict,)) or c.startswith("{") else {"command": c}) for c in cmds]
        return Reply(text=f"THOUGHT: step {step}.", tool_calls=calls)


# ----------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    harness: str
    name: str
    description: str
    fail: tuple[str, ...] = ()
    delay_s: float = 8.0
    inflate_step: int | None = None
    inflate_tokens: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


SCENARIOS = [
    Scenario("claude-code", "cc1_tools_subagent", "Bash/Write/Read/Edit, two parallel calls, a background "
             "sub-agent (Agent tool), final answer"),
    Scenario("claude-code", "cc2_autocompact", "the reply to main step 2 reports 995000 input tokens: "
             "auto-compaction, then the run resumes in the compacted context", inflate_step=2,
             inflate_tokens=995_000),
    Scenario("claude-code", "cc3_retry_500_429_529", "HTTP 500, 429, 529 on the first three requests and 500 on the "
             "fifth: retried with the same body", fail=("500", "429", "529", "ok", "500")),
    Scenario("claude-code", "cc4_timeout_drop", "first request answered only after 8 s (client timeout 3 s), "
             "second stream cut after its first event", fail=("T", "D"), env={"API_TIMEOUT_MS": "3000"}),
    Scenario("codex", "cx1_tools_subagent", "model unknown to Codex: shell calls, parallel calls, "
             "spawn_agent/wait_agent sub-agent thread", options={"model": "fake-model"}),
    Scenario("codex", "cx2_gpt55_autocompact", "gpt-5.5 (apply_patch as a custom tool), context window 200k, "
             "auto-compaction at 50k: main step 2 reports 60000 input tokens", inflate_step=2,
             inflate_tokens=60_000, options={"model": "gpt-5.5", "context_window": 200_000,
                                             "auto_compact_tokens": 50_000}),
    Scenario("codex", "cx3_retry_drop", "HTTP 500, 429 and a stream cut after its first event",
             fail=("500", "429", "D"), options={"model": "fake-model"}),
    Scenario("mini-swe-agent", "ms1_toolcalling_chat", "Chat Completions tool calling (bash tool), one "
             "turn with two calls, submit"),
    Scenario("mini-swe-agent", "ms2_textbased_chat", "text-based mode: mswea_bash_command blocks, no tools",
             options={"textbased": True}),
    Scenario("mini-swe-agent", "ms3_retry", "HTTP 500, 429, 500 before the first answer", fail=("500", "429", "500")),
]

HARNESS_CLASSES = {"claude-code": ClaudeCodeHarness, "codex": CodexHarness, "mini-swe-agent": MiniSweAgentHarness}


@dataclass
class _Task:
    instruction: str
    id: str = "trace"


@dataclass
class _Ctx:
    task: _Task
    dirs: ExecutionDir
    endpoint: ProxyEndpoint
    execution_id: str = "trace"
    timeout_s: float = 300.0


def build_launch(sc: Scenario, base_url: str, dirs: ExecutionDir,
                 cache: Path | None) -> tuple[list[str], dict[str, str]]:
    """The adapter's command and environment for one scenario (installs the harness if needed)."""
    opts = dict(sc.options)
    textbased = opts.pop("textbased", False)
    model = opts.pop("model", "claude-opus-5-5" if sc.harness == "claude-code" else "fake-model")
    cls = HARNESS_CLASSES[sc.harness]
    h = cls(model=model, **opts)
    exe = ensure_package(h.package, cache)
    h.binary = str(exe)
    ctx = _Ctx(_Task(MAIN_PROMPT), dirs, ProxyEndpoint(base_url, "dummy-key", model))
    spec = h.build_command(ctx)
    argv = list(spec.argv)
    if textbased:
        argv[argv.index("mini.yaml")] = "mini_textbased.yaml"
        argv[1:1] = ["--model-class", "litellm_textbased"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(dirs.home), "TMPDIR": str(dirs.tmp),
           "LANG": "C.UTF-8", "TERM": "dumb", "SHELL": shutil.which("bash") or "/bin/sh",
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost", **spec.env, **sc.env}
    return argv, env


def record(sc: Scenario, out: Path, work_root: Path, cache: Path | None, timeout_s: float,
           port: int = 0) -> dict[str, Any]:
    """Run one scenario; write ``out/<harness>/<name>.jsonl``; return a short summary."""
    dirs = ExecutionDir(work_root / sc.name, work_root)
    shutil.rmtree(dirs.root, ignore_errors=True)
    for d in (dirs.home, dirs.workspace, dirs.tmp):
        d.mkdir(parents=True)
    raw = dirs.root / "raw.jsonl"
    policy = ScriptPolicy(dirs.workspace, fail=list(sc.fail), delay_s=sc.delay_s, inflate_step=sc.inflate_step,
                          inflate_tokens=sc.inflate_tokens)
    t0 = time.monotonic()
    with FakeLLMServer(policy, trace_path=raw, port=port) as srv:
        argv, env = build_launch(sc, srv.base_url, dirs, cache)
        with open(dirs.log_path, "w") as log:
            try:
                proc = subprocess.run(argv, cwd=dirs.workspace, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, timeout=timeout_s)
                rc: int | str = proc.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        time.sleep(0.5)  # late requests (background sub-agents) land in the log
    records = [json.loads(x) for x in raw.read_text().splitlines() if x.strip()]
    dest = out / sc.harness / f"{sc.name}.jsonl"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(sanitise(records))
    kinds = [f"{r['kind']}:{r['step']}" + (f"!{r['injected']}" if r.get("injected") else "") for r in records]
    return {"scenario": sc.name, "rc": rc, "requests": len(records), "seconds": round(time.monotonic() - t0, 1),
            "kinds": kinds, "file": str(dest)}


# ----------------------------------------------------------------------------- sanitising

SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "proxy-authorization", "api-key", "openai-api-key",
                  "anthropic-api-key"}
UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
HEX64_RE = re.compile(r"\b[0-9a-f]{64}\b")


def sanitise(records: list[dict[str, Any]]) -> str:
    """JSON lines of ``records`` with secrets redacted and random ids replaced (module docstring)."""
    found: dict[str, str] = {}

    def note(text: str) -> None:
        for m in UUID_RE.findall(text):
            found.setdefault(m, f"00000000-0000-4000-8000-{len([v for v in found.values() if '-' in v]) + 1:012d}")
        for m in HEX64_RE.findall(text):
            found.setdefault(m, "d" * 56 + f"{sum(v.startswith('d' * 56) for v in found.values()) + 1:08d}")

    for r in records:
        for k in list(r.get("headers") or {}):
            if k.lower() in SECRET_HEADERS:
                r["headers"][k] = "<redacted>"
            elif k.lower() == "x-claude-code-agent-id":  # random per sub-agent
                found.setdefault(r["headers"][k], f"a{sum(v.startswith('a') for v in found.values()) + 1:016x}")
            else:
                note(str(r["headers"][k]))
        body = r.get("body")
        if isinstance(body, dict):
            note(str((body.get("metadata") or {}).get("user_id", "")))
    lines = []
    for r in records:
        text = json.dumps(r)
        for old, new in found.items():
            text = text.replace(old, new)
        lines.append(text + "\n")
    return "".join(lines)


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Scenarios:\n" + "\n".join(f"  {s.harness:15s} {s.name:24s} {s.description}"
                                                                   for s in SCENARIOS))
    ap.add_argument("--harness", action="append", choices=sorted(HARNESS_CLASSES),
                    help="record only this harness (repeatable; default: all)")
    ap.add_argument("--scenario", action="append", help="record only this scenario (repeatable; default: all)")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "traces",
                    help="output directory (default: tests/data/traces)")
    ap.add_argument("--cache", type=Path, default=None, help="harness install cache (default: $GYRE_HARNESS_CACHE, "
                    "else the venv's share/gyre/harnesses)")
    ap.add_argument("--work-root", type=Path, default=Path("/tmp/gyre-trace"),
                    help="fixed parent of each run's home and working directory (default: /tmp/gyre-trace)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per harness run (default: 300)")
    ap.add_argument("--port", type=int, default=18765,
                    help="the scripted server's port, fixed so Host headers do not vary (0: any free port)")
    ap.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = ap.parse_args(argv)
    chosen = [s for s in SCENARIOS if (not args.harness or s.harness in args.harness)
              and (not args.scenario or s.name in args.scenario)]
    if args.list:
        for s in chosen:
            print(f"{s.harness:15s} {s.name:24s} {s.description}")
        return 0
    if not chosen:
        print("no scenario matches", file=sys.stderr)
        return 2
    bad = 0
    for s in chosen:
        res = record(s, args.out, args.work_root, args.cache, args.timeout, args.port)
        print(json.dumps(res), flush=True)
        bad += res["rc"] != 0
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
