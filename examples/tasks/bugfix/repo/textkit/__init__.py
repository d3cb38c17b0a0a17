"""textkit: small text and number helpers."""

from textkit.kv import format_kv, parse_kv
from textkit.stats import mean, median, mode
from textkit.words import count_words, slugify, title_case

__all__ = ["count_words", "format_kv", "mean", "median", "mode", "parse_kv", "slugify", "title_case"]
