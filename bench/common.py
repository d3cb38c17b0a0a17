"""What every bench may share: the checkout's root and Gyre's own choice of a free port."""

from __future__ import annotations

from pathlib import Path

from gyre.rollout.ports import free_port

__all__ = ["ROOT", "free_port"]

ROOT = Path(__file__).resolve().parents[1]
