"""The embedded engine's weight routes: ``/update_weights_from_disk``,
``/update_weights_from_tensor``, ``/update_weight_version``, and weights received by broadcast from
a trainer over a weight-update group (:mod:`gyre.rollout.weight_group`):
``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``.  ``/update_weights_from_ipc`` answers 400 (not supported).

Tensor updates take base64 ``torch.save`` payloads (:func:`gyre.rollout.weights.serialize_named_tensors`)
or, with ``load_format "flattened_bucket"``, shared-memory buckets (:mod:`gyre.rollout.tensor_bucket`).
A refused update answers 400 with ``"success": false`` (:class:`~gyre.rollout.embedded.model_runner.WeightError`).
"""

from __future__ import annotations

import asyncio

from fastapi import Request

from gyre.rollout.api.sglang_api import ProtocolError
from gyre.rollout.api.sglang_control_api import (
    parse_destroy_weights_update_group,
    parse_init_weights_update_group,
    parse_update_from_disk,
    parse_update_from_distributed,
    parse_update_from_tensor,
    parse_update_weight_version,
)
from gyre.rollout.embedded.core import EngineCore
from gyre.rollout.embedded.engine import EmbeddedEngine
from gyre.rollout.embedded.model_runner import WeightError, read_weights
from gyre.rollout.embedded.routes.common import EngineRoutes, error, read_json
from gyre.rollout.weights import deserialize_named_tensors


class WeightRoutes(EngineRoutes):
    """Weight updates by value, from disk and by broadcast, and the weight version."""

    def __init__(self, engine: EmbeddedEngine):
        super().__init__(engine)
        self.groups: dict = {}  # group_name -> WeightGroup this engine joined

    async def do_update(self, named, source, upd):
        engine = self.engine
        if engine.runner.weights_released:
            raise WeightError("weights are released; resume_memory_occupation(tags=['weights']) first")
        engine.runner.check_weights(named, require_all=source is not None)
        return await asyncio.wrap_future(
            engine.update_weights(named, source=source, version=upd.weight_version, abort=upd.abort_all_requests,
                                  flush=upd.flush_cache))

    async def update_weights_from_disk(self, request: Request):
        upd = parse_update_from_disk(await read_json(request))
        if upd.load_format not in (None, "auto", "safetensors", "pt"):
            raise ProtocolError(f"load_format {upd.load_format!r} is not supported by the embedded engine")
        named = await asyncio.to_thread(read_weights, upd.source)
        return await self.do_update(named, str(upd.source), upd)

    async def update_weights_from_tensor(self, request: Request):
        upd = parse_update_from_tensor(await read_json(request))
        named = await asyncio.to_thread(deserialize_named_tensors, upd.source, upd.load_format)
        return await self.do_update(named, None, upd)

    async def update_weight_version(self, request: Request):
        version, abort = parse_update_weight_version(await read_json(request))

        def do(core: EngineCore):
            if abort:
                core.abort(abort_all=True, message="aborted: weight version update")
            core.version = version

        await self.run(do)
        return {"success": True, "message": f"Weight version updated to {version}", "new_version": version}

    async def init_weights_update_group(self, request: Request):
        from gyre.rollout.weight_group import open_weight_group

        spec = parse_init_weights_update_group(await read_json(request))
        if spec.group_name in self.groups:
            raise WeightError(f"already in weight-update group {spec.group_name!r}")
        try:
            self.groups[spec.group_name] = await asyncio.to_thread(
                open_weight_group, spec.master_address, spec.master_port, spec.rank_offset, spec.world_size,
                group_name=spec.group_name, backend=spec.backend)
        except Exception as exc:  # the trainer did not come, or the address is wrong
            raise WeightError(f"joining weight-update group {spec.group_name!r} at {spec.master_address}:"
                              f"{spec.master_port} failed: {type(exc).__name__}: {exc}") from None
        return {"success": True, "message": f"joined {spec.group_name} as rank {spec.rank_offset} of "
                                            f"{spec.world_size}"}

    async def update_weights_from_distributed(self, request: Request):
        upd = parse_update_from_distributed(await read_json(request))
        group = self.groups.get(upd.group_name)
        if group is None:
            raise WeightError(f"no weight-update group {upd.group_name!r} (call /init_weights_update_group first)")
        device = self.engine.runner.device if group.backend == "nccl" else "cpu"

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
        return await self.do_update(named, None, upd.update)

    async def destroy_weights_update_group(self, request: Request):
        from gyre.rollout.weight_group import close_weight_group

        name = parse_destroy_weights_update_group(await read_json(request))
        group = self.groups.pop(name, None)
        if group is None:
            raise WeightError(f"no weight-update group {name!r}")
        close_weight_group(group)
        return {"success": True, "message": f"left {name}"}

    async def update_weights_from_ipc(self, request: Request):
        msg = "/update_weights_from_ipc is not supported by the embedded engine; use /update_weights_from_tensor"
        return error(msg, success=False, message=msg)
