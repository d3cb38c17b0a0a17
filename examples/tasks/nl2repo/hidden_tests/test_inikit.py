"""Hidden tests of the nl2repo-inikit task (run by the evaluator from this directory; the
harness never sees them). Each requirement of SPEC.md is one test: reward = fraction passed."""
import json
import subprocess
import sys

import pytest


def inikit():
    import inikit as mod  # the workspace copy is the evaluator's working directory

    return mod


def test_basic_sections():
    assert inikit().loads("[a]\nx = 1\n[b]\ny=2\n") == {"a": {"x": "1"}, "b": {"y": "2"}}


def test_colon_and_first_separator():
    assert inikit().loads("[s]\nurl: http://h:80/?a=b\nk = v=w\n") == {"s": {"url": "http://h:80/?a=b", "k": "v=w"}}


def test_keys_lowercased_values_stripped():
    assert inikit().loads("[S]\n  MixedKey   =   some value  \n") == {"S": {"mixedkey": "some value"}}


def test_default_section():
    assert inikit().loads("top = 1\n[s]\n") == {"DEFAULT": {"top": "1"}, "s": {}}


def test_default_absent_when_empty():
    assert "DEFAULT" not in inikit().loads("[s]\nk=v\n")


def test_comments_and_blank_lines():
    assert inikit().loads("# c\n\n; c2\n[s]\n   # indented comment\nk=v\n") == {"s": {"k": "v"}}


def test_merge_and_last_value_wins():
    assert inikit().loads("[s]\nk=1\n[t]\n[s]\nk=2\nj=3\n") == {"s": {"k": "2", "j": "3"}, "t": {}}


def test_parse_error_lineno():
    mod = inikit()
    with pytest.raises(mod.ParseError) as info:
        mod.loads("[s]\nk=v\nthis line is bad\n")
    assert info.value.lineno == 3
    assert isinstance(info.value, ValueError)


def test_dumps_format():
    assert inikit().dumps({"a": {"x": 1}, "b": {}}) == "[a]\nx = 1\n\n[b]\n\n"


def test_roundtrip():
    mod = inikit()
    d = {"server": {"host": "example.org", "port": "8080"}, "empty": {}, "paths": {"root": "/srv/data"}}
    assert mod.loads(mod.dumps(d)) == d


def test_get():
    mod = inikit()
    data = {"s": {"port": "80", "name": "x"}, "a.b": {}}
    assert mod.get(data, "s.port", type=int) == 80
    assert mod.get(data, "s.missing", default="d") == "d"
    assert mod.get(data, "nosuch.key") is None
    with pytest.raises(ValueError):
        mod.get(data, "s.name", type=int)


def test_cli(tmp_path):
    good = tmp_path / "good.ini"
    good.write_text("[b]\nk=v\n[a]\n")
    res = subprocess.run([sys.executable, "-m", "inikit", str(good)], capture_output=True, text=True)
    assert res.returncode == 0
    assert json.loads(res.stdout) == {"a": {}, "b": {"k": "v"}}
    bad = tmp_path / "bad.ini"
    bad.write_text("[s]\n???\n")
    res = subprocess.run([sys.executable, "-m", "inikit", str(bad)], capture_output=True, text=True)
    assert res.returncode == 1
    assert res.stderr.startswith("error: line 2:")
