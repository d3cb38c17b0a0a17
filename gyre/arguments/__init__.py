"""Gyre command-line arguments, in the shape of Megatron-LM's ``arguments`` module (``megatron.training``).

One ``add_<area>_args(parser)`` per concern, each an argument group with kebab-case flags named
after the quantities they set (``N``, ``B``, ``phi``, ``mu``, ``K``, ...), in one module per
area of the job:

* :mod:`gyre.arguments.rollout` -- ``model``, ``rollout``, ``sglang``;
* :mod:`gyre.arguments.cluster` -- ``placement``, ``weight transfer`` and the Megatron-LM-named
  ``distributed`` and ``optimizer`` groups (:func:`add_megatron_core_args`, the few Megatron-LM
  flags Gyre uses, for runs that only install megatron-core, which ships no argument parser);
* :mod:`gyre.arguments.training` -- ``admission``, ``objective``, ``micro-steps``;
* :mod:`gyre.arguments.harness` -- ``harness``, ``evaluation``, ``executions``;
* :mod:`gyre.arguments.proxy` -- ``proxy``;
* :mod:`gyre.arguments.run` -- ``run``.

:func:`add_gyre_args` (:mod:`gyre.arguments.parser`, with :func:`build_parser`, :func:`parse_args`
and :func:`parse_with_config`) adds every Gyre group and can be handed to Megatron's
``parse_args(extra_args_provider=add_gyre_args)``.  The value types are in
:mod:`gyre.arguments.values`, the checks of flags against flags in :mod:`gyre.arguments.checks`.

``--config FILE.yaml`` supplies defaults (:mod:`gyre.arguments.config_file`): keys are flag names
with ``-`` or ``_`` (``steps-per-burst`` or ``steps_per_burst``), values are type-checked like the
flag; command-line flags override the file.  Every error -- unknown flag or key, bad value, broken
invariant -- exits with status 2 and one line naming the flag or key and the reason.
"""

from gyre.arguments.checks import check_main_job_flags, validate_args
from gyre.arguments.cluster import add_megatron_core_args
from gyre.arguments.config_file import load_config_defaults
from gyre.arguments.parser import (GyreArgumentParser, GyreHelpFormatter, add_gyre_args, build_parser, parse_args,
                                   parse_with_config)
from gyre.arguments.values import HARNESS_NAMES, PLACEMENTS, ROLES, ArgumentError

__all__ = ["ArgumentError", "GyreArgumentParser", "GyreHelpFormatter", "HARNESS_NAMES", "PLACEMENTS", "ROLES",
           "add_gyre_args", "add_megatron_core_args", "build_parser", "check_main_job_flags", "load_config_defaults",
           "parse_args", "parse_with_config", "validate_args"]
