"""SGLang adapter on CPU: --sglang-* passthrough mapping and process management (with a fake
server standing in for ``python -m sglang.launch_server``)."""

import argparse
import json
import socket
import sys
import textwrap

import pytest

from gyre.arguments import parse_args
from gyre.rollout.ports import free_port
from gyre.rollout.sglang_driver.engine import SGLangEngine
from gyre.rollout.sglang_driver.flags import add_sglang_arguments, sglang_server_argv


def test_gyre_flags_map_to_sglang_flags():
    a = parse_args(["--rollout-engine", "sglang", "--sglang-tp-size", "2", "--sglang-mem-fraction-static", "0.7",
                    "--sglang-enable-memory-saver", "--sglang-attention-backend", "triton",
                    "--sglang-extra-args", "--json-model-override-args '{\"a\": 1}' --disable-overlap-schedule"])
    assert sglang_server_argv(a) == ["--tp-size", "2", "--mem-fraction-static", "0.7", "--attention-backend", "triton",
                                     "--enable-memory-saver", "--json-model-override-args", '{"a": 1}',
                                     "--disable-overlap-schedule"]


def test_unset_flags_pass_nothing_and_values_are_checked():
    assert sglang_server_argv(parse_args([])) == []
    for bad in (["--sglang-tp-size", "0"], ["--sglang-mem-fraction-static", "1.5"], ["--sglang-no-such-flag", "1"]):
        with pytest.raises(SystemExit) as ei:
            parse_args(bad)
        assert ei.value.code == 2


def test_yaml_config_keys(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("sglang-tp-size: 4\nsglang_disable_radix_cache: true\n")
    assert sglang_server_argv(parse_args(["--config", str(cfg)])) == ["--tp-size", "4", "--disable-radix-cache"]


def test_mapping_input_and_managed_flags():
    assert sglang_server_argv({"sglang_dp_size": 2, "enable_dp_attention": True, "quiet": False,
                               "sglang_cuda_graph_bs": [1, 2, 4]}) == [
        "--dp-size", "2", "--enable-dp-attention", "--cuda-graph-bs", "1", "2", "4"]
    with pytest.raises(ValueError):
        sglang_server_argv({"sglang_model_path": "/m"})
    with pytest.raises(ValueError):
        sglang_server_argv({"sglang_extra_args": "--x 'unclosed"})


class FakeServerArgs:
    """Mimics ``sglang.srt.server_args.ServerArgs.add_cli_args`` (flag kinds SGLang uses)."""

    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--model-path", "--model", type=str, required=True)
        parser.add_argument("--port", type=int, default=30000)
        parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)   # curated already
        parser.add_argument("--data-parallel-size", "--dp-size", type=int, default=1)     # SGLang's order: alias last
        parser.add_argument("--pipeline-parallel-size", "--pp-size", type=int, default=1)
        parser.add_argument("--served-model-name", type=str, default=None)
        parser.add_argument("--attention-context-parallel-size", "--attn-cp-size", type=int, default=1)
        parser.add_argument("--enable-metrics", action="store_true")
        parser.add_argument("--no-warmup", dest="warmup", action="store_false")
        parser.add_argument("--cuda-graph-bs", type=int, nargs="+")
        parser.add_argument("--enable-foo", action=argparse.BooleanOptionalAction, default=True)
        parser.add_argument("--load-format", choices=["auto", "pt"], default="auto")
        group = parser.add_argument_group("lora")
        group.add_argument("--max-loras-per-batch", type=int, default=8)


