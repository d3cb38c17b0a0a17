"""What Gyre asks of a cell's real SGLang server without generating or loading anything: whether it
has weight-update sessions (and closing one left open), and ``/health`` while the server is paused
or its memory released (Gyre's servers answer it without generating a token)."""

from __future__ import annotations

from pathlib import Path


def test_weight_update_sessions_are_asked_of_the_server_and_one_left_open_is_ended(cell_server, sglang_model_dir):
    """SGLang 0.5.23 answers ``/end_weight_update`` with 400 when no session is open; a session left
    open (a pusher that died between begin and end) is ended by the next client before it loads."""
    from safetensors.torch import load_file

    from gyre.rollout.client.messages import EngineError
    from gyre.rollout.client.sglang_protocol import probe_weight_update_sessions
    from gyre.rollout.sglang_driver.weights import SGLangTensorClient

    with cell_server.client() as c:
        assert probe_weight_update_sessions(c) is True
        version = c.get_weight_version()
        c.begin_weight_update()  # left open
        try:
            c.begin_weight_update()
            raise AssertionError("a second session began")
        except EngineError as exc:
            assert exc.status_code == 400 and "already open" in exc.message
        cell = SGLangTensorClient(cell_server.client(), "cpu", 1)
        norm = {"model.norm.weight": load_file(str(sglang_model_dir / "model.safetensors"))["model.norm.weight"]}
        assert cell.update_weights_from_tensor(norm, weight_version=version)["success"]
        assert cell.sessions is True
        assert probe_weight_update_sessions(c) is True  # 400 again: the load's session was ended
        assert c.get_weight_version() == version


def test_health_of_a_paused_or_released_engine_answers_at_once_without_generating(cell_server):
    """A generating ``/health`` waits for a token a paused server never makes: 20 s, then 503, and the
    server stays marked unhealthy.  Gyre's servers answer it at once, and generate afterwards."""
    from gyre.rollout.client.engine_client import flush_when_idle

    with cell_server.client(timeout=60) as c:
        c.pause_generation("abort")
        try:
            assert c.health()  # paused
            flush_when_idle(c)
            c.release_memory_occupation(None)
            try:
                assert c.health()  # paused, memory released
            finally:
                c.resume_memory_occupation(None)
        finally:
            c.continue_generation()
        assert c.health() and c.generate([1, 2, 3], {"max_new_tokens": 2}).completion_tokens == 2
    assert "Health check failed" not in Path(cell_server.log_path).read_text(errors="replace")
