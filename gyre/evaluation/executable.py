"""Executable checks: run the task's tests on a copy of the preserved workspace.

:class:`ExecutableCheck` copies the preserved workspace into a fresh evaluation directory,
runs the test command there in its own process group under a time limit
(:func:`~gyre.evaluation.process.run_command`), and scores the result with a scoring rule:
``"junit"`` (:func:`fraction_passed_rule`, default), ``"exit_code"`` (:func:`exit_code_rule`),
``"stdout_score"`` (:func:`stdout_score_rule`) or a custom callable / dotted path
(:func:`load_callable`). The preserved workspace is digested before and after, and mounted
read-only during the command where supported; any change discards the attempt.

An attempt the check cannot score is :class:`~gyre.evaluation.Unresolved`, never 0. The command
runs as an ordinary process unless a ``command_runner`` puts it in a sandbox (the main job runs it
in a sandbox of the task's environment from the run's execution backend).
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import shlex
import shutil
import stat
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.evaluation.assessment import Assessment, EvaluationTarget, Evaluator, Unresolved
from gyre.evaluation.junit import JUnitCounts, JUnitParseError, parse_junit_file
from gyre.evaluation.process import CommandRun, readonly_mounts_supported, run_command
from gyre.evaluation.workspace import tree_digest

__all__ = [
    "CheckResult",
    "ExecutableCheck",
    "ScoringRule",
    "BUILTIN_RULES",
    "exit_code_rule",
    "fraction_passed_rule",
    "load_callable",
    "resolve_scoring_rule",
]

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class CheckResult:
    """What the test command did -- the input of a scoring rule.

    * ``returncode`` -- exit status (negative: killed by a signal);
    * ``duration_s`` -- command wall time (seconds; for the record only -- rules must not
      turn it into reward);
    * ``stdout_tail`` / ``stderr_tail`` -- the last characters of the output;
    * ``junit`` -- parsed report, or ``None`` with ``junit_error`` saying why;
    * ``junit_skipped`` -- ``"fail"`` or ``"exclude"`` (how ``"junit"`` counts skipped tests);
    * ``workspace`` -- the evaluation copy (exists while the rule runs);
    * ``target`` -- the assessed target.
    """

    returncode: int
    duration_s: float
    stdout_tail: str
    stderr_tail: str
    junit: JUnitCounts | None
    junit_error: str | None
    junit_skipped: str
    workspace: Path
    target: EvaluationTarget


#: A scoring rule maps a :class:`CheckResult` to a score, or ``(score, details)``; it raises
#: :class:`~gyre.evaluation.Unresolved` (or returns ``None``) when it cannot decide.
ScoringRule = Callable[[CheckResult], "float | tuple[float, dict[str, Any]] | None"]


def fraction_passed_rule(result: CheckResult) -> tuple[float, dict[str, Any]]:
    """Fraction of tests passed according to the JUnit report (``"junit"``)."""
    if result.junit is None:
        raise Unresolved(f"no usable JUnit report: {result.junit_error}")
    try:
        score = result.junit.fraction_passed(result.junit_skipped)
    except ZeroDivisionError:
        raise Unresolved("the JUnit report holds no tests") from None
    return score, {"junit": result.junit.as_dict()}


def exit_code_rule(result: CheckResult) -> float:
    """1.0 when the command exited 0, else 0.0 (``"exit_code"``); not-found/not-executable
    (126, 127) and death by a signal are unresolved."""
    return 1.0 if _command_ran(result) == 0 else 0.0


def _command_ran(result: CheckResult) -> int:
    """The exit status, or :class:`Unresolved` when the command never ran (126/127) or died by a signal."""
    rc = result.returncode
    if rc in (126, 127):
        raise Unresolved(f"test command not executable or not found (exit {rc})")
    if rc < 0:
        raise Unresolved(f"test command killed by signal {-rc}")
    return rc


def stdout_score_rule(result: CheckResult) -> tuple[float, dict[str, Any]]:
    """The number the command printed as the last non-empty line of its stdout
    (``"stdout_score"``; a reward script that grades partial credit, e.g. 1.0 right, 0.1 well
    formed but wrong); no such number, or exit 126/127 or a signal, is unresolved."""
    rc = _command_ran(result)
    lines = [ln.strip() for ln in result.stdout_tail.splitlines() if ln.strip()]
    try:
        score = float(lines[-1])
    except (IndexError, ValueError):
        last = lines[-1][:80] if lines else "(empty)"
        raise Unresolved(f"the last line of stdout is not a number: {last!r}") from None
    return score, {"exit_code": rc}


#: Built-in rules by name.
BUILTIN_RULES: dict[str, ScoringRule] = {
    "junit": fraction_passed_rule,
    "fraction_passed": fraction_passed_rule,
    "exit_code": exit_code_rule,
    "stdout_score": stdout_score_rule,
}


def load_callable(path: str) -> Callable[..., Any]:
    """Import ``pkg.mod:fn`` or ``pkg.mod.fn`` (``fn`` may be ``Class.method``).

    Raises:
        ValueError: malformed path. ImportError / AttributeError: not found.
        TypeError: the object is not callable.
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"dotted path expected, got {path!r}")
    if ":" in path:
        mod_name, _, attr = path.partition(":")
        if not mod_name or not attr:
            raise ValueError(f"dotted path must be 'module:function' or 'module.function', got {path!r}")
        obj: Any = importlib.import_module(mod_name)
    else:
        parts = path.split(".")
        if len(parts) < 2 or not all(parts):
            raise ValueError(f"dotted path must be 'module:function' or 'module.function', got {path!r}")
        obj = None
        for i in range(len(parts) - 1, 0, -1):  # longest importable module prefix
            mod_name = ".".join(parts[:i])
            try:
                obj = importlib.import_module(mod_name)
            except ModuleNotFoundError as exc:
                if exc.name is not None and not mod_name.startswith(exc.name):
                    raise  # the module exists but one of *its* imports is missing
                continue
            attr = ".".join(parts[i:])
            break
        if obj is None:
            raise ModuleNotFoundError(f"no module found for {path!r}", name=parts[0])
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{path} is not callable")
    return obj


