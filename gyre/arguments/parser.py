"""The parsers: :class:`GyreArgumentParser`, :func:`build_parser` (``--config``, the Megatron-LM
subset and every Gyre group), :func:`parse_with_config` and :func:`parse_args`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from gyre.arguments.checks import validate_args
from gyre.arguments.cluster import add_megatron_core_args, add_placement_args, add_weight_transfer_args
from gyre.arguments.config_file import load_config_defaults
from gyre.arguments.harness import add_evaluation_args, add_execution_args, add_harness_args
from gyre.arguments.proxy import add_proxy_args
from gyre.arguments.rollout import add_model_args, add_rollout_args, add_sglang_args
from gyre.arguments.run import add_run_args
from gyre.arguments.training import add_admission_args, add_micro_step_args, add_objective_args
from gyre.arguments.values import ArgumentError


class GyreHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` formatter: each flag's help ends with ``(default: VALUE)``, except where the
    default is ``None`` (unset; the help text says what unset means) or the text already names
    ``%(default)s``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


class GyreArgumentParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors are one line on stderr and exit status 2; ``--help`` shows
    defaults (:class:`GyreHelpFormatter`) unless another ``formatter_class`` is given."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", GyreHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_gyre_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every Gyre argument group; usable as Megatron's ``extra_args_provider``."""
    for add in (add_model_args, add_rollout_args, add_sglang_args, add_placement_args, add_weight_transfer_args,
                add_admission_args, add_objective_args, add_micro_step_args, add_evaluation_args, add_harness_args,
                add_proxy_args, add_execution_args, add_run_args):
        add(parser)
    return parser


def build_parser(
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
    prog: str | None = None,
    description: str = "Gyre: elastic online RL for xLong-horizon agents",
) -> GyreArgumentParser:
    """Parser with ``--config``, the Megatron-LM subset, every Gyre group and any extras."""
    parser = GyreArgumentParser(prog=prog, description=description, allow_abbrev=False)
    parser.add_argument("--config", type=str, default=None,
                        help="YAML file of flag defaults (keys with - or _); flags override it.")
    add_megatron_core_args(parser)
    add_gyre_args(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                      validate: Callable[[argparse.Namespace], argparse.Namespace]) -> argparse.Namespace:
    """Parse ``argv`` with ``parser``, taking defaults from ``--config FILE.yaml`` first, then ``validate``.

    Any :class:`ArgumentError` (from the file, a value or ``validate``) exits with status 2 and one line.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", type=str, default=None)
    known, _ = pre.parse_known_args(argv)
    try:
        if known.config is not None:
            parser.set_defaults(**load_config_defaults(parser, known.config))
        return validate(parser.parse_args(argv))
    except ArgumentError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


def parse_args(
    argv: Sequence[str] | None = None,
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
    prog: str | None = None,
) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) with ``--config`` defaults, then :func:`validate_args`.

    Exits with status 2 and one line on stderr for any error.
    """
    return parse_with_config(build_parser(extra_args_provider, prog=prog), argv, validate_args)
