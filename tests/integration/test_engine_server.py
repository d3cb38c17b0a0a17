"""The embedded engine over real HTTP on 127.0.0.1.

One server (cumulative streaming, SGLang's default) serves the read-only checks; a second one
(incremental streaming, the embedded default) takes the weight updates, memory release and
in-flight policies.
References are independent full forwards of the HF model at the same weights.
"""

import asyncio
import base64
import concurrent.futures
import io
import json
import time

import httpx
import pytest
import torch

from gyre.embedded_model import load_hf_model
from gyre.rollout.client.async_client import AsyncEngineClient
from gyre.rollout.client.engine_client import EngineClient
from gyre.rollout.client.messages import EngineError
from gyre.rollout.embedded.config import EngineConfig
from gyre.rollout.embedded.model_runner import read_weights
from gyre.rollout.embedded.server import EngineServer
from gyre.rollout.weights import serialize_named_tensors

EOS = 4098


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    torch.set_num_threads(1)
    return load_hf_model(tiny_model_dir)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = EngineServer(EngineConfig(model_dir=str(tiny_model_dir), max_running_requests=64,
                                    incremental_streaming_output=False)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client(timeout=120) as c:
        yield c


def prompts(n, seed=0, lo=3, hi=40):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4000, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def ref_logprobs(model, input_ids, output_ids, temperature):
    with torch.no_grad():
        logits = model(torch.tensor(input_ids + output_ids)[None]).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)
    P = len(input_ids)
    return [lp[P - 1 + k, t].item() for k, t in enumerate(output_ids)]


def test_greedy_equals_hf_generate(client, hf):
    for ids in prompts(3, seed=1):
        r = client.generate(ids, {"max_new_tokens": 24, "temperature": 0})
        with torch.no_grad():
            out = hf.generate(torch.tensor(ids)[None], max_new_tokens=24, do_sample=False, eos_token_id=EOS,
                              pad_token_id=4096)
        assert r.output_ids == out[0, len(ids):].tolist()
        assert r.weight_version == "default" and r.prompt_tokens == len(ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_training_side_forward(client, hf, temperature):
    batch = prompts(6, seed=2)
    results = client.generate_batch(batch, {"max_new_tokens": 20, "temperature": temperature, "ignore_eos": True,
                                            "sampling_seed": 11})
    assert len(results) == 6
    for ids, r in zip(batch, results):
        assert len(r.output_logprobs) == len(r.output_ids) == 20
        ref = ref_logprobs(hf, ids, r.output_ids, temperature)
        assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref)) < 1e-4
        assert r.meta_info["output_token_logprobs"][0][1] == r.output_ids[0]


def _top_ids(model, input_ids, k):
    with torch.no_grad():
        logits = model(torch.tensor(input_ids)[None]).logits[0, -1].float()
    return torch.topk(logits, k).indices.tolist()


@pytest.mark.parametrize("case", ["min_tokens", "min_tokens_greedy", "top_p", "top_k", "stop_strings"])
def test_behaviour_logprobs_are_raw_whatever_chose_the_token(client, hf, case):
    """Returned log-probs are log_softmax(logits / T) over the full vocabulary (T = 1 when greedy),
    compared with a brute-force full forward, whatever processing chose the tokens."""
    ids = prompts(1, seed=21)[0]
    base = {"max_new_tokens": 12, "temperature": 0.8, "sampling_seed": 3}
    if case.startswith("min_tokens"):
        # the model's 30 most likely first tokens are stop ids, masked for all 12 tokens: the
        # masked distribution differs a lot from the raw one
        stop_ids = sorted(set(_top_ids(hf, ids, 30)) | {EOS})
        sp = dict(base, stop_token_ids=stop_ids, min_new_tokens=12)
        if case == "min_tokens_greedy":
            sp["temperature"] = 0
    elif case == "top_p":
        sp = dict(base, top_p=0.3, ignore_eos=True)
    elif case == "top_k":
        sp = dict(base, top_k=3, ignore_eos=True)
    else:
        free = client.generate(ids, dict(base, ignore_eos=True))
        text = free.text
        target = next(text[i:i + 2] for i in range(3, len(text) - 2)
                      if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
        sp = dict(base, ignore_eos=True, stop=[target])
    r = client.generate(ids, sp)
    assert len(r.output_ids) == len(r.output_logprobs) > 0
    if case.startswith("min_tokens"):
        assert len(r.output_ids) == 12 and not set(r.output_ids) & set(stop_ids)
    if case == "stop_strings":
        assert r.finish_reason.type == "stop" and r.finish_reason.matched == target
    ref = ref_logprobs(hf, ids, r.output_ids, sp["temperature"] or 1.0)
    assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref)) < 1e-4


