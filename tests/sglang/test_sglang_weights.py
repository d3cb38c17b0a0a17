"""Live weight pushes to a real SGLang server while a request runs: SGLang's own tensor payload
(host tensors by shared memory) and the weight-update group (gloo broadcast).  After a push no
prefix computed under the old weights is reused, the new log-probs are those of the new weights,
and the request that spanned the push came back aborted under the old version (the proxy retries
it on the new one); the server's log stays clean."""

from __future__ import annotations

import threading
import time

import pytest
import torch

PROMPT = list(range(300, 460))  # 160 tokens: several pages of prefix to reuse


def _weights(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def _perturbed(weights: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (v.float() + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in weights.items()}


def _hf_logprobs(model_dir, weights: dict, prompt: list[int], output: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    if missing:
        model.tie_weights()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + output])).logits[0].float(), -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def _greedy(client, prompt=PROMPT):
    return client.generate(prompt, {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
                           return_logprob=True)


def _push_while_running(cell_server, cell_client, weights: dict, version: str):
    """Start a long request, push ``weights`` live as ``version`` in two buckets, return the request."""
    box = {}

    def run():
        with cell_server.client() as c:
            box["res"] = c.generate(list(range(20, 60)), {"max_new_tokens": 900, "ignore_eos": True},
                                    return_logprob=True)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.5)
    names = sorted(weights)
    buckets = [{k: weights[k] for k in names[: len(names) // 2]}, {k: weights[k] for k in names[len(names) // 2:]}]
    from gyre.rollout.weights import push_weight_buckets

    assert push_weight_buckets(cell_client, iter(buckets), version, live=True) == len(names)
    t.join(120)
    return box["res"]


@pytest.mark.parametrize("path", ["tensor", "distributed"])
def test_a_live_push_leaves_no_old_prefix_and_serves_the_new_weights(cell_server, sglang_model_dir, path):
    from gyre.rollout.sglang_driver.weights import SGLangGroupClient, SGLangTensorClient

    seed = {"tensor": 1, "distributed": 2}[path]
    with cell_server.client() as c:
        old_version = c.get_weight_version()
        _greedy(c)
        before = _greedy(c)
        assert before.cached_tokens >= 128  # the prefix cache works: the repeat reuses the prompt's KV
        new = _perturbed(_weights(sglang_model_dir), seed)
        if path == "tensor":
            cell = SGLangTensorClient(cell_server.client(), "cpu", 1)
        else:
            cell = SGLangGroupClient(cell_server.client(), 1, "127.0.0.1", group_name=f"gyre_test_{seed}")
        version = str(int(old_version) + 1)
        spanning = _push_while_running(cell_server, cell, new, version)
        if path == "distributed":
            cell.close()
        after = _greedy(c)
        assert c.get_weight_version() == version == after.weight_version
    assert spanning.aborted and spanning.weight_version == old_version  # retried by the proxy, on `version`
    assert after.cached_tokens == 0, "a prefix computed under the old weights was reused"
    ref = _hf_logprobs(sglang_model_dir, new, PROMPT, after.output_ids)
    diff = max(abs(a - b) for a, b in zip(after.output_logprobs, ref))
    old_ref = _hf_logprobs(sglang_model_dir, _weights(sglang_model_dir), PROMPT, after.output_ids)
    print(f"{path} push: cached_tokens {before.cached_tokens} -> {after.cached_tokens}; "
          f"log-prob diff vs new weights {diff:.2e}, vs old {max(abs(a - b) for a, b in zip(after.output_logprobs, old_ref)):.2e}")
    assert diff <= 1e-3


def test_a_push_whose_second_bucket_fails_serves_nothing_until_a_push_succeeds(cell_server, sglang_model_dir):
    """SGLang sets the new version label at the first bucket it loads: after the second bucket fails,
    the engine holds half-new weights under the new label.  It stays paused (a request sent now waits,
    nothing is answered under that label), the push client says it failed; the next push (here: the
    old weights again) continues it, and the waiting request is served under that push's version."""
    from gyre.rollout.client.messages import EngineError
    from gyre.rollout.sglang_driver.weights import SGLangTensorClient, WeightPushFailed
    from gyre.rollout.weights import push_weight_buckets

    old = _weights(sglang_model_dir)
    new = _perturbed(old, 3)
    names = sorted(new)
    third = len(names) // 3
    with cell_server.client(timeout=120) as c:
        failed_version = str(int(c.get_weight_version()) + 1)
        cell = SGLangTensorClient(cell_server.client(timeout=120), "cpu", 1)
        real, loads = cell.client.update_weights_from_tensor, []

        def second_bucket_fails(*args, **kwargs):
            loads.append(kwargs["weight_version"])
            if len(loads) == 2:
                raise EngineError(500, "injected: the second bucket failed")
            return real(*args, **kwargs)

        cell.client.update_weights_from_tensor = second_bucket_fails
        buckets = [{k: new[k] for k in part} for part in (names[:third], names[third:2 * third], names[2 * third:])]
        with pytest.raises(WeightPushFailed, match="second bucket"):
            push_weight_buckets(cell, iter(buckets), failed_version, live=True)
        assert loads == [failed_version] * 2 and "second bucket" in cell.failed
        assert c.get_weight_version() == failed_version  # SGLang's label moved with the first bucket
        box = {}

        def run():
            with cell_server.client(timeout=120) as c2:
                box["res"] = _greedy(c2)

        t = threading.Thread(target=run)
        t.start()
        t.join(5.0)
        assert t.is_alive() and "res" not in box, "a request was served on half-loaded weights"
        del cell.client.update_weights_from_tensor
        restored = str(int(failed_version) + 1)
        assert push_weight_buckets(cell, iter([old]), restored, live=True) == len(old)
        t.join(120)
        assert cell.failed is None and box["res"].weight_version == restored == c.get_weight_version()
        assert box["res"].completion_tokens == 8


def test_after_a_push_without_a_flush_a_prefix_of_the_earlier_weights_is_not_reused(cell_server, sglang_model_dir):
    """The proxy's engine adapter keys each request to SGLang by the engine's weight version
    (``extra_key``): after a push that did not flush the prefix cache, the same prompt through it
    reuses nothing computed under the earlier weights, while an unkeyed request still would."""
    import asyncio

    from gyre.proxy.engines import ClientEngine
    from gyre.rollout.client.async_client import AsyncEngineClient
    from gyre.rollout.sglang_driver.weights import SGLangTensorClient

    keyed, unkeyed = list(range(500, 660)), list(range(700, 860))
    params = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    seen = []

    class Spy(AsyncEngineClient):
        async def stream(self, *args, **kwargs):
            async for ch in super().stream(*args, **kwargs):
                if ch.finished:
                    seen.append((kwargs.get("extra_key"), int(ch.meta_info.get("cached_tokens", 0))))
                yield ch

    async def through_adapter(eng, n):
        async for _ in eng.generate_stream(keyed, dict(params), f"prefix-{n}"):
            pass

    async def go(eng, ns):
        for n in ns:
            await through_adapter(eng, n)

    with cell_server.client(timeout=120) as c:
        old = c.get_weight_version()
        new = str(int(old) + 1)

        async def before():
            async with Spy(cell_server.url) as ac:
                await go(ClientEngine(ac, "cell"), (0, 1))

        asyncio.run(before())
        c.generate(unkeyed, params)
        assert c.generate(unkeyed, params).cached_tokens >= 128
        cell = SGLangTensorClient(cell_server.client(timeout=120), "cpu", 1)
        assert cell.update_weights_from_tensor(_weights(sglang_model_dir), weight_version=new,
                                               flush_cache=False)["success"]
        assert c.get_weight_version() == new
        stale = c.generate(unkeyed, params).cached_tokens  # the push kept the earlier weights' prefixes

        async def after():
            async with Spy(cell_server.url) as ac:
                await go(ClientEngine(ac, "cell"), (2, 3))

        asyncio.run(after())
    print(f"cached tokens through the adapter {seen}; unkeyed after the push {stale}")
    assert stale >= 128
    assert seen[0] == (f"weights-{old}", 0) and seen[1][0] == f"weights-{old}" and seen[1][1] >= 128
    assert seen[2] == (f"weights-{new}", 0), "a prefix computed under the earlier weights was reused"
    assert seen[3][0] == f"weights-{new}" and seen[3][1] >= 128  # the new version's own prefix is reused
