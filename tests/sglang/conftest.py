"""The SGLang tier: Gyre's calls against a real SGLang server on this CPU.

These tests run in the SGLang environment that ``tools/setup_sglang.sh`` installs (its Python has
SGLang, the torch SGLang pins and Gyre): ``bash tools/test_sglang.sh``.  Anywhere else (the CPU
``.venv``) every test here is skipped with one reason.  The ``sglang_server`` fixture starts one
server per session on the embedded tiny Qwen3 (``--device cpu --dtype float32``) through the
environment's ``bin/sglang-server`` launcher, on a free port of 127.0.0.1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
LAUNCHER = Path(sys.prefix) / "bin" / "sglang-server"


def sglang_version() -> str | None:
    """The SGLang version of this interpreter's environment, ``None`` without SGLang or its launcher."""
    import importlib.metadata as md

    try:
        version = md.version("sglang")
    except md.PackageNotFoundError:
        return None
    return version if LAUNCHER.exists() else None


SKIP_REASON = ("the SGLang tier runs in the SGLang environment (bash tools/test_sglang.sh); "
               "this interpreter has no SGLang with Gyre's launcher")


def pytest_collection_modifyitems(config, items):
    if sglang_version() is not None:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)


#: Server flags of every test server: a small KV pool keeps start-up and memory low on 2 cores.
BASE_ARGV = ["--max-total-tokens", "4096", "--context-length", "1024", "--mem-fraction-static", "0.5",
             "--log-level", "warning", "--skip-server-warmup", "--sleep-on-idle"]


def start_server(model_dir, tmp_dir: Path, name: str, extra_argv=(), **kwargs):
    """A started :class:`gyre.rollout.sglang_driver.engine.SGLangEngine` on ``model_dir`` logging to
    ``tmp_dir/<name>.log``."""
    from gyre.rollout.sglang_driver.engine import SGLangEngine

    eng = SGLangEngine(model_dir, launcher=[str(LAUNCHER)], server_argv=[*BASE_ARGV, *extra_argv],
                       log_path=tmp_dir / f"{name}.log", startup_timeout=300, **kwargs)
    return eng.start()


#: What a server that failed writes in its log: an assert (SGLang's idle checks), a payload it could
#: not unpickle or open, a scheduler exception.
LOG_FAILURES = ("AssertionError", "UnpicklingError", "AuthenticationError", "hit an exception",
                "Exception in run_scheduler_process", "SIGQUIT")


def assert_clean_log(eng) -> None:
    """The server's log has none of :data:`LOG_FAILURES` and started once (no restart)."""
    text = Path(eng.log_path).read_text(errors="replace")
    for bad in LOG_FAILURES:
        assert bad not in text, f"{bad} in {eng.log_path}:\n{text[-3000:]}"
    assert text.count("Uvicorn running on") <= 1, f"the server restarted: {eng.log_path}"


@pytest.fixture(scope="session")
def sglang_model_dir():
    from gyre.embedded_model import ensure_tiny_model

    return ensure_tiny_model("qwen")


@pytest.fixture(scope="session")
def sglang_server(sglang_model_dir, tmp_path_factory):
    """A real SGLang server for the session whose weights never change (stopped at its end; its
    log must stay clean)."""
    eng = start_server(sglang_model_dir, tmp_path_factory.mktemp("sglang"), "server")
    try:
        yield eng
    finally:
        eng.stop()
    assert_clean_log(eng)


@pytest.fixture(scope="session")
def cell_server(sglang_model_dir, tmp_path_factory):
    """A second real SGLang server for the session, the one a cell drives: weight pushes, role
    switches, memory release (its weights change; its log must stay clean)."""
    eng = start_server(sglang_model_dir, tmp_path_factory.mktemp("sglang-cell"), "cell", ["--weight-version", "0"])
    try:
        yield eng
    finally:
        eng.stop()
    assert_clean_log(eng)
