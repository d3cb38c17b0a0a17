"""Client retries: which model call a repeated request belongs to, and the memory kept for them.

A client retry is the same request sent again by the harness's SDK after a timeout or a dropped
connection. It must not become a second sample. :class:`RecentCalls` keeps an execution's last
few calls by a digest of their request bytes (:func:`request_digest`), from the moment the
digest is known -- while the request is still being decoded and prepared the entry is a
:class:`Preparing` placeholder -- and :meth:`RecentCalls.retry_target` says which call a new
request repeats:

* a request whose first copy is still being prepared waits for it (:meth:`Preparing.wait`) and
  then joins the call it became; if the preparation refused it (a 4xx), the retry gets the same
  error, and the placeholder is gone, so a later copy is evaluated afresh;
* a byte-identical request joins a call in flight, or one whose answer did not reach the client
  whole (its record undelivered, or its delivery not settled yet);
* with a retry header (``x-stainless-retry-count`` >= 1) also one that was delivered (the client
  did not get it whole);
* a repeat of a delivered answer without a retry header is a new model call, as are repeats of
  failed calls.

Memory: a committed call keeps only its answer's bytes (:class:`~gyre.proxy.model_call.ModelCall`),
and :class:`RetryMemory` bounds what all executions of a server keep, in bytes
(``ProxyConfig.retry_memory_bytes``): beyond it the oldest kept calls are forgotten (a retry of
one of them is a new call).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Union

import xxhash

from gyre.proxy.errors import ProxyError
from gyre.proxy.model_call import ModelCall

__all__ = ["Preparing", "RecentCalls", "RetryMemory", "request_digest", "retry_count"]


def request_digest(api: str, raw: bytes, content_encoding: str) -> bytes:
    """Digest of one request's bytes (with its API and content encoding), which finds a client's
    retry of the same body among its execution's recent calls: XXH3-128, much faster than SHA-256
    (docs/proxy.md, "The retry digest"). It is not collision-resistant against crafted input;
    bodies are only compared within one execution, so a harness could at most have its own call
    answered with its own earlier answer."""
    h = xxhash.xxh3_128(f"{api}\0{content_encoding.strip().lower()}\0".encode())
    h.update(raw)
    return h.digest()


def retry_count(headers: Any) -> int:
    """The SDK's retry number (``x-stainless-retry-count``; 0 when absent or malformed)."""
    try:
        return max(0, int(headers.get("x-stainless-retry-count", "0")))
    except (TypeError, ValueError):
        return 0


class Preparing:
    """A request still being prepared (decoded, normalised, TITO-prepared): the placeholder a
    byte-identical retry waits on."""

    __slots__ = ("_done", "waiters")

    def __init__(self) -> None:
        self._done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.waiters = 0  #: retries that have waited for it

    def resolve(self, call: ModelCall | None, error: BaseException | None = None) -> None:
        """The preparation ended: in ``call``, or refused with ``error`` (``None``: failed
        otherwise, e.g. cancelled)."""
        if not self._done.done():
            self._done.set_result((call, error))

    async def wait(self) -> ModelCall | None:
        """The call the request became; ``None`` if its preparation failed other than by a
        refusal (evaluate the retry afresh).

        Raises:
            ProxyError: the preparation refused the request: the same status and message.
        """
        self.waiters += 1
        call, error = await asyncio.shield(self._done)
        if isinstance(error, ProxyError):
            raise ProxyError(error.status, error.message, param=error.param)
        return call


Entry = Union[ModelCall, Preparing]


