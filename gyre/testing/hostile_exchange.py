"""Sending the cases of ``gyre/testing/hostile_cases.py`` to the proxy and judging the answers: a raw
HTTP/1.1 client (:func:`send`; a body sent whole, chunked, or short of its declared length),
:func:`problems` (what an answer breaks of the proxy's promises), this process's peak RSS
(:func:`rss_mark`, :func:`rss_growth`) and :class:`Others` (another execution's small calls in a
thread). Shared by ``tests/proxy/test_hostile_bodies.py`` and ``bench/chaos_hostile.py``.
"""

from __future__ import annotations

import gc
import json
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from gyre.testing.hostile_cases import END_MARK, MODEL_APIS, PATHS, Case, dumps, valid

# ------------------------------------------------------------------------------ sending
@dataclass
class Answer:
    status: int | None  # None: no status line (closed, or nothing within the time bound)
    body: bytes
    elapsed_s: float
    hung: bool


def headers_for(api: str, key: str, retry: int | None = None) -> dict[str, str]:
    h = {"content-type": "application/json"}
    h.update({"x-api-key": key} if api in ("anthropic", "count_tokens") else {"authorization": f"Bearer {key}"})
    if retry is not None:
        h["x-stainless-retry-count"] = str(retry)
    return h


def send(url: str, case: Case, key: str, *, timeout: float = 10.0, retry: int | None = None,
         drop_after: float | None = None) -> Answer:
    """Send ``case`` over a fresh connection (``Connection: close``) and read the answer until the
    server closes, for at most ``timeout`` seconds (then ``hung``). ``drop_after``: close the
    connection after that many seconds without an answer, as a client that gives up."""
    host, port = url.split("//")[1].split(":")
    hdr = {**headers_for(case.api, key, retry), **case.headers, "host": host, "connection": "close"}
    if case.send == "chunked":
        hdr["transfer-encoding"] = "chunked"
    else:
        hdr["content-length"] = str(case.declared if case.declared is not None else len(case.raw))
    head = f"POST {PATHS[case.api]} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdr.items()) + "\r\n"
    t0 = time.monotonic()
    s = socket.create_connection((host, int(port)), timeout=timeout)
    got = bytearray()
    try:
        parts = _parts(head.encode(), case)
        sender = threading.Thread(target=_send_all, args=(s, parts, case.send == "declared_closed"), daemon=True)
        sender.start()
        limit = t0 + (drop_after if drop_after is not None else timeout)
        while True:
            left = limit - time.monotonic()
            if left <= 0:
                return Answer(_status(got), bytes(got), time.monotonic() - t0, drop_after is None)
            s.settimeout(left)
            try:
                chunk = s.recv(1 << 16)
            except socket.timeout:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                return Answer(_status(got), _body(bytes(got)), time.monotonic() - t0, False)
            got += chunk
    finally:
        s.close()


def _parts(head: bytes, case: Case) -> Iterator[bytes | memoryview]:
    """What :func:`send` writes, in order: the head, then the body (views of ``case.raw``, never a
    copy of it: the client runs in the proxy's process in the tests and the bench, whose RSS they
    measure), in 64 KiB chunks with their framing when sent chunked."""
    yield head
    body = memoryview(case.raw)
    if case.send != "chunked":
        yield body
        return
    for i in range(0, len(body), 65536):
        c = body[i:i + 65536]
        yield b"%x\r\n" % len(c)
        yield c
        yield b"\r\n"
    yield b"0\r\n\r\n"


def _send_all(s: socket.socket, parts: Iterable[bytes | memoryview], shut: bool) -> None:
    try:
        for part in parts:
            s.sendall(part)
        if shut:
            s.shutdown(socket.SHUT_WR)
    except OSError:  # the server answered and closed first
        pass


def _status(got: bytes | bytearray) -> int | None:
    m = re.match(rb"HTTP/1\.[01] (\d{3})", bytes(got[:16]))
    return int(m.group(1)) if m else None


def _body(got: bytes) -> bytes:
    head, _, body = got.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        return body
    out, i = bytearray(), 0
    while True:
        j = body.find(b"\r\n", i)
        if j < 0:
            return bytes(out)
        n = int(body[i:j].split(b";")[0] or b"0", 16)
        if n == 0:
            return bytes(out)
        out += body[j + 2:j + 2 + n]
        i = j + 2 + n + 2


