"""term-word-frequency: top3.txt lists the three most frequent words, most frequent first."""
import pathlib


def lines():
    return [w.strip().lower() for w in pathlib.Path("top3.txt").read_text().split("\n") if w.strip()]


def test_three_lines():
    assert len(lines()) == 3


def test_first_is_the():
    assert lines()[0] == "the"


def test_second_is_rain():
    assert lines()[1] == "rain"


def test_third_is_on():
    assert lines()[2] == "on"
