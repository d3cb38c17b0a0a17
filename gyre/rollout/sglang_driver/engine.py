"""A real SGLang server for a rollout cell on GPUs, driven through the same engine client.

:class:`SGLangEngine` launches ``python -m sglang.launch_server --model-path M --host H
--port P <passthrough>`` in its own process group, waits until ``/health`` answers 200 and
hands out :class:`gyre.rollout.client.engine_client.EngineClient` objects; :meth:`SGLangEngine.stop`
sends SIGTERM to the group, then SIGKILL.

Every SGLang server flag is available to Gyre as ``--sglang-<flag>`` (dest ``sglang_<name>``):
:func:`add_sglang_arguments` registers all of ``ServerArgs.add_cli_args`` when SGLang is
importable, else the curated subset :data:`CURATED_FLAGS`; :func:`sglang_server_argv` rebuilds
SGLang's command line from the flags that were set (unset flags keep SGLang's defaults).
``--sglang-extra-args "..."`` appends raw flags; Gyre sets :data:`MANAGED_FLAGS` itself.
``--rollout-shared-kv-store HOST:PORT`` (a Mooncake master) turns on SGLang's hierarchical cache
with Mooncake as its storage tier (:func:`shared_kv_store_launch`), so every SGLang cell reads and
writes KV pages in one shared store and a request rerouted to another cell finds its prefix there.
For ``/update_weights_from_tensor`` SGLang expects its own serializer (CUDA IPC handles, one
payload per TP rank): :func:`serialize_named_tensors_for_sglang`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from gyre.process_guard import popen_process_group, untrack_process_group
from gyre.rollout.ports import free_port
from gyre.rollout.sglang_driver.weights import (  # noqa: F401  (re-exported: the cell clients live there)
    SGLangGroupClient,
    SGLangTensorClient,
    WeightPushFailed,
    serialize_named_tensors_for_sglang,
)

PREFIX = "sglang_"
#: SGLang flags Gyre sets on the command line itself (never passed through).
MANAGED_FLAGS = frozenset({"model_path", "host", "port"})
#: Extra flag holding raw SGLang arguments (shell syntax).
EXTRA_ARGS_DEST = "sglang_extra_args"


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _fraction(text: str) -> float:
    v = float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


#: ``(sglang name, kind, type, help)`` registered when SGLang itself is not importable.
CURATED_FLAGS: tuple[tuple[str, str, Any, str], ...] = (
    ("tp_size", "value", _positive_int, "Tensor parallel size of one engine."),
    ("dp_size", "value", _positive_int, "Data parallel size (needs --sglang-enable-dp-attention)."),
    ("pp_size", "value", _positive_int, "Pipeline parallel size."),
    ("ep_size", "value", _positive_int, "Expert parallel size."),
    ("mem_fraction_static", "value", _fraction, "Fraction of GPU memory for weights + KV cache."),
    ("context_length", "value", _positive_int, "Model context length."),
    ("max_running_requests", "value", _positive_int, "Most concurrent requests."),
    ("max_prefill_tokens", "value", _positive_int, "Prefill token budget per batch."),
    ("chunked_prefill_size", "value", int, "Chunked prefill size (-1 disables)."),
    ("page_size", "value", _positive_int, "KV cache page size (tokens)."),
    ("dtype", "value", str, "Model dtype (auto, bfloat16, float16, float32)."),
    ("kv_cache_dtype", "value", str, "KV cache dtype."),
    ("attention_backend", "value", str, "Attention kernel backend (fa3, flashinfer, triton, torch_native)."),
    ("sampling_backend", "value", str, "Sampling backend."),
    ("schedule_policy", "value", str, "Request scheduling policy."),
    ("cuda_graph_max_bs", "value", _positive_int, "Largest batch captured in CUDA graphs."),
    ("base_gpu_id", "value", int, "First GPU id of this engine."),
    ("random_seed", "value", int, "Server random seed."),
    ("log_level", "value", str, "SGLang log level."),
    ("weight_version", "value", str, "Initial weight version label."),
    ("enable_memory_saver", "store_true", None, "Needed for release/resume_memory_occupation."),
    ("disable_radix_cache", "store_true", None, "Turn the prefix (radix) cache off."),
    ("disable_cuda_graph", "store_true", None, "Turn CUDA graphs off."),
    ("enable_dp_attention", "store_true", None, "Data-parallel attention."),
    ("enable_deterministic_inference", "store_true", None, "Batch-invariant kernels."),
    ("skip_server_warmup", "store_true", None, "Skip the warm-up request at start."),
    ("trust_remote_code", "store_true", None, "Allow custom model code."),
    ("incremental_streaming_output", "store_true", None, "Stream deltas instead of cumulative chunks."),
)


@dataclass(frozen=True, slots=True)
class SGLangFlag:
    """How one ``--sglang-*`` value maps back onto SGLang's command line.

    ``kind``: ``value`` (``--x V``), ``list`` (``--x V1 V2``), ``store_true`` (``--x`` when
    true), ``store_false`` (``--x`` when false), ``bool_optional`` (``--x`` / ``--no-x``).
    """

    option: str
    kind: str


#: Registered flags by Gyre dest (``sglang_tp_size``); filled by :func:`add_sglang_arguments`.
FLAG_SPECS: dict[str, SGLangFlag] = {}


class _PrefixingParser:
    """Stands in for an ``ArgumentParser`` while SGLang's ``add_cli_args`` registers flags:
    prefixes every long option with ``--sglang-``, forces ``default=None``, records the kind,
    gives a flag without help the help ``SGLang --<flag>.``, skips :data:`MANAGED_FLAGS` and flags
    already present under any of their names (``--tensor-parallel-size`` is ``--tp-size``)."""

    def __init__(self, target, existing: set[str]):
        self.target = target
        self.existing = existing

    def add_argument(self, *flags, **kwargs):
        longs = [f for f in flags if isinstance(f, str) and f.startswith("--")]
        if not longs:
            return None
        name = kwargs.get("dest") or longs[0][2:].replace("-", "_")
        aliases = {name, *(f[2:].replace("-", "_") for f in longs)}
        if any(n in MANAGED_FLAGS or PREFIX + n in self.existing for n in aliases):
            return None  # set by Gyre, or registered already under another of its names
        action = kwargs.get("action")
        if action == "store_true":
            kind = "store_true"
        elif action == "store_false":
            kind = "store_false"
        elif action is argparse.BooleanOptionalAction:
            kind = "bool_optional"
        elif kwargs.get("nargs") in ("+", "*") or isinstance(kwargs.get("nargs"), int) or action == "append":
            kind = "list"
        elif action not in (None, "store"):
            return None  # help/version/custom actions: nothing to pass through
        else:
            kind = "value"
        kw = {k: v for k, v in kwargs.items() if k not in ("dest", "required", "default")}
        option = longs[0]
        if not kw.get("help") or kw["help"] == argparse.SUPPRESS:
            kw["help"] = f"SGLang {option}."
        self.target.add_argument(*("--sglang-" + f[2:] for f in longs), dest=PREFIX + name, default=None, **kw)
        self.existing.add(PREFIX + name)
        FLAG_SPECS[PREFIX + name] = SGLangFlag(option, kind)
        return None

    def add_argument_group(self, *args, **kwargs):
        return self

    def add_mutually_exclusive_group(self, *args, **kwargs):
        return self


def _server_args_class():
    try:
        from sglang.srt.server_args import ServerArgs  # noqa: WPS433 - GPU environment only
    except Exception:  # not installed (CPU environment) or broken CUDA stack
        return None
    return ServerArgs


def add_sglang_arguments(parser, server_args_cls: Any = "auto"):
    """Register ``--sglang-*`` flags on ``parser`` (an ``ArgumentParser`` or argument group).

    Args:
        parser: where to add the flags.
        server_args_cls: a class with SGLang's ``add_cli_args(parser)`` (``"auto"``: SGLang's
            ``ServerArgs`` when importable, else the curated CPU subset; ``None``: curated).
    Returns:
        ``parser``.
    """
    existing: set[str] = set()
    for name, kind, typ, help_text in CURATED_FLAGS:
        dest = PREFIX + name
        option = "--" + name.replace("_", "-")
        if kind == "store_true":
            parser.add_argument("--sglang-" + option[2:], dest=dest, action="store_true", default=None,
                                help=f"SGLang {option}: {help_text}")
        else:
            parser.add_argument("--sglang-" + option[2:], dest=dest, type=typ, default=None,
                                help=f"SGLang {option}: {help_text}")
        FLAG_SPECS[dest] = SGLangFlag(option, kind)
        existing.add(dest)
    parser.add_argument("--sglang-extra-args", dest=EXTRA_ARGS_DEST, type=str, default=None,
                        help="More SGLang server flags, shell-quoted, appended verbatim.")
    existing.add(EXTRA_ARGS_DEST)
    cls = _server_args_class() if server_args_cls == "auto" else server_args_cls
    if cls is not None:
        cls.add_cli_args(_PrefixingParser(parser, existing))
    return parser


def _format(value: Any) -> str:
    return str(value)


def sglang_server_argv(args: argparse.Namespace | Mapping[str, Any]) -> list[str]:
    """SGLang's own flags from every ``sglang_*`` value that was set.

    Args:
        args: a namespace from a parser with :func:`add_sglang_arguments`, or a mapping of
            ``sglang_<name>`` (or bare ``<name>``) to values.
    Returns:
        e.g. ``["--tp-size", "2", "--enable-memory-saver", "--foo", "1"]`` (extra args last).
    Raises:
        ValueError: a :data:`MANAGED_FLAGS` entry, or unparsable ``--sglang-extra-args``.
    """
    items = vars(args).items() if isinstance(args, argparse.Namespace) else args.items()
    argv: list[str] = []
    extra = None
    for key, value in items:
        dest = key if key.startswith(PREFIX) else PREFIX + key
        if dest == EXTRA_ARGS_DEST:
            extra = value
            continue
        if not key.startswith(PREFIX) and isinstance(args, argparse.Namespace):
            continue
        name = dest[len(PREFIX):]
        if value is None:
            continue
        if name in MANAGED_FLAGS:
            raise ValueError(f"--sglang-{name.replace('_', '-')} is set by Gyre itself")
        spec = FLAG_SPECS.get(dest)
        if spec is None:
            kind = "store_true" if isinstance(value, bool) else "list" if isinstance(value, (list, tuple)) else "value"
            spec = SGLangFlag("--" + name.replace("_", "-"), kind)
        if spec.kind == "store_true":
            if value:
                argv.append(spec.option)
        elif spec.kind == "store_false":
            if value is False:
                argv.append(spec.option)
        elif spec.kind == "bool_optional":
            argv.append(spec.option if value else "--no-" + spec.option[2:])
        elif spec.kind == "list":
            flat = [v for group in value for v in (group if isinstance(group, (list, tuple)) else [group])]
            argv += [spec.option, *map(_format, flat)]
        else:
            argv += [spec.option, _format(value)]
    if extra:
        try:
            argv += shlex.split(extra)
        except ValueError as exc:
            raise ValueError(f"--sglang-extra-args: {exc}") from None
    return argv


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


#: How many times :meth:`SGLangEngine.start` chooses another port when the one it chose was taken.
_PORT_RETRIES = 2


class SGLangEngine:
    """One SGLang server process (see module docstring), whose ``/health`` never generates
    (:data:`HEALTH_GENERATION_ENV`).

    Args:
        model_path: HF model directory.
        host, port: where it listens (``port=None``: a free port).
        server_argv: SGLang flags (e.g. from :func:`sglang_server_argv`).
        launcher: command prefix (default ``[python, "-m", "sglang.launch_server"]``).
        env: environment (e.g. ``CUDA_VISIBLE_DEVICES``); default inherits.  Either way torchrun's
            worker variables are left out (:func:`server_environment`).
        log_path: file for the server's stdout/stderr (default: a temp file).
        startup_timeout: seconds to wait for ``/health``.
    """

    def __init__(self, model_path: str | os.PathLike, *, host: str = "127.0.0.1", port: int | None = None,
                 server_argv: Sequence[str] = (), launcher: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None, log_path: str | os.PathLike | None = None,
                 startup_timeout: float = 900.0):
        self.model_path = str(model_path)
        self.host = host
        self.port = port
        self.server_argv = list(server_argv)
        self.launcher = list(launcher) if launcher is not None else [sys.executable, "-m", "sglang.launch_server"]
        self.env = dict(env) if env is not None else None
        self.log_path = Path(log_path) if log_path is not None else None
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._log = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, host: str = "127.0.0.1", port: int | None = None,
                  env: Mapping[str, str] | None = None, extra_argv: Sequence[str] = (),
                  model_path: str | None = None, **kwargs) -> "SGLangEngine":
        """Build from Gyre's parsed arguments (``--model-dir`` unless ``model_path`` is given, the
        ``--sglang-*`` flags and ``--rollout-shared-kv-*``); ``extra_argv`` (e.g. a cell's layout
        flags) comes after them."""
        model = model_path or args.model_dir
        if model is None:
            from gyre.embedded_model import ensure_tiny_model

            model = ensure_tiny_model(args.tokenizer_kind, args.model_cache_dir)
        argv = [*sglang_server_argv(args), *extra_argv]
        store = getattr(args, "rollout_shared_kv_store", None)
        if store:
            extra_argv, extra_env = shared_kv_store_launch(
                store, host, protocol=args.rollout_shared_kv_protocol, device=args.rollout_shared_kv_device,
                segment_bytes=args.rollout_shared_kv_segment_gb << 30,
                host_ratio=args.rollout_shared_kv_host_ratio)
            argv = merge_server_argv(argv, extra_argv)
            env = {**(env if env is not None else os.environ), **extra_env}
        return cls(model, host=host, port=port, server_argv=argv, env=env, **kwargs)

    def command(self) -> list[str]:
        """The full server command line (port chosen if still ``None``)."""
        if self.port is None:
            self.port = free_port(self.host)
        return [*self.launcher, "--model-path", self.model_path, "--host", self.host, "--port", str(self.port),
                *self.server_argv]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, wait_healthy: bool = True) -> "SGLangEngine":
        """Launch and wait until ``/health`` answers 200 (``wait_healthy=False``: launch only, for
        a multi-node server's process on a node other than its first, which serves no HTTP). When
        the port was chosen here (``port=None``) and the server's log reports it already in use,
        the server is launched again on another port, up to :data:`_PORT_RETRIES` times.

        Raises:
            RuntimeError: the process exited, or was not healthy within ``startup_timeout`` s
                (it is stopped; the message ends with the log's last lines).
        """
        import tempfile

        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="sglang-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        chosen_port, launches = self.port is None, 0
        while True:
            launches += 1
            log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
            self._log = open(self.log_path, "ab")
            self.proc = popen_process_group(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                            env=server_environment(self.env))
            if not wait_healthy:
                return self
            try:
                return self._wait_healthy()
            except RuntimeError:
                # a port chosen here that another socket took before the server bound it: choose again
                if not (chosen_port and launches <= _PORT_RETRIES and self._log_says_port_taken(log_start)):
                    raise
                self.port = None

    def _wait_healthy(self) -> "SGLangEngine":
        from gyre.rollout.client.engine_client import EngineClient

        deadline = time.monotonic() + self.startup_timeout
        with EngineClient(self.url, timeout=10.0) as c:
            while True:
                if self.proc.poll() is not None:
                    tail = self.log_tail()
                    self.stop()
                    raise RuntimeError(f"SGLang server exited with status {self.proc.returncode}: {tail}")
                if c.health():
                    return self
                if time.monotonic() > deadline:
                    tail = self.log_tail()
                    self.stop()
                    raise RuntimeError(f"SGLang server not healthy after {self.startup_timeout:.0f} s: {tail}")
                time.sleep(0.5)

    def _log_says_port_taken(self, since: int) -> bool:
        """The server's log since byte ``since`` reports its HTTP port already in use."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(since)
                return b"address already in use" in f.read().lower()
        except OSError:
            return False

    def log_tail(self, lines: int = 20) -> str:
        """Last lines of the server log."""
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except (OSError, TypeError):
            return ""

    def stop(self, timeout: float = 20.0) -> int | None:
        """Abort every request (best effort), SIGTERM the server's main process (which shuts its
        scheduler and detokenizer down), SIGKILL the whole process group after ``timeout`` seconds
        or once the main process is gone; return the exit status.  The abort comes first because
        SGLang's SIGTERM handler waits for running requests, and after a generate with ``n`` > 1
        one of them never finishes."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._abort_all_quietly()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever of the group is left (a child the main process did not reap)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        untrack_process_group(self.proc.pid)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def _abort_all_quietly(self) -> None:
        if self.port is None:
            return
        from gyre.rollout.client.engine_client import EngineClient

        try:
            with EngineClient(self.url, timeout=2.0) as c:
                c.abort_all()
        except Exception:  # a server that cannot answer is killed all the same
            pass

    def client(self, timeout: float | None = 600.0):
        """An :class:`~gyre.rollout.client.engine_client.EngineClient` for this server."""
        from gyre.rollout.client.engine_client import EngineClient

        return EngineClient(self.url, timeout=timeout)

    def __enter__(self) -> "SGLangEngine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class SGLangCellEngine(SGLangEngine):
    """The SGLang server of one cell (``tp_size`` = the cell's GPUs).  Inside one node its clients
    push weights from the cell's GPU (:class:`SGLangTensorClient`, one CUDA IPC payload per engine
    TP rank); over ``nnodes`` > 1 nodes they broadcast them to every engine rank
    (:class:`SGLangGroupClient`, with this host as the group's rank 0)."""

    def __init__(self, model_path, *, device: str, tp_size: int, nnodes: int = 1, **kwargs):
        super().__init__(model_path, **kwargs)
        self.device, self.tp_size, self.nnodes = device, tp_size, nnodes

    def client(self, timeout: float | None = 600.0):
        if self.nnodes > 1:
            c = SGLangGroupClient(super().client(timeout), self.tp_size, self.host)
        else:
            c = SGLangTensorClient(super().client(timeout), self.device, self.tp_size)
        c.clear_shared_store = "--hicache-storage-backend" in self.server_argv
        return c
