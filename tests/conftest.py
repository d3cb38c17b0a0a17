"""Shared fixtures: the embedded models (built once into the cache), the steering repo's shared/."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("GYRE_SHARED_DIR", ROOT.parent / "shared"))


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
def shared_dir() -> Path:
    """The steering repo's ``shared/`` (DESIGN.md, traces); tests skip when it is absent."""
    if not (SHARED / "traces").is_dir():
        pytest.skip(f"shared/ not found at {SHARED} (set GYRE_SHARED_DIR)")
    return SHARED