# ------------------------------------------------------------------------------ checking
def problems(case: Case, ans: Answer, records: list[bool] | None) -> list[str]:
    """What is wrong with ``ans`` to ``case``: ``records`` is the delivered flag of each record the
    execution holds (``None``: not checked)."""
    out = []
    st = ans.status
    if ans.hung:
        return [f"no answer within {ans.elapsed_s:.1f} s"]
    if st is None:
        if case.expect != "4xx_or_closed":
            out.append("closed without an answer")
        return out
    if st >= 500:
        out.append(f"status {st}: {ans.body[:300]!r}")
    want = {"200": st == 200, "400": st == 400, "413": st == 413, "4xx": 400 <= st < 500,
            "any": st == 200 or 400 <= st < 500, "4xx_or_closed": 400 <= st < 500}[case.expect]
    if not want and st < 500:
        out.append(f"status {st}, expected {case.expect}: {ans.body[:300]!r}")
    if 400 <= st < 500:
        out += _error_shape(case.api, st, ans.body)
    if st == 200:
        out += _whole(case, ans.body)
    if records is not None:
        answered = st == 200 and case.api != "count_tokens"
        if answered and (len(records) != 1 or not records[0]):
            out.append(f"answered, but the execution holds records {records} (expected one delivered)")
        if not answered and records:
            out.append(f"not answered ({st}), but the execution holds records {records}")
    return out


def _error_shape(api: str, status: int, body: bytes) -> list[str]:
    try:
        e = json.loads(body)
    except ValueError:
        return [f"{status} body is not JSON: {body[:200]!r}"]
    if api in ("anthropic", "count_tokens"):
        ok = (isinstance(e, dict) and e.get("type") == "error" and isinstance(e.get("error"), dict)
              and isinstance(e["error"].get("message"), str) and isinstance(e["error"].get("type"), str))
        if ok and status == 413 and e["error"]["type"] != "request_too_large":
            return [f"413 with Anthropic error type {e['error']['type']!r}"]
    else:
        err = e.get("error") if isinstance(e, dict) else None
        ok = isinstance(err, dict) and isinstance(err.get("message"), str) and {"type", "param", "code"} <= set(err)
    return [] if ok else [f"{status} not in the {api} error shape: {body[:200]!r}"]


def _whole(case: Case, body: bytes) -> list[str]:
    if case.stream and case.api in MODEL_APIS:
        if END_MARK[case.api] not in body and not (case.api == "responses" and b"response.incomplete" in body):
            return [f"200 stream without its closing event: {body[-200:]!r}"]
        if b"event: error" in body or b"response.failed" in body or b'data: {"error"' in body:
            return [f"200 stream with an error event: {body[-300:]!r}"]
        return []
    try:
        v = json.loads(body)
    except ValueError:
        return [f"200 body is not JSON: {body[:200]!r}"]
    key = {"anthropic": "content", "chat": "choices", "responses": "output", "count_tokens": "input_tokens"}[case.api]
    return [] if isinstance(v, dict) and key in v else [f"200 body without {key!r}: {body[:200]!r}"]


# ------------------------------------------------------------------------------ memory
def _status_kib(name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    return 0


def rss_mark() -> int:
    """Collect garbage, reset this process's peak RSS (``/proc/self/clear_refs``), return the RSS
    (bytes): :func:`rss_growth` then gives the peak above it."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_kib("VmRSS") * 1024


def rss_growth(mark: int) -> int:
    """The peak RSS since :func:`rss_mark` above its mark (bytes)."""
    return max(_status_kib("VmHWM"), _status_kib("VmRSS")) * 1024 - mark


def rss_held(mark: int) -> int:
    """This process's RSS now, garbage collected, above a :func:`rss_mark` mark (bytes): what a call
    left behind, kept by design or kept by the allocator."""
    gc.collect()
    return _status_kib("VmRSS") * 1024 - mark


class Others:
    """Small valid Chat calls of another execution, one after another with 50 ms pauses, in a thread:
    :meth:`take` returns (and forgets) their latencies (seconds) and failures so far."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.lat: list[float] = []
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        import httpx

        body = dumps(valid("chat", max_tokens=4))
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    r = c.post(PATHS["chat"], content=body, headers=headers_for("chat", self.key))
                    if r.status_code != 200:
                        self.failed.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as exc:
                    self.failed.append(repr(exc))
                self.lat.append(time.monotonic() - t0)
                self._stop.wait(0.05)

    def take(self) -> tuple[list[float], list[str]]:
        lat, failed = self.lat, self.failed
        self.lat, self.failed = [], []
        return lat, failed

    def stop(self) -> None:
        self._stop.set()
        self._t.join(60)


def wait_until(pred: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True