def resolve_scoring_rule(spec: str | ScoringRule) -> tuple[str, ScoringRule]:
    """``(name, rule)`` from a built-in name (:data:`BUILTIN_RULES`), a dotted path or a callable."""
    if callable(spec):
        return getattr(spec, "__qualname__", repr(spec)), spec
    if spec in BUILTIN_RULES:
        return spec, BUILTIN_RULES[spec]
    return spec, load_callable(spec)


def _tail(path: Path, chars: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4 * chars))
            return f.read().decode("utf-8", errors="replace")[-chars:]
    except OSError:
        return ""


def _rmtree(path: Path) -> None:
    def onerror(func, p, exc_info):  # a test may leave read-only directories behind
        try:
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            if not os.path.islink(p):
                os.chmod(p, stat.S_IRWXU)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=onerror)


class ExecutableCheck(Evaluator):
    """Run the task's test command on a copy of the preserved workspace.

    One attempt:

    1. (``verify_source``) digest the preserved workspace (:func:`~gyre.evaluation.tree_digest`);
       if it no longer matches a ``sha256:`` ``assessed_ref`` the attempt is unresolved;
    2. copy it (``shutil.copytree``, symlinks kept as links) to a fresh evaluation directory
       ``<eval_root>/<execution>-a<attempt>-XXXX/`` holding ``workspace/`` (the copy),
       ``home/``, ``tmp/``, ``junit.xml``, ``stdout.txt`` and ``stderr.txt``;
    3. run the command with ``cwd`` = the copy, ``HOME``/``TMPDIR``/``TMP``/``TEMP``/
       ``XDG_CACHE_HOME`` inside the evaluation directory, in its own process group with the
       time limit (``SIGTERM`` then ``SIGKILL`` to the whole group);
    4. score the result with the scoring rule (``"junit"``: fraction of tests passed in the
       JUnit report; ``"exit_code"``: 0 -> 1.0, else 0.0; ``"stdout_score"``: the number on the
       last line of stdout; or a custom rule, ``pkg.mod:fn`` or ``pkg.mod.fn``);
    5. digest the preserved workspace again; a change makes the attempt unresolved (logged as
       an error);
    6. delete the evaluation directory (unless ``keep_eval_dirs``).

    Command placeholders, replaced literally in every argument (for a shell-string command, by
    shell-quoted words; other braces are left alone): ``{junit_xml}`` (report path),
    ``{workspace}`` (the copy), ``{python}`` (this interpreter), ``{eval_dir}``. Example:
    ``["{python}", "-m", "pytest", "-q", "--junitxml={junit_xml}"]``.

    Unresolved, never 0: the command ran past its limit; the report is missing, not XML or has
    no tests (``"junit"``); the command was not found / not executable (exit 126/127) or died
    by a signal (``"exit_code"``); a custom rule raised, returned ``None`` or a non-finite
    score; the copy or the command could not be started; the preserved workspace changed.

    Write confinement (no more is claimed): cwd, ``HOME`` and temporary directories are inside
    the evaluation directory, so relative and home/temp writes land in the copy; with
    ``readonly_source="auto"`` (default; probed with
    :func:`~gyre.evaluation.readonly_mounts_supported`) the preserved workspace is also
    bind-mounted read-only in a private mount namespace for the command, so an absolute-path
    write to it fails (root included) -- if that mount fails at run time the command runs
    without it, with a warning; and the before/after digests detect any change. Writes to
    other absolute paths (``/tmp``, the network) are *not* prevented.

    Args:
        command: argument list (no shell) or a shell string (run with ``sh -c``).
        scoring: ``"junit"`` (default), ``"exit_code"``, a dotted path or a callable rule.
        timeout_s: limit of the command (seconds); an attempt's ``timeout_s`` may lower it.
        env: extra environment variables (the evaluator's own environment is inherited;
            ``HOME``/``TMPDIR``/... always point into the evaluation directory).
        eval_root: where evaluation directories are created (default: the system temp dir).
        kill_grace_s: seconds between ``SIGTERM`` and ``SIGKILL`` at the limit.
        readonly_source: ``"auto"`` (read-only mount of the preserved workspace when
            supported), ``"require"`` (unresolved when unsupported) or ``"off"``.
        verify_source: digest the preserved workspace before and after.
        junit_skipped: ``"fail"`` (a skipped test counts as not passed; default) or
            ``"exclude"`` (skipped tests leave the denominator).
        keep_eval_dirs: keep evaluation directories (debugging); their path is in ``details``.
        name: recorded with each assessment.
        clock: monotonic seconds (injected for tests).
        command_runner: runs the test command instead of
            :func:`~gyre.evaluation.process.run_command` (same arguments and result), e.g. inside a
            sandbox of the task's environment that binds the preserved workspace read-only
            (:class:`gyre.sandbox.evaluation_runner.SandboxCommandRunner`).

    Raises:
        ValueError: bad ``timeout_s``, ``readonly_source`` or ``junit_skipped``.
        ImportError / AttributeError: a dotted-path rule cannot be loaded (at construction,
            so a misconfigured task fails fast rather than as unresolved assessments).
    """

    def __init__(
        self,
        command: str | Sequence[str],
        *,
        scoring: str | ScoringRule = "junit",
        timeout_s: float = 300.0,
        env: Mapping[str, str] | None = None,
        eval_root: str | os.PathLike[str] | None = None,
        kill_grace_s: float = 2.0,
        readonly_source: str = "auto",
        verify_source: bool = True,
        junit_skipped: str = "fail",
        keep_eval_dirs: bool = False,
        output_tail_chars: int = 4000,
        name: str = "executable",
        clock: Callable[[], float] = time.monotonic,
        command_runner: Callable[..., CommandRun] | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if readonly_source not in ("auto", "require", "off"):
            raise ValueError(f"readonly_source must be auto/require/off, got {readonly_source!r}")
        if junit_skipped not in ("fail", "exclude"):
            raise ValueError(f"junit_skipped must be 'fail' or 'exclude', got {junit_skipped!r}")
        if isinstance(command, str):
            if not command.strip():
                raise ValueError("empty test command")
        elif not command:
            raise ValueError("empty test command")
        self.command = command if isinstance(command, str) else tuple(str(c) for c in command)
        self.rule_name, self.rule = resolve_scoring_rule(scoring)
        self.timeout_s = float(timeout_s)
        self.env = dict(env or {})
        self.eval_root = None if eval_root is None else Path(eval_root)
        self.kill_grace_s = float(kill_grace_s)
        self.readonly_source = readonly_source
        self.command_runner = command_runner
        self.verify_source = verify_source
        self.junit_skipped = junit_skipped
        self.keep_eval_dirs = keep_eval_dirs
        self.output_tail_chars = int(output_tail_chars)
        self.name = name
        self.clock = clock

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _substitute(text: str, fields: Mapping[str, str]) -> str:
        for key, value in fields.items():  # only the known placeholders; other braces stay
            text = text.replace("{" + key + "}", value)
        return text

    def _argv(self, fields: Mapping[str, str]) -> list[str]:
        if isinstance(self.command, str):
            return ["sh", "-c", self._substitute(self.command, {k: shlex.quote(v) for k, v in fields.items()})]
        return [self._substitute(c, fields) for c in self.command]

    def _environment(self, eval_dir: Path, workspace: Path, junit: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        home, tmp = eval_dir / "home", eval_dir / "tmp"
        env.update({
            "HOME": str(home), "TMPDIR": str(tmp), "TMP": str(tmp), "TEMP": str(tmp),
            "XDG_CACHE_HOME": str(home / ".cache"), "PWD": str(workspace),
            "GYRE_EVAL_JUNIT_XML": str(junit), "GYRE_EVAL_WORKSPACE": str(workspace),
        })
        return env

    def _use_readonly(self) -> bool | None:
        """True/False, or None when required but unsupported."""
        if self.readonly_source == "off":
            return False
        if self.command_runner is not None:  # a sandbox binds the preserved workspace read-only itself
            return True
        supported = readonly_mounts_supported()
        if self.readonly_source == "require" and not supported:
            return None
        return supported

    # ------------------------------------------------------------------ evaluate

    def evaluate(self, target: EvaluationTarget, *, timeout_s: float | None = None) -> Assessment:
        start = self.clock()
        ref = target.assessed_ref
        details: dict[str, Any] = {"evaluator": self.name, "rule": self.rule_name}

        def done(score: float | None, reason: str | None = None) -> Assessment:
            dur = self.clock() - start
            if reason is not None:
                return Assessment.unresolved(reason, ref, details, dur)
            return Assessment.valid_score(score, ref, details, dur)

        src = target.workspace
        if not src.is_dir():
            return done(None, f"preserved workspace not found: {src}")
        limit = self.timeout_s if timeout_s is None else min(self.timeout_s, float(timeout_s))
        if not limit > 0:
            return done(None, "no time left for the check")
        use_ro = self._use_readonly()
        if use_ro is None:
            return done(None, "read-only source required but read-only mounts are unsupported here")
        eval_dir: Path | None = None
        try:
            before = tree_digest(src) if self.verify_source else None
            if before is not None and ref.startswith("sha256:") and before != ref:
                return done(None, f"preserved workspace changed since preservation ({before} != {ref})")
            if self.eval_root is not None:
                self.eval_root.mkdir(parents=True, exist_ok=True)
            eval_dir = Path(tempfile.mkdtemp(prefix=f"{target.execution_id}-a{target.attempt}-",
                                             dir=self.eval_root))
            score, reason = self._run_and_score(target, eval_dir, limit, use_ro, details)
            if before is not None:
                after = tree_digest(src)
                if after != before:
                    logger.error("evaluation of %s modified its preserved workspace %s", target.execution_id, src)
                    details["source_modified"] = True
                    return done(None, "the preserved workspace was modified during evaluation")
            return done(score, reason)
        except Exception as exc:  # evaluator crash -> unresolved, never 0
            details["traceback"] = traceback.format_exc(limit=8)
            return done(None, f"evaluator crashed: {type(exc).__name__}: {exc}")
        finally:
            if eval_dir is not None and not self.keep_eval_dirs:
                _rmtree(eval_dir)

    def _run_and_score(self, target: EvaluationTarget, eval_dir: Path, limit: float, use_ro: bool,
                       details: dict[str, Any]) -> tuple[float | None, str | None]:
        """Copy, run, parse, score: ``(score, None)`` or ``(None, reason)``."""
        src = target.workspace
        work = eval_dir / "workspace"
        shutil.copytree(src, work, symlinks=True)
        for sub in ("home", "tmp"):
            (eval_dir / sub).mkdir()
        junit, out, err = eval_dir / "junit.xml", eval_dir / "stdout.txt", eval_dir / "stderr.txt"
        fields = {"junit_xml": str(junit), "workspace": str(work), "python": sys.executable,
                  "eval_dir": str(eval_dir)}
        if self.keep_eval_dirs:
            details["eval_dir"] = str(eval_dir)

        def run_once(readonly: bool) -> CommandRun:
            details["isolation"] = "copy+readonly-source" if readonly else "copy"
            if self.command_runner is not None:
                details["isolation"] = "sandbox"
            return (self.command_runner or run_command)(
                self._argv(fields), cwd=work, env=self._environment(eval_dir, work, junit),
                timeout_s=limit, stdout_path=out, stderr_path=err, grace_s=self.kill_grace_s,
                readonly_paths=[src] if readonly else (),
            )

        try:
            run = run_once(use_ro)
            if run.readonly_failed and self.readonly_source == "auto":
                # e.g. a filesystem that refuses bind mounts: the command did not run (the wrapper
                # stops before exec), so run it once without the mount; the digest check remains.
                logger.warning("read-only mount of %s failed; evaluating without it", src)
                run = run_once(False)
        except OSError as exc:
            return None, f"test command could not start: {exc}"
        details.update(returncode=run.returncode, timed_out=run.timed_out,
                       command_duration_s=round(run.duration_s, 6),
                       stdout_tail=_tail(out, self.output_tail_chars),
                       stderr_tail=_tail(err, self.output_tail_chars))
        if run.readonly_failed:
            return None, "read-only mount of the preserved workspace failed"
        if run.timed_out:
            return None, f"test command ran past its {limit:g} s limit; process group killed"
        counts: JUnitCounts | None = None
        junit_error: str | None = None
        try:
            counts = parse_junit_file(junit)
        except JUnitParseError as exc:
            junit_error = str(exc)
        if counts is not None:
            details["junit"] = counts.as_dict()
        result = CheckResult(run.returncode, run.duration_s, details["stdout_tail"], details["stderr_tail"],
                             counts, junit_error, self.junit_skipped, work, target)
        return self._apply_rule(result, details)

    def _apply_rule(self, result: CheckResult, details: dict[str, Any]) -> tuple[float | None, str | None]:
        try:
            out = self.rule(result)
        except Unresolved as exc:
            return None, str(exc)
        except Exception as exc:
            details["rule_traceback"] = traceback.format_exc(limit=8)
            return None, f"scoring rule {self.rule_name} crashed: {type(exc).__name__}: {exc}"
        if isinstance(out, tuple):
            out, extra = out
            details.update(dict(extra))
        if out is None:
            return None, f"scoring rule {self.rule_name} returned no score"
        try:
            score = float(out)
        except (TypeError, ValueError):
            return None, f"scoring rule {self.rule_name} returned a non-number {out!r}"
        if not math.isfinite(score):
            return None, f"scoring rule {self.rule_name} returned {score!r}"
        return score, None
