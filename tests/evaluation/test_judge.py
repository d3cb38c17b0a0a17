"""Agentic judge against a real HTTP server on 127.0.0.1 (an OpenAI-compatible stand-in for the proxy)."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gyre.evaluation import AgenticJudge, AssessmentStatus, EvaluationTarget, Unresolved, parse_score

from .helpers import write_workspace


class ChatServer:
    """Serves scripted chat completions; records each request's headers and body."""

    def __init__(self):
        self.script: list = []
        self.requests: list[tuple[dict, dict]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": "not found"}})
                step = server.script.pop(0)
                if isinstance(step, tuple):  # (status, raw body)
                    status, raw = step
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                    return
                self._send(200, {"id": "c1", "object": "chat.completion", "model": body["model"],
                                 "choices": [{"index": 0, "message": step, "finish_reason": "stop"}]})

            def _send(self, status, obj):
                raw = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def _server():
    s = ChatServer()
    yield s
    s.close()


@pytest.fixture
def server(_server):
    _server.script, _server.requests = [], []
    return _server


def tool_call(name, args, cid="call_1"):
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


def answer(text):
    return {"role": "assistant", "content": text}


@pytest.fixture
def target(tmp_path):
    ws = write_workspace(tmp_path / "ws")
    return EvaluationTarget("exec-7", ws, "sha256:feed", "main", attempt=2, instruction="Fix mul.",
                            execution_key="exec-key-7")


def judge(server, **kw):
    kw.setdefault("timeout_s", 10)
    return AgenticJudge(server.base_url, rubric="Full marks if all tests would pass.", **kw)


def test_judge_reads_the_workspace_with_tools_then_scores(server, target):
    server.script = [tool_call("read_file", {"path": "calc.py"}),
                     tool_call("read_file", {"path": "../../etc/passwd"}, "call_2"),
                     answer("mul adds instead of multiplying.\nSCORE: 0.8")]
    a = judge(server, model="policy-v3").evaluate(target)
    assert (a.status, a.score, a.assessed_ref) == (AssessmentStatus.VALID, 0.8, "sha256:feed")
    assert a.details["turns"] == 3 and [c["name"] for c in a.details["tool_calls"]] == ["read_file", "read_file"]
    headers, body = server.requests[0]
    assert headers["x-gyre-role"] == "evaluator"
    assert headers["authorization"] == "Bearer exec-key-7"
    assert headers["x-gyre-execution-id"] == "exec-7" and headers["x-gyre-attempt"] == "2"
    assert body["model"] == "policy-v3" and {t["function"]["name"] for t in body["tools"]} == {"list_files", "read_file"}
    assert "Full marks" in body["messages"][0]["content"]
    assert "Fix mul." in body["messages"][1]["content"] and "calc.py" in body["messages"][1]["content"]
    _, second = server.requests[1]
    tool_msg = second["messages"][-1]
    assert tool_msg["role"] == "tool" and tool_msg["tool_call_id"] == "call_1" and "def mul" in tool_msg["content"]
    _, third = server.requests[2]
    assert "outside the workspace" in third["messages"][-1]["content"]


def test_json_score_and_scale(server, target):
    server.script = [answer('<think>SCORE: 1</think>Assessment:\n```json\n{"score": 7, "why": "one bug"}\n```')]
    a = judge(server, score_scale=10).evaluate(target)
    assert a.status is AssessmentStatus.VALID and a.score == pytest.approx(0.7)


@pytest.mark.parametrize("step, reason", [
    (answer("Looks decent overall."), "no score"),
    (answer("SCORE: 1.5"), "outside"),
    ((500, b"upstream exploded"), "HTTP 500"),
    ((200, b"not json"), "malformed"),
])
def test_unresolved_replies(server, target, step, reason):
    server.script = [step]
    a = judge(server).evaluate(target)
    assert a.status is AssessmentStatus.UNRESOLVED and math.isnan(a.score)
    assert reason in a.details["reason"]


def test_no_final_answer_within_max_turns(server, target):
    server.script = [tool_call("list_files", {"path": "."})] * 2
    a = judge(server, max_turns=2).evaluate(target)
    assert a.status is AssessmentStatus.UNRESOLVED and "2 turns" in a.details["reason"]


def test_unreachable_endpoint_is_unresolved(target):
    a = AgenticJudge("http://127.0.0.1:9/v1", rubric="r", timeout_s=2).evaluate(target)
    assert a.status is AssessmentStatus.UNRESOLVED and "unreachable" in a.details["reason"]


def test_parse_score():
    assert parse_score("blah\nSCORE: 0.25") == 0.25
    assert parse_score("**Score:** 8/10") == 0.8
    assert parse_score('{"score": 0.5}') == 0.5
    assert parse_score("SCORE: 0.2\nOn reflection,\nSCORE: 0.4") == 0.4  # the last one wins
    assert parse_score("score = 3", scale=4) == 0.75
    for bad in ("", "no number here", "SCORE: -0.1", '{"score": "high"}', "SCORE: 11/10"):
        with pytest.raises(Unresolved):
            parse_score(bad)
