from textkit.words import count_words, slugify, title_case


def test_count_words():
    assert count_words("  the quick\tbrown\nfox ") == 4


def test_slugify_basic():
    assert slugify("Hello World") == "hello-world"


def test_slugify_collapses_and_strips():
    assert slugify("  --Gyre: RL,  for agents!-- ") == "gyre-rl-for-agents"


def test_title_case_small_words():
    assert title_case("the lord OF the rings") == "The Lord of the Rings"
