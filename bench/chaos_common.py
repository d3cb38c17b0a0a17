"""What every section of ``bench/chaos.py`` shares: the model paths, the environment of the
processes it starts, request bodies and headers, logging."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "anthropic": "/v1/messages"}
MAX_KEY = {"chat": "max_tokens", "responses": "max_output_tokens", "anthropic": "max_tokens"}
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GLOG_minloglevel="2",
           TRANSFORMERS_VERBOSITY="error")
CLIENT_TIMEOUT_S = 35.0

def _log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _headers(api: str, key: str) -> dict[str, str]:
    h = {"content-type": "application/json"}
    if api == "anthropic":
        h["x-api-key"] = key
    else:
        h["authorization"] = f"Bearer {key}"
    return h


def _valid(api: str, text: str = "hi", max_tokens: int = 8) -> dict:
    if api == "responses":
        return {"model": "m", "input": [{"type": "message", "role": "user", "content": text}],
                MAX_KEY[api]: max_tokens}
    return {"model": "m", "messages": [{"role": "user", "content": text}], MAX_KEY[api]: max_tokens}
