"""Encoding a prompt's text in bounded pieces, with an early stop at a token limit.

A fast (``tokenizers``) tokenizer's working memory for one call is about 150 bytes per character
of its input (the normalised string with its alignments, the pre-tokens, the encoding's tokens and
offsets), and its ids come back as a Python list (~36 bytes per id).  :class:`PieceEncoder` hands
the tokenizer at most a few thousand characters at a time and keeps the ids of each piece in an
``int32`` array, so encoding a text costs that working memory once plus 4 bytes per token; with a
token limit it stops as soon as the tokens so far exceed it (:class:`PromptTooLong`), so a text far
over the context costs memory proportional to the limit, not to the text.

**Exactness.** A text is cut only where the tokenizer's own pre-tokenisation of the whole text
has a boundary that its pre-tokenisation of the two pieces keeps, so every pre-token, and with it
every token, is the same: the ids of the pieces, concatenated, are the ids of the text.  The cuts
are proven for the pipeline of Qwen2/Qwen3 tokenizers (:func:`cuts_exactly` checks a tokenizer
has it; any other tokenizer gets no cuts, one piece per text):

* added tokens are split out of the raw text first (none with ``lstrip``/``rstrip``/
  ``single_word``), then each stretch between them is NFC-normalised, split by the regex
  :data:`QWEN2_SPLIT` (``Isolated``), mapped to byte-level characters and BPE-encoded per
  pre-token;
* a cut between characters ``a = text[p - 1]`` and ``b = text[p]`` is made only when both are
  ASCII, ``a`` is printable and not a space, and ``a`` is a digit, or ``b`` is a digit, or ``a``
  is a letter and ``b`` is not (:data:`_CUT`); and when no added token's text holds ``ab``, so no added token
  spans the cut and both pieces split out the same added tokens.  ASCII characters are their own
  NFC form and compose with nothing across ``p``.  In :data:`QWEN2_SPLIT` a digit is always a
  pre-token of its own (``\\p{N}``; no other alternative takes a digit), and a letter run or a
  contraction ends at the last letter, so the whole text's pre-tokenisation has a boundary at
  ``p``.  The pattern has no look-behind or anchor, so the matches from ``p`` on are those of
  the piece that starts there; its only look-ahead (``\\s+(?!\\S)``) can see ``p`` only from a
  whitespace run that ends at ``p - 1``, which ``a`` rules out, so the matches before ``p`` are
  those of the piece that ends there.

**Pieces.** A piece ends at the last cut within :attr:`PieceEncoder.piece_chars` of its start, or,
where that stretch has none (a run of 100,000 ``[``), at the first cut after it: such a piece is
encoded whole (exact), and with a token limit it is first bounded from below
(:meth:`PieceEncoder.lower_bound`) and refused without encoding when the bound alone is over.
A text with no ASCII cut point (e.g. a long run of CJK letters with no ASCII digit, letter,
space or punctuation) is therefore encoded in one piece, as before.
"""

from __future__ import annotations

import itertools
import json
import re
from fractions import Fraction
from typing import Any, Iterator, Sequence

import numpy as np

from gyre.proxy.errors import ProxyError

__all__ = ["PieceEncoder", "PromptTooLong", "QWEN2_SPLIT", "cuts_exactly"]

#: Qwen2/Qwen3's pre-tokenisation regex (the ``Split`` pre-tokenizer of their ``tokenizer.json``).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

#: Cut points (module docstring): after an ASCII digit before any ASCII character; before an ASCII
#: digit after a printable non-space ASCII character; after an ASCII letter before an ASCII non-letter.
_CUT = re.compile(r"(?<=[0-9])(?=[\x00-\x7f])|(?<=[\x21-\x7e])(?=[0-9])"
                  r"|(?<=[A-Za-z])(?=[\x00-\x40\x5b-\x60\x7b-\x7f])")

#: Characters of one piece (the tokenizer's working memory for it: ~150 bytes per character).
PIECE_CHARS = 2048
#: Characters handed to the tokenizer in one call (several pieces, encoded in parallel).
BATCH_CHARS = 4096
_LOW = (1 << 64) - 1
#: Characters :meth:`PieceEncoder.lower_bound` reads at a time.
_CHUNK = 4096
#: Runs of one byte this long or shorter are left out of the run count (a weaker bound, still one).
_SHORT_RUN = 256


class PromptTooLong(ProxyError):
    """The prompt has more than ``maximum`` tokens: 400 ``prompt is too long`` (at least ``at_least``
    tokens were found before encoding stopped)."""

    def __init__(self, at_least: int, maximum: int) -> None:
        super().__init__(400, f"prompt is too long: at least {at_least} tokens > {maximum} maximum")
        self.at_least = at_least
        self.maximum = maximum