def test_n_samples_seeds_and_reproducibility(client):
    ids = prompts(1, seed=3)[0]
    sp = {"max_new_tokens": 12, "temperature": 1.0, "n": 3, "sampling_seed": 5, "ignore_eos": True}
    a = client.generate(ids, sp)
    b = client.generate(ids, sp)
    assert len(a) == 3 and [x.output_ids for x in a] == [x.output_ids for x in b]
    assert len({tuple(x.output_ids) for x in a}) > 1
    assert all(len(x.output_ids) == 12 for x in a)
    assert all(x.cached_tokens == len(ids) - 1 for x in b)     # second call: whole prompt from the prefix cache


def test_stop_token_ids_stop_strings_and_max_new_tokens(client):
    ids = prompts(1, seed=4)[0]
    free = client.generate(ids, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    tok = free.output_ids[5]
    k = free.output_ids.index(tok)
    r = client.generate(ids, {"max_new_tokens": 16, "temperature": 0, "stop_token_ids": [tok]})
    assert r.output_ids == free.output_ids[:k + 1]
    assert r.finish_reason.type == "stop" and r.finish_reason.matched == tok
    r0 = client.generate(ids, {"max_new_tokens": 0})
    assert r0.output_ids == [] and r0.finish_reason.type == "length"
    r3 = client.generate(ids, {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert r3.output_ids == free.output_ids[:3] and r3.finish_reason.to_json() == {"type": "length", "length": 3}
    # stop string: a piece of the free-running text
    text = free.text
    target = next(text[i:i + 3] for i in range(len(text) - 3) if text[i:i + 3].strip() and "\ufffd" not in text[i:i + 3])
    rs = client.generate(ids, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [target]})
    assert rs.finish_reason.type == "stop" and rs.finish_reason.matched == target
    assert target not in rs.text and text.startswith(rs.text)


def test_text_input_top_logprobs_and_token_text(client, tiny_model_dir):
    from gyre.embedded_model import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    body = {"text": "def add(a, b):", "sampling_params": {"max_new_tokens": 5, "temperature": 0},
            "return_logprob": True, "top_logprobs_num": 3, "return_text_in_logprobs": True}
    out = httpx.post(client.base_url + "/generate", json=body).json()
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(tok("def add(a, b):", add_special_tokens=False)["input_ids"])
    assert len(meta["output_top_logprobs"]) == 5 and all(len(row) == 3 for row in meta["output_top_logprobs"])
    for (lp, tid, text), row in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert row[0][1] == tid and abs(row[0][0] - lp) < 1e-6          # greedy: the top-1 token
        assert text == tok.decode([tid])


def test_stream_chunks_concatenate_to_the_non_stream_result(client, server):
    ids = prompts(1, seed=5)[0]
    sp = {"max_new_tokens": 15, "temperature": 0.8, "sampling_seed": 3, "ignore_eos": True}
    full = client.generate(ids, sp)
    chunks = list(client.stream(ids, sp))
    assert len(chunks) >= 2 and chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert [t for c in chunks for t in c.delta_output_ids] == full.output_ids
    assert [x for c in chunks for x in c.delta_logprobs] == full.output_logprobs
    assert "".join(c.delta_text for c in chunks) == full.text == chunks[-1].text
    # the raw wire format: SSE data lines, cumulative ids (SGLang default), then [DONE]
    with httpx.stream("POST", server.url + "/generate", json={"input_ids": ids, "sampling_params": sp,
                                                              "stream": True}) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert events[-1]["output_ids"] == full.output_ids and events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(events[i]["output_ids"] == full.output_ids[:len(events[i]["output_ids"])] for i in range(len(events)))


def test_abort_running_request_returns_promptly(client):
    ids = prompts(1, seed=6)[0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.generate, ids, {"max_new_tokens": 20000, "ignore_eos": True}, rid="long-1")
        _wait_running(client, 1)
        t = time.monotonic()
        assert client.abort("long-1") is True
        r = fut.result(timeout=10)
        assert time.monotonic() - t < 3.0
    assert r.aborted and r.finish_reason.type == "abort" and 0 < len(r.output_ids) < 20000
    assert client.abort("long-1") is False                     # finished: unknown now


def test_client_disconnect_aborts_the_request(client, server):
    # streaming: closing the stream early frees the slot
    stream = client.stream([1, 2, 3], {"max_new_tokens": 20000, "ignore_eos": True})
    next(stream), next(stream)
    stream.close()
    _wait_idle(client)
    # non-streaming: a client that times out and goes away
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json={"input_ids": [4, 5], "sampling_params": {
            "max_new_tokens": 20000, "ignore_eos": True}}, timeout=0.5)
    _wait_idle(client)


def test_pause_in_place_then_continue(client):
    ids = prompts(1, seed=7)[0]
    sp = {"max_new_tokens": 100, "temperature": 0, "ignore_eos": True}
    expected = client.generate(ids, sp).output_ids
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.generate, ids, sp)
        _wait_running(client, 1)
        client.pause_generation("in_place")
        s1 = _state(client)
        time.sleep(0.3)
        s2 = _state(client)
        assert s1["paused"] == "in_place" and s1["num_running_reqs"] == 1
        assert s2["num_decode_tokens"] == s1["num_decode_tokens"] and not fut.done()
        client.continue_generation()
        r = fut.result(timeout=30)
    assert r.output_ids == expected and r.finish_reason.type == "length"


