"""How the main job builds each task's designated evaluator from the run's flags.

:class:`EvaluatorSettings` holds the evaluation flags that shape an evaluator (not the retry
policy: :class:`~gyre.evaluation.RetryPolicy`) and :meth:`EvaluatorSettings.build` turns one
task's evaluator spec into its :class:`~gyre.evaluation.Evaluator`:

* executable checks whose task names no ``scoring:`` use ``--custom-rm-path`` (else ``junit``);
* judges call the run's proxy by default (``{proxy}/v1``): the policy itself judges, with the
  execution's key and ``x-gyre-role: evaluator``, so the proxy records the calls in the
  execution's tree with evaluator provenance, never trained; with ``--judge-base-url`` they call
  that OpenAI-compatible endpoint instead, as ``--judge-model``, with the key held in the
  environment variable ``--judge-api-key-env`` (``Bearer none`` without one: the execution's
  proxy key is never sent elsewhere). A task's own ``base_url``/``model`` win.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from gyre.evaluation.assessment import Evaluator

__all__ = ["EvaluatorSettings"]


@dataclass(frozen=True)
class EvaluatorSettings:
    """The evaluator-shaping flags of a run (module docstring).

    * ``default_rule`` -- ``--custom-rm-path``: scoring rule of executable checks naming none;
    * ``default_timeout_s`` -- ``--eval-timeout-s``: limit of a check or judge naming none;
    * ``judge_base_url`` -- ``--judge-base-url``; ``None``: the run's proxy;
    * ``judge_model`` -- ``--judge-model``: ``model`` of judge requests naming none;
    * ``judge_api_key_env`` -- ``--judge-api-key-env``: environment variable holding the key of
      ``judge_base_url`` (read when an evaluator is built).
    """

    default_rule: str | None = None
    default_timeout_s: float = 300.0
    judge_base_url: str | None = None
    judge_model: str | None = None
    judge_api_key_env: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EvaluatorSettings":
        return cls(default_rule=getattr(args, "custom_rm_path", None),
                   default_timeout_s=float(getattr(args, "eval_timeout_s", 300.0)),
                   judge_base_url=getattr(args, "judge_base_url", None),
                   judge_model=getattr(args, "judge_model", None),
                   judge_api_key_env=getattr(args, "judge_api_key_env", None))

    def build(self, task: Any, proxy_openai_base_url: str,
              command_runner: Callable[..., Any] | None = None) -> Evaluator:
        """The designated evaluator of ``task`` (a :class:`~gyre.tasks.TaskSpec`); judges without a
        configured endpoint call ``proxy_openai_base_url`` (``http://host:port/v1``); executable
        checks run their commands with ``command_runner`` (``None``: as ordinary processes).

        Raises:
            ValueError / ImportError / TypeError: the spec cannot be built (bad spec, a scoring rule
            that does not load, ``judge_api_key_env`` not set).
        """
        api_key = None
        if self.judge_api_key_env:
            api_key = os.environ.get(self.judge_api_key_env)
            if not api_key:
                raise ValueError(f"the judge's key variable ${self.judge_api_key_env} is not set")
        elif self.judge_base_url:
            api_key = "none"  # the execution's proxy key never leaves for another endpoint
        return task.build_evaluator(default_rule=self.default_rule, default_timeout_s=self.default_timeout_s,
                                    judge_base_url=self.judge_base_url or proxy_openai_base_url,
                                    judge_model=self.judge_model, judge_api_key=api_key,
                                    command_runner=command_runner)
