"""What an SGLang server is launched with besides its own flags: the shared KV store's flags and
environment, and the process environment.

``--rollout-shared-kv-store HOST:PORT`` (a Mooncake master) turns on SGLang's hierarchical cache
with Mooncake as its storage tier (:func:`shared_kv_store_launch`, merged under the explicit flags
by :func:`merge_server_argv`), so every SGLang cell reads and writes KV pages in one shared store
and a request rerouted to another cell finds its prefix there.  :func:`server_environment` is the
environment a server starts in; :func:`cpu_server_launcher` is the SGLang environment's CPU
launcher, where there is one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping, Sequence


def shared_kv_store_launch(master: str, local_host: str, *, protocol: str = "rdma", device: str = "",
                           segment_bytes: int = 4 << 30, host_ratio: float = 1.2) -> tuple[list[str], dict[str, str]]:
    """SGLang flags and environment for a hierarchical cache backed by a shared Mooncake store.

    Args:
        master: ``host:port`` of the Mooncake master every cell uses.
        local_host: this server's address (Mooncake peers reach its segment there).
        protocol: ``rdma`` or ``tcp``; ``device``: RDMA NIC names (``"mlx5_0,mlx5_1"``; empty: auto).
        segment_bytes: host memory this server contributes to the shared store.
        host_ratio: SGLang's host KV pool as a multiple of the GPU pool (``--hicache-ratio``,
            per rank; SGLang needs it above 1, and its default of 2 in pinned host memory rarely
            fits a node with one server per GPU).

    Returns:
        ``(argv, env)``: ``--enable-hierarchical-cache --hicache-storage-backend mooncake`` with a
        page-first layout written through to the store, a host pool of ``host_ratio``, prefetch
        from the store bounded by SGLang's timeout policy, and the ``MOONCAKE_*`` variables SGLang's
        Mooncake backend reads (peers found by P2P handshake, no metadata server).  Flags given
        explicitly (``--sglang-*``, ``--sglang-extra-args``) win over these (:func:`merge_server_argv`).

    Raises:
        ValueError: ``master`` is not ``host:port`` or ``protocol`` unknown.
    """
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"shared KV store must be the Mooncake master's host:port, not {master!r}")
    if protocol not in ("rdma", "tcp"):
        raise ValueError(f"shared KV store protocol must be rdma or tcp, not {protocol!r}")
    argv = ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake", "--hicache-write-policy",
            "write_through", "--hicache-mem-layout", "page_first", "--hicache-ratio", str(host_ratio),
            "--hicache-storage-prefetch-policy", "timeout", "--page-size", "64"]
    env = {"MOONCAKE_MASTER": master, "MOONCAKE_PROTOCOL": protocol, "MOONCAKE_DEVICE": device,
           "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE", "MOONCAKE_LOCAL_HOSTNAME": local_host,
           "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(int(segment_bytes))}
    return argv, env


def merge_server_argv(argv: Sequence[str], defaults: Sequence[str]) -> list[str]:
    """``argv`` plus those flags of ``defaults`` (``--flag [value]`` pairs) it does not set itself."""
    given = {a for a in argv if a.startswith("--")}
    out, i = list(argv), 0
    while i < len(defaults):
        flag, j = defaults[i], i + 1
        while j < len(defaults) and not defaults[j].startswith("--"):
            j += 1
        if flag not in given:
            out += defaults[i:j]
        i = j
    return out


#: Variables torchrun gives its workers; a server launched by one must not inherit them (with
#: ``TORCHELASTIC_USE_AGENT_STORE`` torch's ``tcp://`` rendezvous hosts no store, so SGLang's own
#: process-group set-up would wait for one forever).
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


#: SGLang's switch for ``GET /health`` generating a token.  Gyre's servers run with it off
#: (:func:`server_environment`): a generating probe of a paused engine, or of one whose memory is
#: released, waits 20 s, answers 503 and leaves the server marked unhealthy.  Off, ``/health``
#: answers 503 only while the server starts or shuts down; ``/health_generate`` still generates.
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"


def server_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) without torchrun's worker variables (:data:`TORCHRUN_ENV`
    and every ``TORCHELASTIC_*``), and with :data:`HEALTH_GENERATION_ENV` ``false`` unless ``env``
    sets it."""
    base = os.environ if env is None else env
    out = {k: v for k, v in base.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
    out.setdefault(HEALTH_GENERATION_ENV, "false")
    return out


def cpu_server_launcher() -> Path | None:
    """``bin/sglang-server`` of the SGLang environment this interpreter runs in (written by
    ``tools/setup_sglang.sh``: ``sglang.launch_server --device cpu --dtype float32`` with the
    environment SGLang needs on a CPU), ``None`` outside one."""
    path = Path(sys.prefix) / "bin" / "sglang-server"
    return path if path.is_file() else None