def test_64_concurrent_requests_complete_with_correct_lengths(server):
    batch = prompts(64, seed=8, lo=2, hi=30)
    lengths = [1 + (i * 7) % 16 for i in range(64)]

    async def main():
        async with AsyncEngineClient(server.url, timeout=120) as c:
            return await asyncio.gather(*[
                c.generate(ids, {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True})
                for ids, n in zip(batch, lengths)])

    results = asyncio.run(main())
    assert [len(r.output_ids) for r in results] == lengths
    assert all(r.finish_reason.type == "length" and len(r.output_logprobs) == len(r.output_ids) for r in results)


MALFORMED = [
    ("/generate", "{not json"),
    ("/generate", "[" * 100000 + "]" * 100000),
    ("/generate", '{"input_ids": [1], "sampling_params": {"temperature": NaN}}'),
    ("/generate", []),
    ("/generate", {}),
    ("/generate", {"input_ids": []}),
    ("/generate", {"input_ids": "1 2 3"}),
    ("/generate", {"input_ids": [1, "2"]}),
    ("/generate", {"input_ids": [1, 10 ** 9]}),
    ("/generate", {"input_ids": [-5]}),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": "hot"}}),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 0}}),
    ("/generate", {"input_ids": [1], "sampling_params": {"n": 0}}),
    ("/generate", {"input_ids": [1], "sampling_params": "greedy"}),
    ("/generate", {"input_ids": [1], "stream": 1}),
    ("/generate", {"input_ids": [1], "bogus": True}),
    ("/generate", {"text": ""}),
    ("/abort_request", {"rid": "no-such-request"}),
    ("/abort_request", {}),
    ("/abort_request", {"rid": 5}),
    ("/pause_generation", {"mode": "sideways"}),
    ("/release_memory_occupation", {"tags": ["gpu"]}),
    ("/update_weights_from_disk", {"model_path": "/definitely/not/here", "weight_version": "x"}),
    ("/update_weights_from_disk", {"weight_version": "x"}),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["%%%not base64"]}),
    ("/update_weights_from_tensor", {"serialized_named_tensors": []}),
    ("/update_weight_version", {"new_version": 3}),
    ("/init_weights_update_group", {}),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                    "world_size": 1}),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                    "world_size": 2, "backend": "mpi"}),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]],
                                          "group_name": "none-joined"}),
    ("/update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[2], [2]]}),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["floaty"], "shapes": [[2]]}),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[-1]]}),
    ("/destroy_weights_update_group", {"group_name": "never-joined"}),
    ("/update_weights_from_ipc", {}),
]


@pytest.mark.parametrize("path,body", MALFORMED, ids=[f"{p}-{i}" for i, (p, _) in enumerate(MALFORMED)])
def test_malformed_inputs_get_400_with_error_body(server, path, body):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "message" in r.json()["error"]


