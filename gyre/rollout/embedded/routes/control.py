"""The embedded engine's control and status routes: ``/abort_request``, ``/pause_generation``,
``/continue_generation``, ``/release_memory_occupation``, ``/resume_memory_occupation``,
``/flush_cache``; ``/health``, ``/health_generate``, ``/model_info``, ``/get_weight_version`` and
``/server_info``.  An unknown rid on abort answers 400 with ``"success": false``; memory release
requires no running request."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import Request

from gyre.rollout.api.sglang_api import SamplingParams, SeqOutput, SeqSpec
from gyre.rollout.api.sglang_control_api import parse_abort, parse_pause, parse_tags
from gyre.rollout.embedded.core import EngineCore
from gyre.rollout.embedded.routes.common import EngineRoutes, error, read_json

#: Seconds ``/health_generate`` waits for its one-token generation before answering 503.
HEALTH_CHECK_TIMEOUT_S = 20.0


class ControlRoutes(EngineRoutes):
    """Abort, pause and continue, memory, the prefix cache, health and information."""

    async def abort_request(self, request: Request):
        rid, abort_all = parse_abort(await read_json(request))
        aborted = await self.run(lambda core: core.abort(rid, abort_all=abort_all))
        if not abort_all and not aborted:
            msg = f"no running or waiting request with rid {rid!r}"
            return error(msg, success=False, message=msg)
        return {"success": True, "message": f"aborted {len(aborted)} request(s)", "aborted": aborted}

    async def pause_generation(self, request: Request):
        mode = parse_pause(await read_json(request))
        affected = await self.run(lambda core: core.pause(mode))
        return {"success": True, "status": "ok", "mode": mode, "affected": affected,
                "message": "Generation paused successfully."}

    async def continue_generation(self, request: Request):
        await self.run(lambda core: core.continue_generation())
        return {"success": True, "status": "ok", "message": "Generation continued successfully."}

    async def release_memory(self, request: Request):
        tags = parse_tags(await read_json(request), "release_memory_occupation")
        engine = self.engine

        def do(core: EngineCore):
            core.release(tags)
            if "kv_cache" in tags:
                engine.runner.release_kv()
            if "weights" in tags:
                engine.runner.release_weights()

        await self.run(do)
        return {"success": True, "message": f"released {', '.join(tags)}", "tags": list(tags)}

    async def resume_memory(self, request: Request):
        tags = parse_tags(await read_json(request), "resume_memory_occupation")
        engine = self.engine

        def do(core: EngineCore):
            if "weights" in tags:
                engine.runner.resume_weights()
            core.resume(tags)

        await self.run(do)
        return {"success": True, "message": f"resumed {', '.join(tags)}", "tags": list(tags)}

    async def flush_cache(self):
        await self.run(lambda core: core.flush_cache())
        return {"success": True, "message": "Cache flushed."}

    async def health(self):
        if not self.engine.alive:
            return error("engine stopped", 503)
        return {"status": "ok"}

    async def health_generate(self):
        engine = self.engine
        if not engine.alive or engine.runner.weights_released:
            return error("engine not ready", 503)
        if engine.core.paused is not None or engine.core.released:
            return {"status": "ok", "paused": True}
        spec = SeqSpec(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", group_rid="", index=0, input_ids=[0],
                       params=SamplingParams(max_new_tokens=1, temperature=0.0), seed=0)
        done = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()

        def sink(out: SeqOutput) -> None:
            if out.finished:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(out))

        await self.run(lambda core: core.add([spec], sink))
        try:
            await asyncio.wait_for(done, HEALTH_CHECK_TIMEOUT_S)
        except asyncio.TimeoutError:
            engine.call(lambda core: core.abort(spec.rid))
            return error("health check generation timed out", 503)
        return {"status": "ok"}

    async def get_model_info(self):
        engine = self.engine
        return {"model_path": engine.model_path, "tokenizer_path": engine.tokenizer_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": engine.core.version,
                "served_model_name": self.cfg.served_model_name or engine.model_path}

    async def get_weight_version(self):
        """SGLang before 0.5.10 has this route; newer SGLang answers 404 here."""
        return {"weight_version": self.engine.core.version}

    async def get_server_info(self):
        engine = self.engine
        state = await self.run(lambda core: {**core.stats(), **engine.runner.describe()})
        return {**engine.server_info(), "internal_states": [state]}
