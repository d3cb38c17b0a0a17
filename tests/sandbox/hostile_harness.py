"""A harness for the hostile main-job test: the reference agent, except that three executions of the
first step run a fork bomb, a memory bomb and a disk fill instead (what a policy's commands could do)."""

from __future__ import annotations

import sys

from gyre.harness.execution import LaunchContext, LaunchSpec
from gyre.harness.reference import ReferenceHarness

BOMBS = {
    "e00000": "import os, time\nwhile True:\n    if os.fork() == 0:\n        time.sleep(120); os._exit(0)\n",
    "e00001": "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))\n",
    "e00002": ("import time\nwith open('fill.bin', 'wb') as f:\n    for i in range(400):\n"
               "        f.write(b'x' * (1 << 20)); f.flush(); time.sleep(0.02)\n"),
}


class BombHarness(ReferenceHarness):
    """The reference agent, with the bombs of :data:`BOMBS` in its first executions."""

    def build_command(self, ctx: LaunchContext) -> LaunchSpec:
        bomb = BOMBS.get(ctx.execution_id.rsplit("-", 1)[-1]) if "-g0000-" in ctx.execution_id else None
        if bomb is None:
            return super().build_command(ctx)
        return LaunchSpec([sys.executable, "-c", bomb])