def test_wrong_tensor_payloads_get_400(server):
    bad_shape = serialize_named_tensors({"model.norm.weight": torch.ones(3)})
    bad_name = serialize_named_tensors({"model.nope": torch.ones(3)})
    not_tensors = base64.b64encode(_torch_bytes({"a": 1})).decode()
    for payload in (bad_shape, bad_name, not_tensors):
        r = httpx.post(server.url + "/update_weights_from_tensor",
                       json={"serialized_named_tensors": [payload], "weight_version": "bad"})
        assert r.status_code == 400, r.text
    assert EngineClient(server.url).get_weight_version() == "default"


def test_status_endpoints(client, server, tiny_model_dir):
    assert client.health() and client.health_generate()
    info = client.get_model_info()
    assert info["is_generation"] and info["model_path"] == str(tiny_model_dir) and info["weight_version"] == "default"
    si = client.get_server_info()
    assert si["engine"] == "gyre-embedded" and si["incremental_streaming_output"] is False
    assert si["internal_states"][0]["num_running_reqs"] == 0
    assert client.get_weight_version() == "default"
    assert httpx.post(server.url + "/flush_cache").status_code == 200
    from gyre.rollout.client.sglang_protocol import probe_weight_update_sessions

    assert probe_weight_update_sessions(client) is False  # no weight-update sessions: /end_weight_update is 404


def test_small_requests_do_not_wait_for_delayed_acks(client):
    """TCP_NODELAY on the server socket: a tiny request takes ~2 ms, not ~40 ms."""
    times = []
    for _ in range(9):
        t = time.perf_counter()
        client.generate([1, 2], {"max_new_tokens": 0})
        times.append(time.perf_counter() - t)
    assert sorted(times)[4] < 0.025


# ---------------------------------------------------------------------------- weights and memory


@pytest.fixture(scope="module")
def wserver(tiny_model_dir):
    srv = EngineServer(EngineConfig(model_dir=str(tiny_model_dir))).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def wclient(wserver):
    with wserver.client(timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def perturbed(tiny_model_dir, tmp_path_factory):
    """A second set of weights on disk and an HF model holding them."""
    sd = read_weights(tiny_model_dir)
    g = torch.Generator().manual_seed(99)
    new = {k: (v + 0.05 * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v for k, v in sd.items()}
    d = tmp_path_factory.mktemp("weights-v1")
    from safetensors.torch import save_file

    save_file(new, str(d / "model.safetensors"))
    model = load_hf_model(tiny_model_dir)
    model.load_state_dict(new, strict=False)
    return d, model


def test_incremental_stream_concatenates(wclient):
    ids = prompts(1, seed=9)[0]
    sp = {"max_new_tokens": 10, "temperature": 0.9, "sampling_seed": 1, "ignore_eos": True}
    full = wclient.generate(ids, sp)
    chunks = list(wclient.stream(ids, sp))
    assert [t for c in chunks for t in c.delta_output_ids] == full.output_ids
    assert chunks[-1].output_ids == full.output_ids and "".join(c.delta_text for c in chunks) == full.text


def test_release_and_resume_memory(wclient):
    ids = prompts(1, seed=10)[0]
    sp = {"max_new_tokens": 10, "temperature": 0}
    before = wclient.generate(ids, sp)
    wclient.release_memory_occupation()
    assert not wclient.health_generate()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(wclient.generate, ids, sp)
        time.sleep(0.4)
        assert not fut.done()                                  # waits while memory is released
        wclient.resume_memory_occupation(["weights"])
        time.sleep(0.2)
        assert not fut.done()
        wclient.resume_memory_occupation(["kv_cache"])
        time.sleep(0.2)
        assert not fut.done()                                  # the CUDA-graph tag was released too
        wclient.resume_memory_occupation(["cuda_graph"])
        after = fut.result(timeout=30)
    assert after.output_ids == before.output_ids and after.cached_tokens == 0   # KV release dropped the cache
    assert wclient.health_generate()


def test_release_while_running_is_refused(wclient):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(wclient.generate, [1, 2, 3], {"max_new_tokens": 20000, "ignore_eos": True})
        _wait_running(wclient, 1)
        with pytest.raises(EngineError) as ei:
            wclient.release_memory_occupation(["kv_cache"])
        assert ei.value.status_code == 400
        wclient.pause_generation("abort")
        assert fut.result(timeout=10).aborted
        wclient.continue_generation()


def test_weight_update_from_disk_changes_outputs_and_never_reuses_stale_kv(wclient, hf, perturbed):
    path, new_model = perturbed
    ids = prompts(1, seed=11, lo=30, hi=31)[0]
    sp = {"max_new_tokens": 12, "temperature": 0.7, "sampling_seed": 4, "ignore_eos": True}
    old = wclient.generate(ids, sp)
    again = wclient.generate(ids, sp)
    assert again.cached_tokens == len(ids) - 1 and again.output_ids == old.output_ids
    res = wclient.update_weights_from_disk(str(path), weight_version="v1")
    assert res["success"] and res["weight_version"] == "v1" and wclient.get_weight_version() == "v1"
    new = wclient.generate(ids, sp)
    assert new.weight_version == "v1" and new.cached_tokens == 0          # prefix cache was flushed
    assert new.output_ids != old.output_ids
    ref = ref_logprobs(new_model, ids, new.output_ids, 0.7)
    assert max(abs(a - b) for a, b in zip(new.output_logprobs, ref)) < 1e-4
    # a later call extending the prompt hits the cache built under v1 and stays exact
    ext = ids + new.output_ids
    r = wclient.generate(ext, sp)
    assert r.cached_tokens >= len(ids) - 1
    ref = ref_logprobs(new_model, ext, r.output_ids, 0.7)
    assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref)) < 1e-4


