"""The stand-in SGLang engine (:mod:`gyre.testing.stand_in_engine`) counts a ``/generate`` prompt's
ids without parsing them: the count and the other fields must be what a JSON parser reads, for every
way Gyre writes a body."""

import numpy as np
import orjson
import pytest

from gyre.rollout.client.token_json import MIN_IDS, dumps_with_ids
from gyre.testing.stand_in_engine import count_input_ids


@pytest.mark.parametrize("n", [0, 1, 7, MIN_IDS - 1, MIN_IDS, 70_000])
def test_the_count_and_the_other_fields_are_what_a_parser_reads(n):
    ids = np.random.default_rng(n).integers(0, 151_000, n)
    body = {"input_ids": ids, "rid": "r-1", "stream": True, "sampling_params": {"max_new_tokens": 3, "stop": ["]"]}}
    raw = bytes(dumps_with_ids(body, orjson.OPT_SERIALIZE_NUMPY))
    parsed = orjson.loads(raw)
    count, rest = count_input_ids(raw)
    assert count == len(parsed["input_ids"]) == n
    assert rest == {k: v for k, v in parsed.items() if k != "input_ids"}


def test_a_body_with_only_ids_or_its_ids_elsewhere_is_read_too():
    assert count_input_ids(orjson.dumps({"input_ids": [5, 6, 7]})) == (3, {})
    assert count_input_ids(orjson.dumps({"rid": "x", "input_ids": [5, 6]})) == (2, {"rid": "x", "input_ids": [5, 6]})
