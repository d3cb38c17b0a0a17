"""Length of the longest common prefix of two token sequences.

One function, :func:`common_prefix_len`, serves the trajectory tree and store (matching a
new request against recorded calls), the packing trie (sharing prefixes between rows) and
the rollout prefix cache (walking radix-tree edges).  Two NumPy arrays are compared in one
vectorised pass; any other pair of sequences (tuples, lists of Python ints) element by
element, which is faster for the short edges of the prefix cache.  It sits at the package
top level and imports only NumPy, so every subpackage can use it without import cycles.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["common_prefix_len"]


def common_prefix_len(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray, start: int = 0) -> int:
    """Number of leading positions where ``a`` and ``b[start:]`` hold equal values.

    Args:
        a, b: 1-D sequences (NumPy arrays, tuples or lists) of comparable values.
        start: offset into ``b`` (saves slicing a list); ``0 <= start <= len(b)``.
    Returns:
        The largest ``k <= min(len(a), len(b) - start)`` with ``a[:k] == b[start:start + k]``.
    """
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if start:
            b = b[start:]
        n = min(a.shape[0], b.shape[0])
        if n == 0 or a[0] != b[0]:
            return 0
        eq = a[:n] == b[:n]
        return n if eq.all() else int(eq.argmin())
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i
