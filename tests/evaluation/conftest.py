"""Fixtures for evaluation tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import FakeClock, write_workspace


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A live workspace where 3 of 4 tests pass."""
    return write_workspace(tmp_path / "live")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
