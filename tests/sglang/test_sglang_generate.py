"""Generation against a real SGLang server: behaviour log-probs, streaming, abort by rid, a prompt
too long for the server, and shutdown with parallel samples in flight."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from tests.sglang.conftest import start_server


def _hf_logprobs(model_dir, prompt: list[int], output: list[int]) -> list[float]:
    """Log-probs of ``output`` after ``prompt`` from a transformers forward of the same tokens (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def test_behaviour_logprobs_equal_an_hf_forward(sglang_server, sglang_model_dir):
    prompt = list(range(100, 140))
    with sglang_server.client() as c:
        greedy = c.generate(prompt, {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True},
                            return_logprob=True)
        sampled = c.generate(prompt, {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True},
                             return_logprob=True)
    diffs = []
    for res in (greedy, sampled):
        assert res.completion_tokens == 24 and len(res.output_logprobs) == 24
        ref = _hf_logprobs(sglang_model_dir, prompt, res.output_ids)
        diffs.append(max(abs(a - b) for a, b in zip(res.output_logprobs, ref)))
    print(f"behaviour log-prob vs HF forward: max |diff| greedy {diffs[0]:.2e}, sampled {diffs[1]:.2e} (48 tokens)")
    assert max(diffs) <= 1e-3


def test_streaming_gives_the_tokens_and_logprobs_of_a_plain_call(sglang_server):
    prompt = list(range(200, 230))
    params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    with sglang_server.client() as c:
        plain = c.generate(prompt, params, return_logprob=True)
        ids, lps, chunks, finish = [], [], 0, None
        for ch in c.stream(prompt, params, return_logprob=True):
            ids += ch.delta_output_ids
            lps += ch.delta_logprobs or []
            chunks += 1
            finish = ch.finish_reason or finish
    assert ids == plain.output_ids and chunks >= 2 and finish.type == "length"
    assert max(abs(a - b) for a, b in zip(lps, plain.output_logprobs)) < 1e-4


def test_abort_by_rid_ends_a_running_request_with_its_partial_output(sglang_server):
    box = {}

    def run():
        with sglang_server.client() as c:
            box["res"] = c.generate(list(range(10, 30)), {"max_new_tokens": 900, "ignore_eos": True},
                                    rid="gyre-abort-1", return_logprob=True)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.5)
    with sglang_server.client() as c:
        c.abort("gyre-abort-1")
    t.join(60)
    res = box["res"]
    assert res.aborted and 0 < res.completion_tokens < 900
    assert len(res.output_logprobs) == len(res.output_ids) == res.completion_tokens
    assert res.finish_reason.status_code is None  # a client's abort is not the request's fault


def test_a_too_long_prompt_is_a_rejection_not_a_retry(sglang_server):
    """SGLang ends a prompt longer than its context with an abort carrying status_code 400: the proxy's
    engine adapter raises EngineRejected at once (the router would otherwise retry it until its timeout)."""
    from gyre.proxy.engines import ClientEngine, EngineRejected
    from gyre.rollout.client.async_client import AsyncEngineClient

    async def go():
        async with AsyncEngineClient(sglang_server.url) as ac:
            eng = ClientEngine(ac, "engine-0")
            t0 = time.monotonic()
            with pytest.raises(EngineRejected) as ei:
                async for _ in eng.generate_stream(list(range(5, 1500)), {"max_new_tokens": 4}, "gyre-long-1"):
                    pass
            return ei.value, time.monotonic() - t0

    exc, took = asyncio.run(go())
    assert 400 <= exc.status < 500 and took < 5, (exc, took)
    print(f"too-long prompt: HTTP {exc.status} in {took:.2f} s: {exc.message[:120]}")


