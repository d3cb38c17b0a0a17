"""A scoring rule for tests that need a learning signal from any policy: the reward is a digest of the
harness's final message mapped to [0, 1], so two executions with different replies get (almost surely)
different rewards, and a group of sampled replies has non-zero advantages."""

from __future__ import annotations

import hashlib

from gyre.evaluation import CheckResult
from gyre.tasks.rules import FINAL_MESSAGE_KEY


def reply_digest(result: CheckResult) -> tuple[float, dict]:
    """The first 32 bits of the final message's sha256 over ``2**32 - 1`` (a missing message is ``""``)."""
    got = result.target.metadata.get(FINAL_MESSAGE_KEY)
    got = got if isinstance(got, str) else ""
    score = int(hashlib.sha256(got.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return score, {"final_message": got[-200:]}
