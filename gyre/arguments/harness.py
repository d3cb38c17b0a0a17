"""Flag groups of the executions: ``harness`` (which agent runs which tasks, and for how long),
``evaluation`` (scoring, judges) and ``executions`` (sandboxes, environments, the fleet).
"""

from __future__ import annotations

import argparse

from gyre.arguments.values import HARNESS_NAMES, environment, positive_int, size_or_none
from gyre.sandbox.registry import BACKENDS
from gyre.sandbox.spec import parse_size


def add_harness_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="harness")
    group.add_argument("--harness", type=str, default="reference",
                       help="Black-box harness each execution runs: " + ", ".join(HARNESS_NAMES)
                            + ", or a dotted path pkg.module:Class to a gyre.harness.Harness subclass.")
    group.add_argument("--tasks", type=str, default=None,
                       help="Task file (JSONL/YAML) or directory; several, comma-separated.")
    group.add_argument("--strict-tasks", action="store_true",
                       help="Refuse the run (exit 2) if a task file has any problem; by default each bad task "
                            "is skipped with one 'file:line: reason' warning on stderr.")
    group.add_argument("--execution-timeout-s", type=float, default=600.0,
                       help="Wall-clock budget of one execution (s); timed-out work is still scored.")
    group.add_argument("--harness-isolation", choices=("auto", "require", "off"), default="auto",
                       help="Hide the run directory and tasks' hidden paths from harnesses (mount/pid namespaces).")
    group.add_argument("--harness-max-turns", type=positive_int, default=None,
                       help="Model turns per execution (reference/claude-code max turns, mini-swe-agent step limit).")
    group.add_argument("--reference-tools", type=str, default=None,
                       help="Reference agent tools, comma-separated (default all: bash,read_file,write_file,"
                            "edit_file,delegate).")
    group.add_argument("--reference-compact-threshold-tokens", type=int, default=None,
                       help="Reference agent compacts above this context size (tokens); default 0.75 * seq-length, "
                            "0 disables.")
    group.add_argument("--reference-system-prompt", type=str, default=None,
                       help="Replaces the reference agent's system prompt ('' for none).")
    return parser


def add_evaluation_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="evaluation")
    group.add_argument("--eval-timeout-s", type=float, default=300.0, help="Limit of one assessment (s).")
    group.add_argument("--eval-max-retries", type=int, default=3, help="Retries of an unresolved assessment.")
    group.add_argument("--eval-retry-backoff-s", type=float, default=5.0,
                       help="Wait before the first retry of an unresolved assessment (s); doubles per retry.")
    group.add_argument("--eval-budget-s", type=float, default=None,
                       help="Overall assessment budget of one execution, retries and waits included (s); "
                            "default (eval-max-retries + 1) * eval-timeout-s + the backoff waits.")
    group.add_argument("--custom-rm-path", type=str, default=None,
                       help="Scoring rule 'pkg.mod:fn' (or pkg.mod.fn) of executable evaluators whose task names "
                            "no 'scoring:' (instead of junit): fn takes a gyre.evaluation.CheckResult and returns "
                            "a score, or (score, details); raising gyre.evaluation.Unresolved or returning None "
                            "leaves the assessment unresolved. Judges and tasks with their own 'scoring:' ignore it.")
    group.add_argument("--judge-base-url", type=str, default=None,
                       help="OpenAI-compatible base URL (http://host:port/v1) judge tasks call; default: the run's "
                            "proxy, i.e. the policy judges, with the execution's key and role evaluator (recorded, "
                            "never trained). A task's own evaluator base_url wins.")
    group.add_argument("--judge-model", type=str, default=None,
                       help="'model' of judge requests whose task names none (default: policy).")
    group.add_argument("--judge-api-key-env", type=str, default=None,
                       help="Environment variable holding the key sent to --judge-base-url (needs it).")
    return parser


def add_execution_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="executions")
    group.add_argument("--execution-backend", choices=("auto", *BACKENDS), default="auto",
                       help="Where each execution's harness runs: bwrap (bubblewrap sandbox over the host's root "
                            "read-only, no network), podman / docker (a container of the task's image), local "
                            "(plain processes; paths masked with --harness-isolation). auto: bwrap where it works, "
                            "else local with a warning.")
    group.add_argument("--execution-network", action="store_true",
                       help="Give sandboxes ordinary networking (e.g. package installs); by default a sandbox "
                            "reaches the proxy only.")
    group.add_argument("--execution-pids-limit", type=positive_int, default=1024,
                       help="Processes and threads one sandboxed execution may have at once (bwrap, podman, docker).")
    group.add_argument("--execution-memory-limit", type=size_or_none, default=parse_size("4g"),
                       help="Memory of one sandboxed execution, e.g. 4g (bwrap, podman, docker; 'none': no limit).")
    group.add_argument("--execution-workspace-limit", type=size_or_none, default=parse_size("10g"),
                       help="Size of one execution's directory (workspace, home, tmp), e.g. 10g; past it the "
                            "execution ends as crashed ('none': no limit).")
    group.add_argument("--task-environment", type=environment, default="host",
                       help="Environment of the tasks that name none: host (the machine's root, read-only), "
                            "image:NAME (podman, docker), dockerfile:PATH, rootfs:PATH.")
    group.add_argument("--docker-host", type=str, default=None,
                       help="The Docker daemon the docker backend talks to (DOCKER_HOST; default: the CLI's).")
    group.add_argument("--execution-fleet", type=str, default=None, metavar="ADDRESS|auto",
                       help="Run executions on the nodes of a Ray cluster (needs requirements-fleet.txt): ADDRESS of "
                            "its head (host:port or ray://...), or auto (RAY_ADDRESS or a cluster started on this "
                            "machine with `ray start`, else a one-node fleet started here). Each node offers "
                            "gyre_execution_slot resources and runs executions in its own --execution-backend; rank 0 "
                            "keeps the proxy (see docs/fleet.md).")
    group.add_argument("--fleet-slots-per-node", type=positive_int, default=4,
                       help="--execution-fleet auto without a cluster: execution slots of the one-node fleet "
                            "started here (nodes started with `ray start` declare their own).")
    return parser
