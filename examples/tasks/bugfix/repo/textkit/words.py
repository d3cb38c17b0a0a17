"""Word helpers."""

import re


def count_words(text):
    """Number of whitespace-separated words."""
    return len(text.split())


def slugify(text):
    """Lower-case ASCII slug: runs of characters other than a-z and 0-9 become one '-',
    with no leading or trailing '-'."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower())
    return slug.strip("-")


def title_case(text):
    """Capitalise the first letter of every word and lower-case the rest; small words
    (a, an, and, of, the) stay lower-case unless they are the first word."""
    small = {"a", "an", "and", "of", "the"}
    words = text.split()
    out = []
    for i, w in enumerate(words):
        lw = w.lower()
        out.append(lw if i > 0 and lw in small else lw[:1].upper() + lw[1:])
    return " ".join(out)
