import pytest

from textkit.kv import format_kv, parse_kv


def test_parse_kv_strips_whitespace():
    assert parse_kv(" a = 1 ;b=two ") == {"a": "1", "b": "two"}


def test_parse_kv_empty_items_and_override():
    assert parse_kv("a=1;; a=3;") == {"a": "3"}


def test_parse_kv_value_may_contain_equals():
    assert parse_kv("url=http://x/?q=1") == {"url": "http://x/?q=1"}


def test_parse_kv_error():
    with pytest.raises(ValueError):
        parse_kv("a=1; broken")


def test_format_kv_roundtrip():
    assert format_kv(parse_kv("b=2; a=1")) == "a=1; b=2"
