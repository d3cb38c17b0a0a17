"""SGLang cells sharing KV through a Mooncake store (GPU machines with SGLang only; skipped elsewhere).

Two SGLang servers on one GPU run their hierarchical cache with the same Mooncake master as the
storage tier (:func:`gyre.rollout.sglang_driver.launch.shared_kv_store_launch`, TCP).  A long prompt
served by the first is written through to the store; the same prompt sent to the second -- as a
request rerouted to another cell would be -- must find most of its prefix there
(``cached_tokens``), and produce the same greedy tokens.  Part of ``tests/gpu/gpu_check.sh`` (f).
"""

import os
import shutil
import subprocess
import time

import pytest

from gyre.rollout.ports import free_port

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ARGS = ["--mem-fraction-static", "0.2", "--disable-cuda-graph", "--skip-server-warmup", "--dtype", "bfloat16",
        "--attention-backend", "triton", "--max-running-requests", "8",
        "--max-total-tokens", "65536",  # a small GPU KV pool, so the host pool (1.2x) is small too
        "--hicache-storage-prefetch-policy", "wait_complete"]  # the prefix is read before it runs


@pytest.fixture(scope="module")
def master():
    pytest.importorskip("sglang")
    exe = shutil.which("mooncake_master")
    if exe is None:
        pytest.skip("mooncake_master is not installed (mooncake-transfer-engine)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    time.sleep(2)
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(30)


def test_a_rerouted_prompt_finds_its_prefix_in_the_shared_store(master, tmp_path):
    from gyre.embedded_model import ensure_tiny_model
    from gyre.rollout.sglang_driver.engine import SGLangEngine
    from gyre.rollout.sglang_driver.launch import merge_server_argv, shared_kv_store_launch

    model = os.environ.get("GYRE_SGLANG_TEST_MODEL") or str(ensure_tiny_model("local"))
    engines = []
    try:
        for i in range(2):
            argv, env = shared_kv_store_launch(master, "127.0.0.1", protocol="tcp", segment_bytes=1 << 30)
            engines.append(SGLangEngine(model, server_argv=merge_server_argv(ARGS, argv),
                                        env={**os.environ, **env}, startup_timeout=600,
                                        log_path=tmp_path / f"sglang{i}.log").start())
        a, b = (e.client(timeout=300) for e in engines)
        prompt = [(7 * k) % 3000 + 10 for k in range(2048)]
        greedy = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
        first = a.generate(prompt, greedy)
        time.sleep(2)  # write-through to the store
        moved = b.generate(prompt, greedy)
        assert moved.cached_tokens >= 0.9 * len(prompt), moved.cached_tokens
        assert moved.output_ids == first.output_ids
    finally:
        for e in engines:
            e.stop()
