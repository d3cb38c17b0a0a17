"""Request record validation."""

from __future__ import annotations

import numpy as np
import pytest

from gyre.trajectory import Provenance, RequestRecord, Role

from .helpers import rec


def test_defaults_and_conversion():
    r = RequestRecord("e-1", 0, Role.SUBAGENT, [1, 2, 3], [4, 5], [-0.1, -0.2])
    assert r.role == "subagent"
    assert r.input_ids.dtype == np.int32 and r.output_ids.dtype == np.int32
    assert r.output_logprobs.dtype == np.float32
    assert r.input_provenance.dtype == np.int8 and r.input_provenance.tolist() == [Provenance.EXTERNAL] * 3
    assert (r.num_input_tokens, r.num_output_tokens) == (3, 2)
    assert r.output_provenance().tolist() == [0, 0]
    assert RequestRecord("e-1", 1, "evaluator", [1], [2], [-1.0]).output_provenance().tolist() == [2]
    # empty arrays are fine
    e = RequestRecord("e-1", 2, "main", [], [], [])
    assert e.input_ids.shape == (0,) and e.output_ids.dtype == np.int32


def test_no_copy_for_right_dtypes():
    ids = np.arange(5, dtype=np.int32)
    r = RequestRecord("e", 0, "main", ids, ids[:2], np.zeros(2, np.float32))
    assert r.input_ids is ids


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"execution_id": "a/b"}, "execution_id"),
        ({"execution_id": ""}, "execution_id"),
        ({"role": "boss"}, "role"),
        ({"call_index": -1}, "call_index"),
        ({"policy_version": -2}, "policy_version"),
        ({"input_ids": [[1, 2]]}, "1-D"),
        ({"input_ids": [1.5]}, "integers"),
        ({"input_ids": [2**40]}, "outside"),
        ({"output_ids": [-1], "output_logprobs": [-0.1]}, "non-negative"),
        ({"output_logprobs": [-0.1]}, "entries"),
        ({"output_logprobs": [float("nan"), -1.0]}, "finite"),
        ({"output_logprobs": [0.5, -1.0]}, "≤ 0"),
        ({"input_provenance": [0]}, "entries"),
        ({"input_provenance": [0, 3]}, "Provenance"),
        ({"timings": None}, "dicts"),
    ],
)
def test_validation_errors(kwargs, match):
    base = dict(execution_id="e", call_index=0, role="main", input_ids=[1, 2], output_ids=[3, 4],
                output_logprobs=[-0.1, -0.2])
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        RequestRecord(**base)


def test_same_as():
    a = rec(0, [1, 2], [3])
    assert a.same_as(rec(0, [1, 2], [3]))
    assert not a.same_as(rec(0, [1, 2], [4]))
    assert not a.same_as(rec(0, [1, 2], [3], delivered=False))
    assert not a.same_as("x")
