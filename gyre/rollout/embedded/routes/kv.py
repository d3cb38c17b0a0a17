"""Gyre's own KV routes on the embedded engine (:mod:`gyre.rollout.embedded.kv_transfer`).

``POST /gyre/export_kv`` (``{"input_ids"}`` -> the KV payload of the longest prefix held, with
``X-Cached-Tokens``; JSON ``cached_tokens: 0`` when none; with ``"transport": "mooncake"`` the
payload is staged and pinned in the Mooncake stage and the answer is JSON ``{"cached_tokens",
"mooncake": handle}``), ``POST /gyre/import_kv`` (payload bytes, or JSON ``{"mooncake": handle}``
read from the source engine over Mooncake -> stored in the prefix cache; a payload of other
weights or another layout, or a failed read, answers 400) and ``POST /gyre/release_kv``
(``{"pin"}``: the source drops a staged payload).
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response

from gyre.rollout.api.sglang_api import ProtocolError
from gyre.rollout.embedded.core import EngineCore
from gyre.rollout.embedded.engine import EmbeddedEngine
from gyre.rollout.embedded.kv_transfer import (KVPayloadError, MooncakeKVStage, check_fits, check_handle,
                                               decode_kv_payload, encode_kv_payload, kv_layout)
from gyre.rollout.embedded.routes.common import EngineRoutes, error, json_response, read_json
from gyre.transfer_engine import TransferEngineError


class KVRoutes(EngineRoutes):
    """KV export, import and release, staging payloads in ``kv_stage`` for Mooncake reads."""

    def __init__(self, engine: EmbeddedEngine, kv_stage: MooncakeKVStage):
        super().__init__(engine)
        self.kv_stage = kv_stage

    def layout(self) -> dict:
        r = self.engine.runner
        return kv_layout(r.num_layers, r.num_kv_heads, r.head_dim, r.dtype)

    async def export_kv(self, request: Request):
        body = await read_json(request)
        ids = body.get("input_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
            raise ProtocolError("input_ids must be a non-empty list of token ids")
        transport = body.get("transport", "http")
        if transport not in ("http", "mooncake"):
            raise ProtocolError(f"transport must be \"http\" or \"mooncake\", not {transport!r}")
        m, kv, version = await self.run(lambda core: (*core.export_prefix(ids), core.version))
        if not m:
            return json_response({"success": True, "cached_tokens": 0})
        data = await asyncio.to_thread(encode_kv_payload, kv, ids[:m], version, self.layout())
        if transport == "http":
            return Response(data, media_type="application/octet-stream", headers={"X-Cached-Tokens": str(m)})
        try:
            handle = await asyncio.to_thread(self.kv_stage.stage, data)
        except TransferEngineError as exc:
            return error(str(exc), success=False)
        return {"success": True, "cached_tokens": m, "mooncake": handle}

    async def import_kv(self, request: Request):
        try:
            if request.headers.get("content-type", "").startswith("application/json"):
                body = await read_json(request)
                handle = check_handle(body.get("mooncake") if isinstance(body, dict) else None)
                data = await asyncio.to_thread(self.kv_stage.fetch, handle)
            else:
                data = await request.body()
            payload = await asyncio.to_thread(decode_kv_payload, data)

            def do(core: EngineCore) -> int:
                check_fits(payload, core.version, self.layout())
                return core.import_prefix(payload.token_ids, payload.kv)

            added = await self.run(do)
        except (KVPayloadError, TransferEngineError) as exc:
            return error(str(exc), success=False)
        return {"success": True, "imported_tokens": added, "tokens": len(payload.token_ids), "bytes": len(data)}

    async def release_kv(self, request: Request):
        body = await read_json(request)
        pin = body.get("pin") if isinstance(body, dict) else None
        if type(pin) is not int:
            raise ProtocolError("pin must be an integer")
        return {"success": True, "released": self.kv_stage.release(pin)}
