"""SGLang's native HTTP API over the embedded engine: the FastAPI app and its uvicorn server.

:func:`build_app` serves an :class:`~gyre.rollout.embedded.engine.EmbeddedEngine` through
SGLang's native routes (generation, abort, pause/continue, memory release/resume, cache flush,
weight updates and versions, health and info; bodies parsed and built by
:mod:`gyre.rollout.embedded.sglang_api`). :class:`EngineServer` runs it with uvicorn on a socket, from a
background thread (:meth:`~EngineServer.start`) or the calling thread
(:meth:`~EngineServer.serve_forever`, used by :mod:`gyre.rollout.embedded.serve`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gyre.rollout.embedded.config import EngineConfig
from gyre.rollout.embedded.core import EngineCore
from gyre.rollout.embedded.engine import EmbeddedEngine
from gyre.rollout.embedded.kv_transfer import (KVPayloadError, MooncakeKVStage, check_fits, check_handle,
                                               decode_kv_payload, encode_kv_payload, kv_layout)
from gyre.rollout.embedded.model_runner import WeightError, read_weights
from gyre.rollout.embedded.sglang_api import (
    IncrementalDetokenizer,
    ProtocolError,
    SamplingParams,
    SeqOutput,
    SeqSpec,
    build_meta_info,
    error_body,
    final_text,
    logprob_triples,
    parse_generate,
    top_logprob_triples,
)
from gyre.rollout.embedded.sglang_control_api import (
    parse_abort,
    parse_destroy_weights_update_group,
    parse_init_weights_update_group,
    parse_pause,
    parse_tags,
    parse_update_from_disk,
    parse_update_from_distributed,
    parse_update_from_tensor,
    parse_update_weight_version,
)
from gyre.rollout.ports import bind_socket
from gyre.rollout.weights import deserialize_named_tensors
from gyre.transfer_engine import TransferEngineError

HEALTH_CHECK_TIMEOUT_S = 20.0


# ---------------------------------------------------------------------------- HTTP app


def _json_response(content: Any, status_code: int = 200):
    return JSONResponse(content, status_code=status_code)


def _error(msg: str, code: int = 400, **extra):
    body = error_body(msg, code)
    body.update(extra)
    return _json_response(body, code)


async def _read_json(request) -> Any:
    raw = await request.body()
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ProtocolError("body is not valid JSON") from None


class _Acc:
    """Accumulated output of one sequence on the HTTP side."""

    __slots__ = ("spec", "ids", "logprobs", "tops", "last", "sent_text", "sent_ids", "detok")

    def __init__(self, spec: SeqSpec, decode: Callable[[list[int], bool], str] | None = None):
        self.spec = spec
        self.detok = IncrementalDetokenizer(decode, spec.params.skip_special_tokens) if decode else None
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list = []
        self.last: SeqOutput | None = None
        self.sent_text = ""
        self.sent_ids = 0

    def absorb(self, out: SeqOutput) -> None:
        self.ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs)
        if out.new_top_logprobs:
            self.tops.extend(out.new_top_logprobs)
        self.last = out

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished


def build_app(engine: EmbeddedEngine, kv_stage: MooncakeKVStage | None = None):
    """FastAPI app exposing ``engine`` through SGLang's native endpoints.

    Routes: ``POST /generate`` (one JSON answer, or SSE ``data: {...}`` chunks then
    ``data: [DONE]``), ``/abort_request``, ``/pause_generation``, ``/continue_generation``,
    ``/release_memory_occupation``, ``/resume_memory_occupation``, ``/flush_cache``,
    ``/update_weights_from_disk``, ``/update_weights_from_tensor``, ``/update_weight_version``;
    ``GET /health``, ``/health_generate``, ``/model_info`` (also ``/get_model_info``),
    ``/server_info`` (also ``/get_server_info``), ``/get_weight_version``.  Gyre's own:
    ``POST /gyre/export_kv`` (``{"input_ids"}`` -> the KV
    payload of the longest prefix held, :mod:`gyre.rollout.embedded.kv_transfer`, with ``X-Cached-Tokens``;
    JSON ``cached_tokens: 0`` when none; with ``"transport": "mooncake"`` the payload is staged and
    pinned in ``kv_stage`` and the answer is JSON ``{"cached_tokens", "mooncake": handle}``),
    ``POST /gyre/import_kv`` (payload bytes, or JSON ``{"mooncake": handle}`` read from the source
    engine over Mooncake -> stored in the prefix cache; a payload of other weights or another
    layout, or a failed read, answers 400) and ``POST /gyre/release_kv`` (``{"pin"}``: the source
    drops a staged payload).  ``kv_stage`` defaults to a Mooncake stage on 127.0.0.1.

    Bad input answers 400 ``{"error": {"message", "code"}}``; an unknown rid on abort answers
    400 with ``"success": false``.  ``/init_weights_update_group``,
    ``/update_weights_from_distributed`` and ``/destroy_weights_update_group`` receive weights by
    broadcast from a trainer (:mod:`gyre.rollout.weight_group`); ``/update_weights_from_ipc``
    answers 400 (not supported). Tensor updates take base64 ``torch.save`` payloads
    (:func:`gyre.rollout.weights.serialize_named_tensors`) or, with ``load_format
    "flattened_bucket"``, shared-memory buckets (:mod:`gyre.rollout.tensor_bucket`); memory release requires no running
    request. Streams are incremental by default (``incremental_streaming_output``), cumulative
    otherwise; text that could still become a stop string, or an incomplete UTF-8 character, is
    held back until it cannot.
    """
    app = FastAPI(title="Gyre embedded engine", openapi_url=None)
    kv_stage = kv_stage if kv_stage is not None else MooncakeKVStage()
    app.state.engine = engine
    cfg = engine.config

    @app.exception_handler(ProtocolError)
    async def _protocol_error(request, exc: ProtocolError):
        return _error(str(exc))

    @app.exception_handler(WeightError)
    async def _weight_error(request, exc: WeightError):
        return _error(str(exc), success=False)

    async def run(fn: Callable[[EngineCore], Any]) -> Any:
        return await asyncio.wrap_future(engine.call(fn))

    def meta_for(acc: _Acc, ids: list[int], lps: list[float], tops: list, finish) -> dict[str, Any]:
        out, spec = acc.last, acc.spec
        tt = engine.token_text if spec.return_text_in_logprobs else None
        return build_meta_info(
            rid=spec.rid, finish_reason=finish, prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens,
            weight_version=out.weight_version,
            output_token_logprobs=logprob_triples(lps, ids, tt) if spec.return_logprob else None,
            output_top_logprobs=top_logprob_triples(tops, tt) if spec.top_logprobs_num and spec.return_logprob
            else None,
            e2e_latency=out.e2e_latency)

    def final_dict(acc: _Acc) -> dict[str, Any]:
        finish = acc.last.finish_reason
        text = final_text(acc.ids, finish, acc.spec.params, engine.decode if engine.tokenizer else None)
        return {"text": text, "output_ids": list(acc.ids),
                "meta_info": meta_for(acc, acc.ids, acc.logprobs, acc.tops, finish)}

    def visible_text(acc: _Acc) -> str:
        """Text so far, holding back what may still turn into a stop string or a partial char."""
        if acc.finished:
            return final_text(acc.ids, acc.last.finish_reason, acc.spec.params,
                              engine.decode if engine.tokenizer else None)
        if acc.detok is None:
            return ""
        text = acc.detok.text(acc.ids)
        if acc.spec.params.stop:
            hold = max(len(s) for s in acc.spec.params.stop) - 1
            text = text[: max(len(acc.sent_text), len(text) - hold)] if hold else text
        return text

    def chunk_dict(acc: _Acc) -> dict[str, Any]:
        text = visible_text(acc)
        finish = acc.last.finish_reason
        if cfg.incremental_streaming_output:
            k = acc.sent_ids
            start = len(acc.sent_text) if text.startswith(acc.sent_text) else 0
            body = {"text": text[start:], "output_ids": acc.ids[k:],
                    "meta_info": meta_for(acc, acc.ids[k:], acc.logprobs[k:], acc.tops[k:], finish)}
        else:
            body = {"text": text, "output_ids": list(acc.ids),
                    "meta_info": meta_for(acc, acc.ids, acc.logprobs, acc.tops, finish)}
        body["index"] = acc.spec.index
        acc.sent_text, acc.sent_ids = text, len(acc.ids)
        return body

    def abort_later(rids: list[str], why: str) -> None:
        for rid in rids:
            engine.call(lambda core, r=rid: core.abort(r, message=why))

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        body = await _read_json(request)
        req = parse_generate(body, vocab_size=engine.runner.vocab_size, context_len=engine.runner.context_len,
                             tokenize=engine.tokenize if engine.tokenizer is not None else None)
        specs = req.expand()
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(out: SeqOutput) -> None:
            loop.call_soon_threadsafe(q.put_nowait, out)

        await run(lambda core: core.add(specs, sink))
        accs = {s.index: _Acc(s, engine.decode if (req.stream and engine.tokenizer is not None) else None)
                for s in specs}

        if req.stream:
            async def events():
                pending = set(accs)
                try:
                    while pending:
                        out = await q.get()
                        acc = accs[out.index]
                        acc.absorb(out)
                        if out.finished:
                            pending.discard(out.index)
                        yield f"data: {json.dumps(chunk_dict(acc))}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    if pending:
                        abort_later([accs[i].spec.rid for i in pending], "client disconnected")

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        pending = set(accs)
        while pending:
            try:
                out = await asyncio.wait_for(q.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    abort_later([accs[i].spec.rid for i in pending], "client disconnected")
                    return _error("client disconnected", 499)
                continue
            accs[out.index].absorb(out)
            if out.finished:
                pending.discard(out.index)
        results = [final_dict(accs[i]) for i in sorted(accs)]
        return results[0] if req.single else results

    @app.post("/abort_request")
    async def abort_request(request: Request):
        rid, abort_all = parse_abort(await _read_json(request))
        aborted = await run(lambda core: core.abort(rid, abort_all=abort_all))
        if not abort_all and not aborted:
            msg = f"no running or waiting request with rid {rid!r}"
            return _error(msg, success=False, message=msg)
        return {"success": True, "message": f"aborted {len(aborted)} request(s)", "aborted": aborted}

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        mode = parse_pause(await _read_json(request))
        affected = await run(lambda core: core.pause(mode))
        return {"success": True, "status": "ok", "mode": mode, "affected": affected,
                "message": "Generation paused successfully."}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await run(lambda core: core.continue_generation())
        return {"success": True, "status": "ok", "message": "Generation continued successfully."}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory(request: Request):
        tags = parse_tags(await _read_json(request), "release_memory_occupation")

        def do(core: EngineCore):
            core.release(tags)
            if "kv_cache" in tags:
                engine.runner.release_kv()
            if "weights" in tags:
                engine.runner.release_weights()

        await run(do)
        return {"success": True, "message": f"released {', '.join(tags)}", "tags": list(tags)}

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory(request: Request):
        tags = parse_tags(await _read_json(request), "resume_memory_occupation")

        def do(core: EngineCore):
            if "weights" in tags:
                engine.runner.resume_weights()
            core.resume(tags)

        await run(do)
        return {"success": True, "message": f"resumed {', '.join(tags)}", "tags": list(tags)}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        await run(lambda core: core.flush_cache())
        return {"success": True, "message": "Cache flushed."}

    async def do_update(named, source, upd):
        if engine.runner.weights_released:
            raise WeightError("weights are released; resume_memory_occupation(tags=['weights']) first")
        engine.runner.check_weights(named, require_all=source is not None)
        return await asyncio.wrap_future(
            engine.update_weights(named, source=source, version=upd.weight_version, abort=upd.abort_all_requests,
                                  flush=upd.flush_cache))

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        upd = parse_update_from_disk(await _read_json(request))
        if upd.load_format not in (None, "auto", "safetensors", "pt"):
            raise ProtocolError(f"load_format {upd.load_format!r} is not supported by the embedded engine")
        named = await asyncio.to_thread(read_weights, upd.source)
        return await do_update(named, str(upd.source), upd)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        upd = parse_update_from_tensor(await _read_json(request))
        named = await asyncio.to_thread(deserialize_named_tensors, upd.source, upd.load_format)
        return await do_update(named, None, upd)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        version, abort = parse_update_weight_version(await _read_json(request))

        def do(core: EngineCore):
            if abort:
                core.abort(abort_all=True, message="aborted: weight version update")
            core.version = version

        await run(do)
        return {"success": True, "message": f"Weight version updated to {version}", "new_version": version}

    def layout() -> dict:
        r = engine.runner
        return kv_layout(r.num_layers, r.num_kv_heads, r.head_dim, r.dtype)

    @app.post("/gyre/export_kv")
    async def export_kv(request: Request):
        body = await _read_json(request)
        ids = body.get("input_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
            raise ProtocolError("input_ids must be a non-empty list of token ids")
        transport = body.get("transport", "http")
        if transport not in ("http", "mooncake"):
            raise ProtocolError(f"transport must be \"http\" or \"mooncake\", not {transport!r}")
        m, kv, version = await run(lambda core: (*core.export_prefix(ids), core.version))
        if not m:
            return _json_response({"success": True, "cached_tokens": 0})
        data = await asyncio.to_thread(encode_kv_payload, kv, ids[:m], version, layout())
        if transport == "http":
            return Response(data, media_type="application/octet-stream", headers={"X-Cached-Tokens": str(m)})
        try:
            handle = await asyncio.to_thread(kv_stage.stage, data)
        except TransferEngineError as exc:
            return _error(str(exc), success=False)
        return {"success": True, "cached_tokens": m, "mooncake": handle}

    @app.post("/gyre/import_kv")
    async def import_kv(request: Request):
        try:
            if request.headers.get("content-type", "").startswith("application/json"):
                body = await _read_json(request)
                handle = check_handle(body.get("mooncake") if isinstance(body, dict) else None)
                data = await asyncio.to_thread(kv_stage.fetch, handle)
            else:
                data = await request.body()
            payload = await asyncio.to_thread(decode_kv_payload, data)

            def do(core: EngineCore) -> int:
                check_fits(payload, core.version, layout())
                return core.import_prefix(payload.token_ids, payload.kv)

            added = await run(do)
        except (KVPayloadError, TransferEngineError) as exc:
            return _error(str(exc), success=False)
        return {"success": True, "imported_tokens": added, "tokens": len(payload.token_ids), "bytes": len(data)}

    @app.post("/gyre/release_kv")
    async def release_kv(request: Request):
        body = await _read_json(request)
        pin = body.get("pin") if isinstance(body, dict) else None
        if type(pin) is not int:
            raise ProtocolError("pin must be an integer")
        return {"success": True, "released": kv_stage.release(pin)}

    groups: dict = {}  # group_name -> WeightGroup this engine joined

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        from gyre.rollout.weight_group import open_weight_group

        spec = parse_init_weights_update_group(await _read_json(request))
        if spec.group_name in groups:
            raise WeightError(f"already in weight-update group {spec.group_name!r}")
        try:
            groups[spec.group_name] = await asyncio.to_thread(
                open_weight_group, spec.master_address, spec.master_port, spec.rank_offset, spec.world_size,
                group_name=spec.group_name, backend=spec.backend)
        except Exception as exc:  # the trainer did not come, or the address is wrong
            raise WeightError(f"joining weight-update group {spec.group_name!r} at {spec.master_address}:"
                              f"{spec.master_port} failed: {type(exc).__name__}: {exc}") from None
        return {"success": True, "message": f"joined {spec.group_name} as rank {spec.rank_offset} of "
                                            f"{spec.world_size}"}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        upd = parse_update_from_distributed(await _read_json(request))
        group = groups.get(upd.group_name)
        if group is None:
            raise WeightError(f"no weight-update group {upd.group_name!r} (call /init_weights_update_group first)")
        device = engine.runner.device if group.backend == "nccl" else "cpu"

        def receive() -> dict:
            import torch

            named = {}
            for name, dtype, shape in zip(upd.names, upd.dtypes, upd.shapes):
                t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                group.broadcast(t)
                named[name] = t
            return named

        try:
            named = await asyncio.to_thread(receive)
        except Exception as exc:
            raise WeightError(f"receiving {len(upd.names)} tensors over {upd.group_name!r} failed: "
                              f"{type(exc).__name__}: {exc}") from None
        return await do_update(named, None, upd.update)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        from gyre.rollout.weight_group import close_weight_group

        name = parse_destroy_weights_update_group(await _read_json(request))
        group = groups.pop(name, None)
        if group is None:
            raise WeightError(f"no weight-update group {name!r}")
        close_weight_group(group)
        return {"success": True, "message": f"left {name}"}

    async def _unsupported(request: Request):
        msg = "/update_weights_from_ipc is not supported by the embedded engine; use /update_weights_from_tensor"
        return _error(msg, success=False, message=msg)

    app.add_api_route("/update_weights_from_ipc", _unsupported, methods=["POST"])

    @app.get("/health")
    async def health():
        if not engine.alive:
            return _error("engine stopped", 503)
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate():
        if not engine.alive or engine.runner.weights_released:
            return _error("engine not ready", 503)
        if engine.core.paused is not None or engine.core.released:
            return {"status": "ok", "paused": True}
        spec = SeqSpec(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", group_rid="", index=0, input_ids=[0],
                       params=SamplingParams(max_new_tokens=1, temperature=0.0), seed=0)
        done = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()

        def sink(out: SeqOutput) -> None:
            if out.finished:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(out))

        await run(lambda core: core.add([spec], sink))
        try:
            await asyncio.wait_for(done, HEALTH_CHECK_TIMEOUT_S)
        except asyncio.TimeoutError:
            engine.call(lambda core: core.abort(spec.rid))
            return _error("health check generation timed out", 503)
        return {"status": "ok"}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        return {"model_path": engine.model_path, "tokenizer_path": engine.tokenizer_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": engine.core.version,
                "served_model_name": cfg.served_model_name or engine.model_path}

    @app.get("/get_weight_version")  # SGLang before 0.5.10; newer SGLang answers 404 here
    async def get_weight_version():
        return {"weight_version": engine.core.version}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        state = await run(lambda core: {**core.stats(), **engine.runner.describe()})
        return {**engine.server_info(), "internal_states": [state]}

    return app


# ---------------------------------------------------------------------------- uvicorn shell


class EngineServer:
    """An :class:`EmbeddedEngine` behind uvicorn on ``host:port``.

    ``start()`` serves from a background thread (tests, benchmarks, a cell process);
    ``serve_forever()`` serves in the calling (main) thread until :meth:`request_stop`, e.g.
    from a signal handler.  ``url`` is ``http://host:port`` once bound.
    """

    def __init__(self, config: EngineConfig | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning"):
        import uvicorn

        self.engine = EmbeddedEngine(config)
        self.sock = bind_socket(host, port)
        self.app = build_app(self.engine, MooncakeKVStage(host))
        self.host, self.port = host, self.sock.getsockname()[1]
        ucfg = uvicorn.Config(self.app, log_level=log_level, access_log=False, lifespan="off",
                              timeout_graceful_shutdown=5, timeout_keep_alive=30)

        class _Server(uvicorn.Server):
            def capture_signals(self):  # the owner handles signals
                return contextlib.nullcontext()

        self.server = _Server(ucfg)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "EngineServer":
        """Serve in a background thread; return once requests are accepted."""
        self.engine.start()
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="gyre-engine-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("embedded engine HTTP server failed to start")
            time.sleep(0.01)
        return self

    def serve_forever(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve in this thread until :meth:`request_stop`; ``on_ready`` runs once accepting."""
        self.engine.start()
        if on_ready is not None:
            def watch():
                while not self.server.started and not self.server.should_exit:
                    time.sleep(0.01)
                if self.server.started:
                    on_ready()

            threading.Thread(target=watch, daemon=True).start()
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.engine.shutdown()
            self.sock.close()

    def request_stop(self) -> None:
        """Abort in-flight requests and make the server exit (safe from signal handlers)."""
        if self.engine.alive:
            self.engine.call(lambda core: (core.continue_generation(),
                                           core.abort(abort_all=True, message="engine shutting down")))
        self.server.should_exit = True

    def stop(self, timeout: float = 15.0) -> None:
        """Stop a server started with :meth:`start`."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.shutdown()
        self.sock.close()

    def client(self, timeout: float | None = 600.0):
        """An :class:`~gyre.rollout.client.engine_client.EngineClient` for this server."""
        from gyre.rollout.client.engine_client import EngineClient

        return EngineClient(self.url, timeout=timeout)

    def __enter__(self) -> "EngineServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