def test_shutdown_with_parallel_samples_in_flight_ends_within_30s(sglang_model_dir, tmp_path):
    """SGLang's SIGTERM waits for requests it never finishes after an n > 1 generate; stop() ends it."""
    eng = start_server(sglang_model_dir, tmp_path, "n2")
    started = threading.Event()

    def run():
        with eng.client(timeout=120) as c:
            started.set()
            try:
                c.generate(list(range(10, 20)), {"max_new_tokens": 600, "ignore_eos": True, "n": 2})
            except Exception:
                pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    started.wait(10)
    time.sleep(1.5)
    t0 = time.monotonic()
    eng.stop()
    took = time.monotonic() - t0
    print(f"stop with n=2 in flight: {took:.1f} s, exit status {eng.proc.returncode}")
    assert eng.proc.poll() is not None and took < 30


def test_a_prompt_written_by_the_token_table_is_read_as_the_same_prompt(sglang_server, monkeypatch):
    """Long prompts are posted as space-padded JSON (:mod:`gyre.rollout.client.token_json`); SGLang reads them as
    the same ids: greedy output and log-probs equal those of the same prompt written by orjson."""
    import numpy as np

    from gyre.rollout.client import token_json

    prompt = np.arange(300, 900, dtype=np.int32)
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    with sglang_server.client() as c:
        plain = c.generate(prompt, params, return_logprob=True)
        monkeypatch.setattr(token_json, "MIN_IDS", 1)
        padded = c.generate(prompt, params, return_logprob=True)
    assert b" " in token_json.dumps_with_ids({"input_ids": prompt})
    assert padded.prompt_tokens == plain.prompt_tokens == 600
    assert padded.output_ids == plain.output_ids
    assert max(abs(a - b) for a, b in zip(padded.output_logprobs, plain.output_logprobs)) < 1e-4


def test_an_abort_reaches_only_its_own_request_not_those_its_id_begins(sglang_server):
    """SGLang aborts every request whose id starts with the one given.  Through the proxy's engine
    adapter, aborting ``E-1`` beside ``E-12`` and the retry ``E-1.r1`` ends ``E-1`` alone: the other
    two go on generating until they are aborted by their own ids."""
    from gyre.proxy.engines import ClientEngine
    from gyre.rollout.client.async_client import AsyncEngineClient

    rids = ("E-1", "E-12", "E-1.r1")
    params = {"max_new_tokens": 900, "ignore_eos": True}

    async def go():
        async with AsyncEngineClient(sglang_server.url) as ac:
            eng = ClientEngine(ac, "engine-0")
            got = {r: [] for r in rids}
            finish: dict[str, str | None] = {r: None for r in rids}

            async def run(rid):
                async for ch in eng.generate_stream(list(range(10, 30)), params, rid):
                    got[rid] += ch.output_ids
                    finish[rid] = ch.finish_reason

            async def until(cond, what):
                for _ in range(1200):
                    if cond():
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(f"{what}: {finish}, tokens {[len(v) for v in got.values()]}")

            tasks = [asyncio.create_task(run(r)) for r in rids]
            await until(lambda: all(got.values()), "not all three running")
            await eng.abort("E-1")
            await until(lambda: finish["E-1"] is not None, "E-1 not aborted")
            after = {r: len(got[r]) for r in rids}
            await until(lambda: all(finish[r] is not None or len(got[r]) >= after[r] + 8 for r in rids[1:]),
                        "the others stalled")
            ended_early = {r: finish[r] for r in rids[1:]}
            for r in rids[1:]:
                await eng.abort(r)
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return finish, ended_early, {r: len(v) for r, v in got.items()}, eng.seed_each_request

    finish, ended_early, tokens, seeded = asyncio.run(go())
    print(f"abort of E-1 beside E-12 and E-1.r1: finishes {finish}, tokens {tokens}")
    assert finish["E-1"] == "abort" and ended_early == {"E-12": None, "E-1.r1": None}
    assert all(finish[r] == "abort" and 0 < tokens[r] < 900 for r in rids)
    assert seeded is True  # every request carried a sampling_seed, which SGLang accepted
