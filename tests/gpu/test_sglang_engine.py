"""The SGLang adapter against a real SGLang server (GPU machines only; skipped elsewhere).

Run on a GPU box with the GPU environment (requirements-gpu.txt)::

    GYRE_SGLANG_TEST_MODEL=/path/to/hf/model python -m pytest -q tests/gpu/test_sglang_engine.py
    # or: python tests/gpu/test_sglang_engine.py

Without ``GYRE_SGLANG_TEST_MODEL`` the embedded tiny Qwen3 is built (needs dashscope) and served
in bfloat16.  ``GYRE_SGLANG_TEST_ARGS`` adds SGLang flags (default: a small, fast config).
The same :class:`gyre.rollout.client.engine_client.EngineClient` as the embedded engine is used, so this
checks that the protocol Gyre relies on holds on SGLang: generate with log-probs, streaming,
abort, pause/continue, weight update from disk with a version label, memory release/resume.
The SGLang tier (``bash tools/test_sglang.sh``) checks the same protocol on a CPU server; what only
a GPU shows is the GPU check's phase f (``tests/gpu/sglang_cycle.py``).
"""

import concurrent.futures
import os
import shlex
import time

import pytest

from tests.gpu.sglang_cycle import held_requests

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEFAULT_ARGS = ("--mem-fraction-static 0.3 --disable-cuda-graph --skip-server-warmup --dtype bfloat16 "
                "--attention-backend triton --enable-memory-saver --max-running-requests 64")


@pytest.fixture(scope="module")
def model_dir():
    pytest.importorskip("sglang")
    path = os.environ.get("GYRE_SGLANG_TEST_MODEL")
    if path:
        return path
    try:
        from gyre.embedded_model import ensure_tiny_model

        return str(ensure_tiny_model("local"))
    except Exception as exc:  # dashscope missing in the GPU environment
        pytest.skip(f"no test model: set GYRE_SGLANG_TEST_MODEL ({exc})")


@pytest.fixture(scope="module")
def engine(model_dir):
    from gyre.rollout.sglang_driver.engine import SGLangEngine

    argv = shlex.split(os.environ.get("GYRE_SGLANG_TEST_ARGS", DEFAULT_ARGS))
    eng = SGLangEngine(model_dir, server_argv=argv, startup_timeout=900)
    eng.start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def client(engine):
    with engine.client(timeout=300) as c:
        yield c


def test_generate_with_logprobs_matches_hf_forward(client, model_dir):
    from gyre.embedded_model import load_hf_model

    ids = list(range(100, 140))
    r = client.generate(ids, {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 1})
    assert len(r.output_ids) == 16 == len(r.output_logprobs)
    assert r.finish_reason.type == "length" and r.weight_version is not None
    hf = load_hf_model(model_dir).cuda()
    with torch.no_grad():
        logits = hf(torch.tensor([ids + r.output_ids], device="cuda")).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    ref = [lp[len(ids) - 1 + k, t].item() for k, t in enumerate(r.output_ids)]
    assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref)) < 0.1     # bf16 server vs fp32 reference


def test_stream_concatenates_to_non_stream(client):
    ids = list(range(200, 230))
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = client.generate(ids, sp)
    chunks = list(client.stream(ids, sp))
    assert [t for c in chunks for t in c.delta_output_ids] == full.output_ids
    assert chunks[-1].finished


def test_abort_running_request(client, engine):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.generate, [1, 2, 3], {"max_new_tokens": 30000, "ignore_eos": True}, rid="gpu-long")
        deadline = time.monotonic() + 60
        while held_requests(engine.url) < 1:  # /v1/loads (0.5.23 has no /get_load)
            assert time.monotonic() < deadline, "the request never reached the scheduler"
            time.sleep(0.05)
        client.abort("gpu-long")
        r = fut.result(timeout=60)
    assert r.aborted


def test_pause_in_place_and_continue(client):
    sp = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.generate, [5, 6, 7], sp)
        time.sleep(0.2)
        client.pause_generation("in_place")
        time.sleep(0.5)
        client.continue_generation()
        r = fut.result(timeout=120)
    assert len(r.output_ids) == 400 and r.finish_reason.type == "length"


def test_weight_update_from_disk_sets_version(client, model_dir):
    res = client.update_weights_from_disk(model_dir, weight_version="gpu-v1")
    assert res["success"]
    assert client.get_weight_version() == "gpu-v1"
    assert client.generate([1, 2], {"max_new_tokens": 2}).weight_version == "gpu-v1"


def test_release_and_resume_memory(client, engine):
    if "--enable-memory-saver" not in engine.server_argv:
        pytest.skip("server started without --enable-memory-saver")
    client.pause_generation("abort")
    client.release_memory_occupation()
    client.resume_memory_occupation(["weights"])
    client.update_weights_from_disk(engine.model_path, weight_version="gpu-v2")
    client.resume_memory_occupation(["kv_cache", "cuda_graph"])
    client.continue_generation()
    r = client.generate([1, 2, 3], {"max_new_tokens": 4})
    assert len(r.output_ids) == 4 and r.weight_version == "gpu-v2"


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-rs"]))