class RetryMemory:
    """The committed calls all executions of one server keep for retries, bounded in bytes.

    Calls enter when committed (:meth:`keep`, with :meth:`ModelCall.nbytes
    <gyre.proxy.model_call.ModelCall.nbytes>`), oldest first out: past ``limit_bytes`` the oldest
    are dropped from their executions' :class:`RecentCalls`.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = int(limit_bytes)
        self.nbytes = 0  #: bytes of the calls kept now
        self.evicted = 0  #: calls forgotten to stay under the limit
        self._calls: collections.OrderedDict[ModelCall, RecentCalls] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._calls)

    def keep(self, call: ModelCall, owner: "RecentCalls") -> None:
        self._calls[call] = owner
        self.nbytes += call.nbytes()
        while self.nbytes > self.limit_bytes and self._calls:
            old, recent = self._calls.popitem(last=False)
            self.nbytes -= old.nbytes()
            self.evicted += 1
            recent._remove(old)

    def forget(self, call: ModelCall) -> None:
        if self._calls.pop(call, None) is not None:
            self.nbytes -= call.nbytes()

    def snapshot(self) -> dict[str, int]:
        """``{"bytes", "calls", "evicted", "limit_bytes"}``."""
        return {"bytes": self.nbytes, "calls": len(self._calls), "evicted": self.evicted,
                "limit_bytes": self.limit_bytes}


class RecentCalls:
    """An execution's last ``size`` model calls (or requests being prepared) by request digest:
    the ones a retry may join. Committed calls are accounted in ``memory``."""

    def __init__(self, size: int = 4, memory: RetryMemory | None = None) -> None:
        self.size = size
        self.memory = memory if memory is not None else RetryMemory(1 << 62)
        self._calls: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._calls)

    def _set(self, digest: bytes, entry: Entry) -> None:
        old = self._calls.pop(digest, None)
        if isinstance(old, ModelCall):
            self.memory.forget(old)
        self._calls[digest] = entry
        while len(self._calls) > self.size:
            _, gone = self._calls.popitem(last=False)
            if isinstance(gone, ModelCall):
                self.memory.forget(gone)

    def reserve(self, digest: bytes) -> Preparing:
        """Register a request being prepared under ``digest``; resolve it with :meth:`add` or
        :meth:`abandon`."""
        slot = Preparing()
        self._set(digest, slot)
        return slot

    def add(self, digest: bytes, call: ModelCall, slot: Preparing | None = None) -> None:
        """``call`` is the model call of the request with ``digest``, reserved as ``slot`` (a
        retry waiting on it joins ``call``, even if more recent requests pushed it out)."""
        call.digest = digest
        self._set(digest, call)
        if slot is not None:
            slot.resolve(call)

    def abandon(self, digest: bytes, slot: Preparing, error: BaseException | None) -> None:
        """The request of ``slot`` was not prepared (``error``): retries waiting on it get the
        same refusal (or evaluate afresh), and later ones do not find it."""
        if self._calls.get(digest) is slot:
            del self._calls[digest]
        slot.resolve(None, error)

    def keep(self, call: ModelCall) -> None:
        """``call`` was committed and holds only its answer: account it (if still here)."""
        if self._calls.get(call.digest) is call:
            self.memory.keep(call, self)

    def drop(self, call: ModelCall) -> None:
        """Forget ``call`` (a failed call: a retry of it generates again)."""
        self._remove(call)
        self.memory.forget(call)

    def _remove(self, call: ModelCall) -> None:
        if self._calls.get(call.digest) is call:
            del self._calls[call.digest]

    def clear(self) -> None:
        """Forget every call (their ``ex`` links back to the execution would keep it in a cycle)."""
        for entry in self._calls.values():
            if isinstance(entry, ModelCall):
                self.memory.forget(entry)
            else:
                entry.resolve(None)
        self._calls.clear()

    def retry_target(self, digest: bytes, retries: int) -> Entry | None:
        """The call (or request being prepared) a request with ``digest`` repeats, if it is a
        client retry (module doc)."""
        entry = self._calls.get(digest)
        if entry is None or isinstance(entry, Preparing):
            return entry
        if entry.error is not None:
            return None
        settled = entry.settled()
        if not entry.done.is_set() or settled is None:  # in flight, or its delivery not settled
            return entry
        if settled is False or retries >= 1:
            return entry
        return None