def test_weight_update_from_tensor_partial(wclient, perturbed, tiny_model_dir):
    base = read_weights(tiny_model_dir)
    name = "model.layers.0.mlp.down_proj.weight"
    res = wclient.update_weights_from_tensor({name: base[name]}, weight_version="v2")
    assert res["success"] and wclient.get_weight_version() == "v2"
    model = load_hf_model(tiny_model_dir)
    model.load_state_dict(read_weights(perturbed[0]), strict=False)
    model.load_state_dict({name: base[name]}, strict=False)
    ids = prompts(1, seed=12)[0]
    r = wclient.generate(ids, {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True})
    ref = ref_logprobs(model, ids, r.output_ids, 1.0)
    assert r.weight_version == "v2" and max(abs(a - b) for a, b in zip(r.output_logprobs, ref)) < 1e-4


def test_in_flight_requests_finish_on_old_version_by_default(wclient, tiny_model_dir):
    ids = prompts(1, seed=13)[0]
    sp = {"max_new_tokens": 250, "temperature": 0, "ignore_eos": True}
    v_before = wclient.get_weight_version()
    expected_old = wclient.generate(ids, sp).output_ids
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        fut = pool.submit(wclient.generate, ids, sp)
        _wait_running(wclient, 1)
        upd = pool.submit(wclient.update_weights_from_disk, str(tiny_model_dir), weight_version="v3")
        deadline = time.monotonic() + 20
        while not _state(wclient)["weight_update_pending"]:    # the update waits for the running request
            assert time.monotonic() < deadline and not fut.done(), "request finished before the update arrived"
            time.sleep(0.01)
        late = pool.submit(wclient.generate, ids, {"max_new_tokens": 2})   # arrives during the drain
        r = fut.result(timeout=60)
        assert upd.result(timeout=60)["success"]
    assert r.finish_reason.type == "length" and r.weight_version == v_before
    assert r.output_ids == expected_old                        # every token from the old weights
    assert late.result(timeout=30).weight_version == "v3"       # queued, then served on the new weights
    assert wclient.generate(ids, {"max_new_tokens": 2}).weight_version == "v3"


def test_in_flight_requests_abort_with_abort_all_requests(wclient, perturbed):
    ids = prompts(1, seed=14)[0]
    v_before = wclient.get_weight_version()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(wclient.generate, ids, {"max_new_tokens": 20000, "ignore_eos": True})
        _wait_running(wclient, 1)
        res = wclient.update_weights_from_disk(str(perturbed[0]), weight_version="v4", abort_all_requests=True)
        r = fut.result(timeout=10)
    assert res["num_aborted_requests"] == 1
    assert r.aborted and r.weight_version == v_before
    assert wclient.generate(ids, {"max_new_tokens": 2}).weight_version == "v4"


# ---------------------------------------------------------------------------- helpers


def _state(client):
    return client.get_server_info()["internal_states"][0]


def _wait_running(client, n, timeout=20.0):
    deadline = time.monotonic() + timeout
    while _state(client)["num_running_reqs"] < n:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.02)
    time.sleep(0.05)


def _wait_idle(client, timeout=10.0):
    deadline = time.monotonic() + timeout
    while _state(client)["num_running_reqs"]:
        assert time.monotonic() < deadline, "request still running after its client left"
        time.sleep(0.05)


def _torch_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
