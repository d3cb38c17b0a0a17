"""Rank 0's claim of the run directory (:mod:`gyre.runtime.pretrain`): the lock and ``args.json``."""

from __future__ import annotations

import json

import pytest

from gyre.arguments import ArgumentError, parse_args
from gyre.process_guard import RunDirectoryLock
from gyre.runtime.pretrain import _claim_run_dir


def test_args_json_holds_the_flags_but_the_admin_token(tmp_path):
    run = tmp_path / "run"
    args = parse_args(["--run-dir", str(run), "--admin-token", "s3cret", "--steps-per-burst", "3"])
    lock = _claim_run_dir(args)
    try:
        saved = json.loads((run / "args.json").read_text())
        assert (saved["steps_per_burst"], saved["run_dir"], saved["proxy_host"]) == (3, str(run), "127.0.0.1")
        assert "admin_token" not in saved
        assert "s3cret" not in (run / "args.json").read_text()
        assert not RunDirectoryLock(run).is_free()
        with pytest.raises(ArgumentError, match="argument --run-dir: "):
            _claim_run_dir(args)  # a second job on the same directory
    finally:
        lock.release()
    assert RunDirectoryLock(run).is_free()
