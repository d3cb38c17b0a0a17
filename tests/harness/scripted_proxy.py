"""Gyre's real proxy (rendering, TITO recording, trajectory trees, record store) in front of a
scripted engine: the test policy for harness integration tests.

The engine (:class:`gyre.proxy.engines.ScriptedEngine`) decodes each request's input tokens to
the rendered prompt text and answers with the tokens of ``policy(prompt) -> text`` plus EOS, so
a policy emits well-formed tool calls in the model's format (``<tool_call>{json}</tool_call>``)
while the proxy, the chat template, the output parser and the recording stay real.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

TOOLS_RE = re.compile(r"<tools>\n(.*?)\n</tools>", re.S)  # not the "<tools></tools>" of the instructions


def offered_tools(prompt: str) -> list[str]:
    """Names of the tools rendered into the prompt's system turn."""
    m = TOOLS_RE.search(prompt)
    if not m:
        return []
    names = []
    for line in m.group(1).strip().splitlines():
        try:
            t = json.loads(line)
        except ValueError:
            continue
        fn = t.get("function", t)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.append(fn["name"])
    return names


def tool_call(name: str, args: dict[str, Any]) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def shell_call(prompt: str, command: str) -> str:
    """A call of whichever shell tool the prompt offers."""
    names = offered_tools(prompt)
    if "Bash" in names:
        return tool_call("Bash", {"command": command, "description": "Run the scripted command"})
    if "exec_command" in names:
        return tool_call("exec_command", {"cmd": command})
    if "bash" in names:
        return tool_call("bash", {"command": command})
    if "shell" in names:
        return tool_call("shell", {"command": ["bash", "-lc", command]})
    raise AssertionError(f"no shell tool offered: {names}")


def tool_results(prompt: str) -> int:
    return prompt.count("<tool_response>")


@dataclass
class ScriptedProxy:
    server: Any
    save_dir: Path
    engine: Any
    tokenizer: Any
    prompts: list[str]

    @property
    def base_url(self) -> str:
        return self.server.url

    def register(self, execution_id: str, task_id: str, harness: str, role_rules: Any = None) -> str:
        """Register through ``POST /gyre/executions`` (or, with ``role_rules`` -- a harness
        adapter's :class:`~gyre.harness.RoleRules` -- through the in-process API that accepts
        them); returns the execution's API key."""
        if role_rules is not None:
            ex = self.server.register_execution(execution_id, task_id=task_id, harness=harness, role_rules=role_rules)
            return ex.api_key
        r = httpx.post(f"{self.base_url}/gyre/executions",
                       json={"execution_id": execution_id, "task_id": task_id, "harness": harness}, timeout=30)
        r.raise_for_status()
        assert r.json()["execution_id"] == execution_id
        return r.json()["api_key"]

    def close(self, execution_id: str) -> None:
        httpx.post(f"{self.base_url}/gyre/executions/{execution_id}/close", timeout=30).raise_for_status()

    def model_calls(self, execution_id: str) -> Callable[[], int]:
        return lambda: self.server.counters(execution_id)["calls"]

    def tree(self, execution_id: str):
        from gyre.trajectory.store import TrajectoryStore

        return TrajectoryStore(self.save_dir).load_tree(execution_id)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))


def leaves_by_role(tree) -> Counter:
    return Counter(tree.role(n) for n in tree.leaves())


@contextmanager
def scripted_proxy(model_dir: str | Path, policy: Callable[[str], str], save_dir: str | Path, *,
                   max_context_tokens: int = 4_000_000) -> Iterator[ScriptedProxy]:
    """Start the proxy + scripted engine; ``max_context_tokens`` is the proxy's prompt limit
    (longer prompts get HTTP 400 "prompt is too long")."""
    from gyre.embedded_model import load_tokenizer
    from gyre.proxy.engines import ScriptedEngine
    from gyre.proxy.render import ChatRenderer
    from gyre.proxy.server import ProxyConfig, ProxyServer
    from gyre.trajectory.store import TrajectoryStore

    tok = load_tokenizer(model_dir)
    renderer = ChatRenderer(tok)
    prompts: list[str] = []

    def script(input_ids: list[int], params: dict[str, Any]) -> list[int]:
        prompt = tok.decode(input_ids)
        prompts.append(prompt)
        return tok.encode(policy(prompt), add_special_tokens=False) + [renderer.eos_id]

    engine = ScriptedEngine("engine-0", script=script, chunk=16)
    server = ProxyServer(renderer, store=TrajectoryStore(save_dir),
                         config=ProxyConfig(max_context_tokens=max_context_tokens, default_max_tokens=512))
    server.add_engine(engine)
    server.start()
    try:
        yield ScriptedProxy(server, Path(save_dir), engine, tok, prompts)
    finally:
        server.stop()