def test_full_server_args_are_registered_with_prefix_like_slime():
    parser = argparse.ArgumentParser()
    add_sglang_arguments(parser, server_args_cls=FakeServerArgs)
    opts = {o for a in parser._actions for o in a.option_strings}
    assert "--sglang-model-path" not in opts and "--sglang-port" not in opts          # Gyre sets these
    # an SGLang flag whose alias Gyre already registered is not registered again under its other name
    # (a cell's layout check reads --sglang-dp-size; --sglang-data-parallel-size must not slip past it)
    assert not {"--sglang-data-parallel-size", "--sglang-pipeline-parallel-size",
                "--sglang-tensor-parallel-size"} & opts
    assert {"--sglang-served-model-name", "--sglang-no-warmup", "--sglang-cuda-graph-bs",
            "--sglang-max-loras-per-batch", "--sglang-load-format"} <= opts
    a = parser.parse_args([])
    assert sglang_server_argv(a) == []                                                # SGLang defaults apply
    a = parser.parse_args(["--sglang-served-model-name", "policy", "--sglang-enable-metrics", "--sglang-no-warmup",
                           "--sglang-cuda-graph-bs", "1", "8", "--no-sglang-enable-foo", "--sglang-load-format", "pt",
                           "--sglang-tp-size", "8"])
    assert sglang_server_argv(a) == ["--tp-size", "8", "--served-model-name", "policy", "--enable-metrics",
                                     "--no-warmup", "--cuda-graph-bs", "1", "8", "--no-enable-foo",
                                     "--load-format", "pt"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--sglang-load-format", "bogus"])
    # a flag with several names takes each of them, and goes back to SGLang under its first
    assert sglang_server_argv(parser.parse_args(["--sglang-attn-cp-size", "2"])) == [
        "--attention-context-parallel-size", "2"]
    helps = {o: a.help for a in parser._actions for o in a.option_strings}
    assert helps["--sglang-served-model-name"] == "SGLang --served-model-name."  # SGLang gave none
    assert all(h and h.strip() for h in helps.values())


FAKE_SERVER = textwrap.dedent("""
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    argv = sys.argv[1:]
    if "--crash" in argv:
        print("fake sglang: bad flag --crash", flush=True)
        sys.exit(3)
    port = int(argv[argv.index("--port") + 1])
    if "--taken-once" in argv:  # the first launch finds its port taken, as uvicorn reports it
        marker = argv[argv.index("--taken-once") + 1]
        tried = open(marker).read().split() if os.path.exists(marker) else []
        open(marker, "a").write(f"{port}\\n")
        if not tried:
            print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
                  "address already in use", flush=True)
            sys.exit(3)
    record = argv[argv.index("--record") + 1]
    open(record, "w").write(json.dumps(argv))
    open(record + ".env", "w").write(json.dumps(sorted(os.environ)))

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"weight_version": "default"}).encode()
            self.send_response(200 if self.path in ("/health", "/model_info") else 404)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    HTTPServer((argv[argv.index("--host") + 1], port), H).serve_forever()
""")


def test_engine_launches_waits_for_health_and_stops(tmp_path, monkeypatch):
    for k, v in {"TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": "3", "MASTER_PORT": "29500",
                 "GYRE_KEEP_ME": "1"}.items():  # launched from a torchrun worker
        monkeypatch.setenv(k, v)
    script = tmp_path / "fake_sglang.py"
    script.write_text(FAKE_SERVER)
    record = tmp_path / "argv.json"
    eng = SGLangEngine("/models/policy", server_argv=["--tp-size", "2", "--record", str(record)],
                       launcher=[sys.executable, str(script)], startup_timeout=60)
    cmd = eng.command()
    assert cmd[:2] == [sys.executable, str(script)] and cmd[2:8] == ["--model-path", "/models/policy", "--host",
                                                                      "127.0.0.1", "--port", str(eng.port)]
    with eng:
        with eng.client() as c:
            assert c.health() and c.get_weight_version() == "default"
        assert json.loads(record.read_text())[-4:] == ["--tp-size", "2", "--record", str(record)]
        seen = set(json.loads((tmp_path / "argv.json.env").read_text()))
        assert "GYRE_KEEP_ME" in seen and not {"TORCHELASTIC_USE_AGENT_STORE", "RANK", "MASTER_PORT"} & seen
    assert eng.proc.poll() is not None


def test_engine_start_failure_reports_the_log(tmp_path):
    script = tmp_path / "fake_sglang.py"
    script.write_text(FAKE_SERVER)
    eng = SGLangEngine("/m", server_argv=["--crash"], launcher=[sys.executable, str(script)], startup_timeout=60)
    with pytest.raises(RuntimeError, match="bad flag --crash"):
        eng.start()


def test_a_port_taken_before_the_server_binds_it_is_chosen_again(tmp_path):
    script = tmp_path / "fake_sglang.py"
    script.write_text(FAKE_SERVER)
    marker, record = tmp_path / "ports", tmp_path / "argv.json"
    eng = SGLangEngine("/m", server_argv=["--taken-once", str(marker), "--record", str(record)],
                       launcher=[sys.executable, str(script)], log_path=tmp_path / "server.log", startup_timeout=60)
    with eng:
        with eng.client() as c:
            assert c.health()
        first, second = (int(p) for p in marker.read_text().split())
        assert first != second == eng.port
        assert "address already in use" in (tmp_path / "server.log").read_text()  # the first launch's log kept

    # a port the caller chose is the caller's: the failure is reported, not retried
    marker.unlink()
    fixed = SGLangEngine("/m", port=free_port(), server_argv=["--taken-once", str(marker), "--record", str(record)],
                         launcher=[sys.executable, str(script)], startup_timeout=60)
    with pytest.raises(RuntimeError, match="address already in use"):
        fixed.start()
    assert len(marker.read_text().split()) == 1


class _Candidates:
    """A stand-in for ``random.Random`` whose ``randrange`` returns the given ports in order."""

    def __init__(self, ports):
        self.ports = list(ports)

    def randrange(self, lo, hi):
        port = self.ports.pop(0)
        assert lo <= port < hi
        return port


def test_free_port_is_below_the_ephemeral_range_and_skips_taken_ports():
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(10_000 <= p < low for p in ports) and len(ports) > 1
    taken, free = sorted(ports)[:2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", taken))
        s.listen()
        assert free_port(rng=_Candidates([taken, free])) == free


def test_from_args_uses_model_dir_and_passthrough():
    a = parse_args(["--rollout-engine", "sglang", "--model-dir", "/ckpt/hf", "--sglang-dp-size", "2"])
    eng = SGLangEngine.from_args(a, port=31000)
    assert eng.command()[-6:] == ["--host", "127.0.0.1", "--port", "31000", "--dp-size", "2"]
    assert eng.command()[1:5] == ["-m", "sglang.launch_server", "--model-path", "/ckpt/hf"]


def test_create_rollout_engine_picks_the_backend(tiny_model_dir):
    from gyre.rollout import create_rollout_engine
    from gyre.rollout.embedded.server import EngineServer

    assert isinstance(create_rollout_engine(parse_args(["--rollout-engine", "sglang"]), port=31001), SGLangEngine)
    srv = create_rollout_engine(parse_args(["--model-dir", str(tiny_model_dir)]))
    assert isinstance(srv, EngineServer)
    with srv:
        with srv.client() as c:
            assert c.generate([1, 2], {"max_new_tokens": 2}).completion_tokens == 2


def test_a_shared_kv_store_turns_on_hicache_with_mooncake(tiny_model_dir):
    a = parse_args(["--rollout-engine", "sglang", "--model-dir", str(tiny_model_dir), "--sglang-page-size", "32",
                    "--rollout-shared-kv-store", "10.0.0.1:50051", "--rollout-shared-kv-device", "mlx5_0"])
    eng = SGLangEngine.from_args(a, host="10.0.0.7", port=30000, env={"CUDA_VISIBLE_DEVICES": "3"})
    cmd = eng.command()
    assert cmd[cmd.index("--port") + 1:] == [
        "30000", "--page-size", "32",  # the user's flag wins over the store's default of 64
        "--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake", "--hicache-write-policy",
        "write_through", "--hicache-mem-layout", "page_first", "--hicache-ratio", "1.2",
        "--hicache-storage-prefetch-policy", "timeout"]
    assert eng.env == {"CUDA_VISIBLE_DEVICES": "3", "MOONCAKE_MASTER": "10.0.0.1:50051", "MOONCAKE_PROTOCOL": "rdma",
                       "MOONCAKE_DEVICE": "mlx5_0", "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
                       "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.7", "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(4 << 30)}
    plain = SGLangEngine.from_args(parse_args(["--model-dir", str(tiny_model_dir)]), port=30000)
    assert "--enable-hierarchical-cache" not in plain.command() and plain.env is None
    for bad in (["--rollout-shared-kv-store", "10.0.0.1"], ["--rollout-shared-kv-host-ratio", "1"]):
        with pytest.raises(SystemExit) as ei:
            parse_args(bad)
        assert ei.value.code == 2
    a = parse_args(["--model-dir", str(tiny_model_dir), "--rollout-shared-kv-store", "10.0.0.1:1",
                    "--rollout-shared-kv-host-ratio", "1.5", "--sglang-extra-args", "--hicache-ratio 3"])
    cmd = SGLangEngine.from_args(a, port=1).command()
    assert cmd.count("--hicache-ratio") == 1 and cmd[cmd.index("--hicache-ratio") + 1] == "3"  # the user's wins
    a = parse_args(["--model-dir", str(tiny_model_dir), "--rollout-shared-kv-store", "10.0.0.1:1",
                    "--rollout-shared-kv-host-ratio", "1.5"])
    cmd = SGLangEngine.from_args(a, port=1).command()
    assert cmd[cmd.index("--hicache-ratio") + 1] == "1.5"


def _scripted_sglang(flush_status=200, fail_update_at=None, busy_flushes=0, sessions=False, version=None,
                     left_open=False):
    """An SGLang cell's client over a scripted server: records ``(path, body)`` of each call; its
    first ``busy_flushes`` flushes answer 400 (requests still leaving), then ``flush_status``.  With
    ``sessions`` it keeps SGLang 0.5.23's weight-update session (a load outside one, a second begin,
    an end without one answer 400; ``left_open``: one is open already), without them the session
    calls answer 404; ``/server_info`` reports ``version`` (none when ``None``)."""
    import httpx
    import torch

    from gyre.rollout.client.engine_client import EngineClient
    from gyre.rollout.sglang_driver.weights import SGLangTensorClient

    calls = []
    state = {"open": left_open}

    def fail(message):
        return httpx.Response(400, json={"success": False, "message": message})

    def handler(request):
        path = request.url.path
        body = json.loads(request.content) if request.content else None
        calls.append((path, body))
        if path == "/server_info":
            return httpx.Response(200, json={"version": version} if version else {})
        if path in ("/begin_weight_update", "/end_weight_update"):
            if not sessions:
                return httpx.Response(404, json={"detail": "Not Found"})
            if (path == "/begin_weight_update") == state["open"]:
                return fail("a weight-update session is already open; call end_weight_update() first"
                            if state["open"] else "no weight-update session is open; call begin_weight_update() first")
            state["open"] = not state["open"]
            return httpx.Response(200, json={"success": True, "message": "Success"})
        if path == "/flush_cache":
            if sum(p == "/flush_cache" for p, _ in calls) <= busy_flushes:
                return httpx.Response(400, text="Cache not flushed.")
            return httpx.Response(flush_status, text="Cache flushed." if flush_status == 200 else "Cache not flushed.")
        if path == "/update_weights_from_tensor":
            if sessions and not state["open"]:
                return fail("weights load only inside a weight-update session")
            if fail_update_at == sum(p == path for p, _ in calls):
                return fail("shape mismatch")
        return httpx.Response(200, json={"success": True, "message": "ok"})

    inner = EngineClient("http://sglang", transport=httpx.MockTransport(handler))
    client = SGLangTensorClient(inner, "cpu", 2, serialize=lambda pairs, tp: [",".join(n for n, _ in pairs)] * tp)
    buckets = [{"a": torch.ones(2), "b": torch.ones(1)}, {"c": torch.zeros(3)}]
    client.state = state
    return client, buckets, calls


def _brief(calls):
    return [(p, b.get("mode")) if p == "/pause_generation" else
            (p, b["serialized_named_tensors"], b["flush_cache"], b["weight_version"]) if p == "/update_weights_from_tensor"
            else (p,) for p, b in calls]


def test_a_live_push_to_an_sglang_cell_aborts_flushes_until_idle_then_loads():
    """A live push pauses in abort mode (the proxy retries the aborted requests), flushes until SGLang
    says it is idle (400 while aborted requests are still leaving), loads the buckets with the last
    one flushing (no prefix of the old weights survives), continues."""
    from gyre.rollout.weights import push_weight_buckets

    client, buckets, calls = _scripted_sglang(busy_flushes=2)
    assert push_weight_buckets(client, iter(buckets), "5") == 3
    assert _brief(calls) == [("/pause_generation", "abort"), ("/flush_cache",), ("/flush_cache",), ("/flush_cache",),
                             ("/end_weight_update",), ("/update_weights_from_tensor", ["a,b", "a,b"], False, "5"),
                             ("/update_weights_from_tensor", ["c", "c"], True, "5"),
                             ("/continue_generation",)]
    # never idle: the push gives up, the buckets are drained, the engine stays paused and marked failed
    from gyre.rollout.sglang_driver.weights import WeightPushFailed

    client, buckets, calls = _scripted_sglang(flush_status=400)
    client.idle_timeout_s = 0.2
    with pytest.raises(WeightPushFailed, match="400"):
        push_weight_buckets(client, iter(buckets), "5")
    paths = [c[0] for c in _brief(calls)]
    assert "/update_weights_from_tensor" not in paths and "/continue_generation" not in paths
    assert "400" in client.failed
    # a role switch's load (generation paused, nothing running, so SGLang can flush): the last bucket flushes
    client, buckets, calls = _scripted_sglang()
    assert push_weight_buckets(client, iter(buckets), "6", live=False) == 3
    loads = [c for c in _brief(calls) if c[0] != "/end_weight_update"]
    assert [c[0] for c in loads] == ["/update_weights_from_tensor"] * 2
    assert [c[2] for c in loads] == [False, True]


def test_weight_update_sessions_are_found_by_asking_the_server_not_its_version():
    """A server with weight-update sessions (SGLang 0.5.23) refuses a load outside one, and its
    distributed load would leave the broadcast hanging: whether the server has them is asked of the
    server (``/end_weight_update`` answers 400 with none open, 404 where there are no sessions), so
    a development build, a version-less front end and an older SGLang are all read right.  A push's
    buckets share one session, and a single load opens its own."""
    import torch

    from gyre.rollout.weights import push_weight_buckets

    for version, sessions in (("0.5.23", True), ("0.0.0.dev0", True), (None, True), ("0.5.10.post1", False),
                              (None, False)):
        client, buckets, calls = _scripted_sglang(sessions=sessions, version=version)
        assert push_weight_buckets(client, iter(buckets), "5") == 3
        paths = [c[0] for c in calls]
        assert paths[:3] == ["/pause_generation", "/flush_cache", "/end_weight_update"]  # the probe
        want = ["/update_weights_from_tensor"] * 2
        if sessions:
            want = ["/begin_weight_update", *want, "/end_weight_update"]
        assert paths[3:] == [*want, "/continue_generation"], (version, paths)
        assert "/server_info" not in paths and not client.state["open"]
        calls.clear()
        client.update_weights_from_tensor({"a": torch.ones(1)}, weight_version="6")
        assert [c[0] for c in calls] == (["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]
                                         if sessions else ["/update_weights_from_tensor"])


def test_a_weight_update_session_left_open_on_the_server_is_ended_first():
    """A session an earlier client left open (it died between begin and end) is closed by the probe;
    one left open after the probe makes begin answer 400, and is ended and begun again."""
    import torch

    from gyre.rollout.weights import push_weight_buckets

    client, buckets, calls = _scripted_sglang(sessions=True, left_open=True)
    assert push_weight_buckets(client, iter(buckets), "5") == 3
    assert [c[0] for c in calls][2:5] == ["/end_weight_update", "/begin_weight_update", "/update_weights_from_tensor"]
    assert client.sessions is True and not client.state["open"]
    client.state["open"] = True  # left open again behind this client's back
    calls.clear()
    client.update_weights_from_tensor({"a": torch.ones(1)}, weight_version="6")
    assert [c[0] for c in calls] == ["/begin_weight_update", "/end_weight_update", "/begin_weight_update",
                                     "/update_weights_from_tensor", "/end_weight_update"]
    assert not client.state["open"]


def test_a_failed_live_push_leaves_the_engine_paused_and_drains_the_buckets():
    """SGLang labels the engine with the new version at each bucket it loads: after a failed bucket
    the engine must not serve (no ``/continue_generation``); the next push that succeeds continues."""
    from gyre.rollout.sglang_driver.weights import WeightPushFailed
    from gyre.rollout.weights import push_weight_buckets

    client, buckets, calls = _scripted_sglang(fail_update_at=1)
    drained = []

    def produce():  # the other ranks' collectives produce these: all must be consumed
        for b in buckets:
            drained.append(sorted(b))
            yield b

    with pytest.raises(WeightPushFailed, match="shape mismatch"):
        push_weight_buckets(client, produce(), "7")
    assert drained == [["a", "b"], ["c"]]
    assert [c[0] for c in _brief(calls)] == ["/pause_generation", "/flush_cache", "/end_weight_update",
                                             "/update_weights_from_tensor"]
    assert "shape mismatch" in client.failed
    client, _, calls = _scripted_sglang()
    with pytest.raises(ValueError, match="no weights"):
        push_weight_buckets(client, iter([]), "8")
    assert calls == [] and client.failed is None  # nothing paused


def test_a_cell_with_a_shared_kv_store_empties_it_after_each_load():
    """The shared store's keys carry no weight version: KV of the previous weights must not be served."""
    from gyre.rollout.sglang_driver.engine import SGLangCellEngine
    from gyre.rollout.weights import push_weight_buckets

    for live in (True, False):
        client, buckets, calls = _scripted_sglang()
        client.clear_shared_store = True
        push_weight_buckets(client, iter(buckets), "9", live=live)
        paths = [c[0] for c in _brief(calls)]
        assert paths.count("/hicache/storage-backend/clear") == 1
        assert paths.index("/hicache/storage-backend/clear") > max(
            i for i, p in enumerate(paths) if p == "/update_weights_from_tensor")
    shared = SGLangCellEngine("/m", device="cpu", tp_size=1, port=1,
                              server_argv=["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake"])
    assert shared.client().clear_shared_store
    assert not SGLangCellEngine("/m", device="cpu", tp_size=1, port=1).client().clear_shared_store


def test_an_embedded_format_payload_never_reaches_an_sglang_server():
    """SGLang's scheduler dies unpickling the embedded engine's payload: the plain engine client refuses
    to send one to a server reporting an SGLang version (asked once), and sends it to anything else."""
    import httpx
    import torch

    from gyre.rollout.client.engine_client import EngineClient

    for info, refused in (({"version": "0.5.23"}, True), ({"version": "0.1.0", "engine": "gyre-embedded"}, False),
                          (None, False)):
        calls = []

        def handler(request, info=info, calls=calls):
            calls.append(request.url.path)
            if request.url.path in ("/server_info", "/get_server_info"):
                return httpx.Response(200, json=info) if info else httpx.Response(404, json={})
            return httpx.Response(200, json={"success": True, "message": "ok"})

        client = EngineClient("http://engine", transport=httpx.MockTransport(handler))
        for _ in range(2):
            if refused:
                with pytest.raises(ValueError, match="SGLang server"):
                    client.update_weights_from_tensor({"a": torch.ones(1)}, weight_version="1")
            else:
                assert client.update_weights_from_tensor({"a": torch.ones(1)}, weight_version="1")["success"]
        assert "/update_weights_from_tensor" not in calls if refused else calls.count("/update_weights_from_tensor") == 2
        assert calls.count("/server_info") == 1


def test_a_server_is_started_with_a_health_probe_that_does_not_generate():
    """SGLang's /health generates a token by default (20 s and a 503 on a paused server); Gyre's servers
    get the switch that turns that off, unless their environment sets it."""
    from gyre.rollout.sglang_driver.launch import HEALTH_GENERATION_ENV, server_environment

    assert HEALTH_GENERATION_ENV == "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
    assert server_environment({"RANK": "1", "A": "x"}) == {"A": "x", HEALTH_GENERATION_ENV: "false"}
    assert server_environment({HEALTH_GENERATION_ENV: "1"}) == {HEALTH_GENERATION_ENV: "1"}
