"""Descriptive statistics of a list of numbers."""

from collections import Counter


def mean(values):
    """Arithmetic mean. Raises ValueError on an empty list."""
    values = list(values)
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


def median(values):
    """Middle value; the mean of the two middle values for an even count.
    Raises ValueError on an empty list."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median of an empty list")
    mid = n // 2
    if n % 2 == 1:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2


def mode(values):
    """Most common value; the smallest one on a tie. Raises ValueError on an empty list."""
    counts = Counter(values)
    if not counts:
        raise ValueError("mode of an empty list")
    best = max(counts.values())
    return min(v for v, c in counts.items() if c == best)
