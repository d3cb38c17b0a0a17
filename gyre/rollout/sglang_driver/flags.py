"""Every SGLang server flag as a Gyre flag ``--sglang-<flag>`` (dest ``sglang_<name>``), and back.

:func:`add_sglang_arguments` registers all of ``ServerArgs.add_cli_args`` when SGLang is
importable, else the curated subset :data:`CURATED_FLAGS`, and records in :data:`FLAG_SPECS` how
each maps back; :func:`sglang_server_argv` rebuilds SGLang's command line from the flags that were
set (unset flags keep SGLang's defaults).  ``--sglang-extra-args "..."`` appends raw flags; Gyre
sets :data:`MANAGED_FLAGS` itself.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from typing import Any, Mapping


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