def _backend(tokenizer: Any) -> Any:
    return getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)


def _state(component: Any) -> Any:
    return None if component is None else json.loads(component.__getstate__())


def cuts_exactly(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` (a ``transformers`` fast tokenizer) has the pipeline the cuts are proven
    for (module docstring): NFC or no normaliser, ``Split(QWEN2_SPLIT, Isolated)`` then
    ``ByteLevel`` without its own regex, no added token that strips whitespace or needs a whole
    word, and no truncation or padding."""
    b = _backend(tokenizer)
    if b is None or getattr(b, "truncation", None) or getattr(b, "padding", None):
        return False
    try:
        norm, pre = _state(b.normalizer), _state(b.pre_tokenizer)
    except (AttributeError, TypeError, ValueError):
        return False
    if norm not in (None, {"type": "NFC"}):
        return False
    if not isinstance(pre, dict) or pre.get("type") != "Sequence" or len(pre.get("pretokenizers", [])) != 2:
        return False
    split, byte_level = pre["pretokenizers"]
    if (split.get("type") != "Split" or split.get("pattern") != {"Regex": QWEN2_SPLIT}
            or split.get("behavior") != "Isolated" or split.get("invert")):
        return False
    if byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex") or byte_level.get("add_prefix_space"):
        return False
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return not any(t.lstrip or t.rstrip or t.single_word for t in added.values())


#: A byte-level token text made of ASCII bytes only: GPT-2's mapping has printable bytes stand for
#: themselves and the others for ``chr(256 + k)``, ``k`` counting the non-printable bytes in order
#: (bytes 0-32 are the first 33 of them, 127 the 34th).
_ASCII_TOKEN = re.compile("[\x21-\x7e\u0100-\u0121]+")
_TO_ASCII = {**{0x100 + b: b for b in range(33)}, 0x121: 0x7f}


class PieceEncoder:
    """Encodes texts in pieces (module docstring) with ``tokenizer``'s fast backend.

    Attributes:
        exact_cuts: :func:`cuts_exactly` of the tokenizer (``False``: one piece per text).
        piece_chars, batch_chars: characters of one piece, and of one call to the tokenizer.
        encoded_chars: characters handed to the tokenizer so far (a count of work done).
    """

    def __init__(self, tokenizer: Any, *, piece_chars: int = PIECE_CHARS, batch_chars: int = BATCH_CHARS) -> None:
        self.tokenizer = tokenizer
        self._backend = _backend(tokenizer)
        self._encode_fast = getattr(self._backend, "encode_batch_fast", None) or getattr(
            self._backend, "encode_batch", None)
        self.exact_cuts = cuts_exactly(tokenizer)
        self.piece_chars = max(1, int(piece_chars))
        self.batch_chars = max(1, int(batch_chars))
        self.encoded_chars = 0
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        #: adjacent character pairs inside some added token's text: no cut between them
        self._pairs = frozenset(t.content[i:i + 2] for t in added.values() for i in range(len(t.content) - 1))

    # ------------------------------------------------------------------ pieces
    def _cut_ok(self, text: str, p: int) -> bool:
        return text[p - 1:p + 1] not in self._pairs

    def spans(self, text: str, begin: int = 0, stop: int | None = None) -> Iterator[tuple[int, int]]:
        """``(start, end)`` of each piece of ``text[begin:stop]``, in order, covering it: the pieces
        of that slice, shifted by ``begin``, found without copying it (a cut is decided by the two
        characters around it and ``re``'s search bounds stop every look-around at them)."""
        n = len(text) if stop is None else stop
        if not self.exact_cuts or n - begin <= self.piece_chars:
            if n > begin:
                yield begin, n
            return
        start = begin
        while start < n:
            limit = start + self.piece_chars
            if limit >= n:
                yield start, n
                return
            end, lo, hi = 0, max(start + 1, limit - 64), limit
            while True:  # the last cut in (start, limit]: looked for in [lo, hi] near limit first, then further back
                for m in _CUT.finditer(text, lo, hi + 1):
                    if self._cut_ok(text, m.start()):
                        end = m.start()
                if end or lo == start + 1:
                    break
                lo, hi = max(start + 1, lo - 4 * (hi + 1 - lo)), lo - 1
            if not end:  # none: the first one after limit, or the end of the text
                end = n
                for m in _CUT.finditer(text, limit + 1, n):
                    if self._cut_ok(text, m.start()):
                        end = m.start()
                        break
            yield start, end
            start = end

    # ------------------------------------------------------------------ lower bound
    def _ascii_tokens(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(low mask, high mask, bytes, pure)`` of every token whose text is ASCII: the set of its
        bytes as a 128-bit mask in two ``uint64`` words, and its length; ``pure[c]``: the longest
        such token made of byte ``c`` alone (at least 1).  Built on first use (~1 s for Qwen's
        151,643 tokens, one token text at a time, into arrays of the vocabulary's size, then cut
        to the ASCII ones) and cached on the tokenizer."""
        cached = getattr(self.tokenizer, "_gyre_ascii_tokens", None)
        if cached is not None:
            return cached
        size = self._backend.get_vocab_size(with_added_tokens=False)
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        texts = ((tok.translate(_TO_ASCII).encode("ascii") for i in range(size)
                  if (tok := self._backend.id_to_token(i)) and _ASCII_TOKEN.fullmatch(tok)))
        more = [t.content.encode() for t in added.values() if t.content and t.content.isascii()]
        lo = np.zeros(size + len(more), np.uint64)
        hi = np.zeros(size + len(more), np.uint64)
        lens = np.zeros(size + len(more), np.int64)
        pure = np.ones(128, np.int64)
        k = 0
        for t in itertools.chain(texts, more):
            m = 0
            for c in set(t):
                m |= 1 << c
            lo[k], hi[k], lens[k] = m & _LOW, m >> 64, len(t)
            if len(set(t)) == 1:
                pure[t[0]] = max(int(pure[t[0]]), len(t))
            k += 1
        table = (lo[:k].copy(), hi[:k].copy(), lens[:k].copy(), pure)
        try:
            self.tokenizer._gyre_ascii_tokens = table
        except AttributeError:  # a tokenizer that takes no attributes: built again next time
            pass
        return table

    @staticmethod
    def _scan(text: str, start: int, end: int) -> tuple[np.ndarray, list[tuple[int, int]]] | None:
        """``(count of each byte, (byte, length) of each run of one byte longer than 256)`` of
        ``text[start:end]``, read 4,096 characters at a time (transient memory at most ~12 bytes per
        chunk byte); ``None`` when it is not ASCII."""
        counts = np.zeros(128, np.int64)
        runs: list[tuple[int, int]] = []  # (byte, length) of the runs longer than _SHORT_RUN
        run_byte, run_len = -1, 0  # the run open at the end of the chunks read so far
        for at in range(start, end, _CHUNK):
            chunk = text[at:min(at + _CHUNK, end)]
            if not chunk.isascii():
                return None
            for ch in set(chunk):  # (np.bincount would take 8 bytes a character)
                counts[ord(ch)] += chunk.count(ch)
            b = np.frombuffer(chunk.encode("ascii"), np.uint8)
            edges = np.concatenate(([0], np.flatnonzero(b[1:] != b[:-1]) + 1, [b.size]))
            lengths = np.diff(edges)
            if int(b[0]) == run_byte:
                run_len += int(lengths[0])
            else:
                if run_len > _SHORT_RUN:
                    runs.append((run_byte, run_len))
                run_byte, run_len = int(b[0]), int(lengths[0])
            if lengths.size > 1:
                if run_len > _SHORT_RUN:
                    runs.append((run_byte, run_len))
                big = np.flatnonzero(lengths[1:-1] > _SHORT_RUN) + 1
                runs += [(int(b[edges[j]]), int(lengths[j])) for j in big]
                run_byte, run_len = int(b[edges[-2]]), int(lengths[-1])
        if run_len > _SHORT_RUN:
            runs.append((run_byte, run_len))
        return counts, runs

    @staticmethod
    def _run_bound(runs: list[tuple[int, int]], longest: int, pure: np.ndarray) -> Fraction:
        """Tokens the runs need when no token is longer than ``longest`` bytes (:meth:`lower_bound`'s
        second count)."""
        return sum((Fraction(n - 2 * longest, int(pure[c])) for c, n in runs if n > 2 * longest), Fraction(0))

    def lower_bound(self, text: str, start: int = 0, end: int | None = None) -> int:
        """Fewest tokens ``text[start:end]`` can encode to (0 when it is not ASCII or the tokenizer has
        no cut rule), read 4,096 characters at a time.  A token covers a substring of an ASCII
        text, so it is one of the vocabulary's (or an added) tokens made of the text's bytes only
        (*fitting* tokens); the larger of two counts:

        * with ``M(c)`` the longest fitting token holding byte ``c``: a token ``t`` is
          ``sum(1 / len(t))`` over its bytes, at least ``sum(1 / M(c))``, so the count is at least
          the sum of ``1 / M(c)`` over the text's bytes;
        * with ``L`` the longest fitting token and ``P(c)`` the longest token made of ``c`` alone:
          in a run of ``k > 2 * L`` bytes ``c`` at most ``L - 1`` bytes at either end share a token
          with bytes outside the run, and the others need tokens of ``c`` alone, at least
          ``(k - 2 * L) / P(c)`` of them, which no other run shares (runs of 256 bytes or fewer
          are left out: the bound is then weaker, and still one).
        """
        end = len(text) if end is None else end
        if not self.exact_cuts or start >= end:
            return 0
        scanned = self._scan(text, start, end)
        return 0 if scanned is None else self._bound(*scanned)

    def _bound(self, counts: np.ndarray, runs: list[tuple[int, int]]) -> int:
        """:meth:`lower_bound` of a text from its :meth:`_scan`."""
        present = [int(c) for c in np.nonzero(counts)[0]]
        q = sum(1 << c for c in present)
        lo, hi, lens, pure = self._ascii_tokens()
        ok = ((lo & np.uint64(~q & _LOW)) == 0) & ((hi & np.uint64(~(q >> 64) & _LOW)) == 0)
        lo, hi, lens = lo[ok], hi[ok], lens[ok]
        longest = int(lens.max()) if lens.size else 1
        per_byte = Fraction(0)
        for c in present:
            word, bit = (lo, c) if c < 64 else (hi, c - 64)
            holds = ((word >> np.uint64(bit)) & np.uint64(1)).astype(bool)
            per_byte += Fraction(int(counts[c]), max(1, int(lens[holds].max()) if holds.any() else 1))
        bound = max(per_byte, self._run_bound(runs, longest, pure))
        return -(-bound.numerator // bound.denominator)

    def over_by_bound(self, text: str, budget: int, begin: int = 0, stop: int | None = None) -> int:
        """A lower bound of the tokens of the first piece of ``text[begin:stop]`` that :meth:`encode`
        would bound before encoding (longer than ``2 * piece_chars``) whose bound exceeds
        ``budget``, or 0 when none does; reads the slice in place.  :meth:`encode` of a prompt
        holding this text, with ``max_tokens - fixed <= budget``, raises :class:`PromptTooLong`:
        the bound returned is at most that piece's :meth:`lower_bound`.  A piece's runs are first
        bounded with the longest ASCII token for ``L`` (a weaker count, never above its
        :meth:`lower_bound`, that needs no pass over the vocabulary's table), then by
        :meth:`lower_bound` where that is not enough."""
        stop = len(text) if stop is None else stop
        if not self.exact_cuts or stop - begin <= 2 * self.piece_chars:
            return 0
        for s, e in self.spans(text, begin, stop):
            if e - s <= 2 * self.piece_chars:
                continue
            scanned = self._scan(text, s, e)
            if scanned is None:
                continue
            _, lens, pure = self._ascii_tokens()[1:]
            weak = self._run_bound(scanned[1], int(lens.max()) if lens.size else 1, pure)
            bound = -(-weak.numerator // weak.denominator)
            if bound <= budget:
                bound = self._bound(*scanned)  # the same piece's full bound, from the same scan
            if bound > budget:
                return bound
        return 0

    # ------------------------------------------------------------------ encoding
    def _encode(self, pieces: list[str]) -> list[list[int]]:
        self.encoded_chars += sum(len(p) for p in pieces)
        if self._encode_fast is not None:
            return [e.ids for e in self._encode_fast(pieces, add_special_tokens=False)]
        return [self.tokenizer.encode(p, add_special_tokens=False) for p in pieces]

    def encode(self, texts: Sequence[str], max_tokens: int | None = None, fixed: int = 0) -> list[np.ndarray]:
        """The ids of each text (``int32`` arrays), exactly those of encoding it in one call.

        With ``max_tokens``, raises :class:`PromptTooLong` as soon as ``fixed`` (tokens the prompt
        has besides ``texts``) plus the tokens found so far exceed it: after the piece that crosses
        it, or before encoding a piece longer than ``2 * piece_chars`` whose :meth:`lower_bound`
        alone crosses it.
        """
        parts: list[list[np.ndarray]] = [[] for _ in texts]
        total = int(fixed)
        batch: list[tuple[int, int, int]] = []
        size = 0

        def flush() -> None:
            nonlocal total, size
            if not batch:
                return
            ids = self._encode([texts[i][s:e] for i, s, e in batch])
            for (i, _, _), piece in zip(batch, ids):
                parts[i].append(np.array(piece, np.int32))
                total += len(piece)
            batch.clear()
            size = 0
            if max_tokens is not None and total > max_tokens:
                raise PromptTooLong(total, max_tokens)

        for i, text in enumerate(texts):
            for s, e in self.spans(text):
                if max_tokens is not None and e - s > 2 * self.piece_chars:
                    flush()
                    bound = self.lower_bound(text, s, e)
                    if total + bound > max_tokens:
                        raise PromptTooLong(total + bound, max_tokens)
                batch.append((i, s, e))
                size += e - s
                if size >= self.batch_chars:
                    flush()
        flush()
        return [p[0] if len(p) == 1 else (np.concatenate(p) if p else np.zeros(0, np.int32)) for p in parts]
