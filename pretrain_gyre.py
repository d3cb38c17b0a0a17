"""Gyre's main job, in the shape of Megatron-LM's ``pretrain_gpt.py``.

    torchrun --nproc-per-node K pretrain_gyre.py --config examples/cpu_tiny.yaml [--flag value ...]

Parse the arguments (Megatron-style groups, ``--config`` YAML), check them before anything starts
(exit 2 and one line), then hand over to :func:`gyre.runtime.pretrain.pretrain`: every rank becomes
a cell (engine + training replica); rank 0 also runs the scheduler, proxy, harness launcher and
evaluators.  The pipeline's arrows are the functions of :mod:`gyre.runtime.pipeline`:

* ``run_execution``   -- harness -> proxy -> trajectory tree -> evaluation (one execution);
* ``assemble_group``  -- buffer -> advantages -> admission -> materialise -> pack (one ready group);
* ``train_on_stream`` -- claim -> accumulate -> reduce -> one core update (one cell, one step);
* ``publish_to_engines`` -- core snapshot -> rollout engines.

Extension points: the harness (``--harness NAME``, :class:`gyre.harness.Harness`), the task's
evaluator or reward function (a task's ``scoring``, :mod:`gyre.evaluation`) and the loss
(``--loss-type`` and the objective flags, :mod:`gyre.rl.objective`).  Everything lands under
``--run-dir``; rank 0 prints the summary.  ``--check-config`` only checks (for the WORLD_SIZE in
the environment) and exits 0 or 2.
"""

import gc
import json
import logging
import os
import sys

from gyre.arguments import ArgumentError, parse_args
from gyre.process_guard import die_with_parent, exit_on_termination, kill_tracked_process_groups


def extra_args_provider(parser):
    group = parser.add_argument_group(title="main job")
    group.add_argument("--check-config", action="store_true", help="Check the configuration and exit.")
    group.add_argument("--no-progress", action="store_true", help="No progress bar on the console.")
    return parser


def main(argv=None) -> int:
    args = parse_args(argv, extra_args_provider=extra_args_provider, prog="pretrain_gyre.py")
    from gyre.runtime.accounting import format_summary
    from gyre.runtime.job_checks import check_main_job_args

    try:
        check_main_job_args(args)
    except ArgumentError as exc:
        if os.environ.get("RANK", "0") == "0":  # one line, not one per rank
            print(f"pretrain_gyre.py: error: {exc}", file=sys.stderr)
        return 2
    if args.check_config:
        return 0
    from gyre.runtime.pretrain import pretrain  # Torch and the job, once the checks (which import what they need) pass
    if "LOCAL_RANK" in os.environ:  # a torchrun rank: end with the launcher, even if it is SIGKILLed
        die_with_parent()
    exit_on_termination()  # SIGTERM/SIGHUP: harnesses and engines die with the rank, nothing more is written
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("megatron", "httpx", "uvicorn", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        summary = pretrain(args)
    except ArgumentError as exc:  # found once the job started (e.g. the run directory is taken)
        print(f"pretrain_gyre.py: error: {exc}", file=sys.stderr)
        return 2
    except BaseException:  # a failed rank ends at once (threads, harnesses and all): torchrun stops the others
        logging.getLogger("gyre").exception("the job failed on rank %s", os.environ.get("RANK", "0"))
        kill_tracked_process_groups()
        sys.stderr.flush()
        os._exit(1)
    if summary is not None:
        print(format_summary(summary), file=sys.stderr)
        print(f"gyre: run directory {os.path.abspath(args.run_dir)}", file=sys.stderr)
        print(json.dumps(summary))
    # the objects alive now live until the process ends: the interpreter's collections at exit skip
    # them (they traversed Torch's and Megatron's objects for seconds on each rank); nothing is unfinished
    gc.freeze()
    return 0


if __name__ == "__main__":
    sys.exit(main())
