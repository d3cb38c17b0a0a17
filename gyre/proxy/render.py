"""Chat-template rendering of *new* messages at message boundaries (the "delta" of a request).

The template is the model's own (``tokenizer.chat_template`` via ``apply_chat_template``, as
SGLang's and vLLM's OpenAI servers do; control tokens inside message text are not escaped).
The renderer never re-renders history: the text contributed by messages ``new`` that follow a
message ``p`` is ``render([p] + new)[len(render([p])):]`` (a window of one message of context),
and the first message of a conversation is rendered with the tools. This is exact for templates
whose rendering of a message depends only on itself and its neighbours (ChatML/Qwen); templates
that depend on the whole history (e.g. Qwen3's dropping ``<think>`` before the last user query)
only matter for *foreign* assistant messages, since the proxy's own outputs are spliced in as
sampled token ids, never rendered.

A boundary between messages ``a`` and ``b`` is *cuttable* when ``render(.. a)`` is a prefix of
``render(.. a, b)`` (not inside a group of consecutive tool results, whose shared block closes
only after the last one). Segments are encoded separately, so a stored token sequence can be
reused at every cuttable boundary.

Cost. A boundary is tested in the window of the group it would close: the message before the
group and the group so far. While a group is at most ``GROUP_WINDOW`` messages long that is the
whole test; in a longer group (hundreds of tool results after one assistant message) each further
boundary is first tested in a sliding window of the ``GROUP_WINDOW`` messages before it, and only a
boundary that is cuttable there is tested again in the group's whole window (the same test as for
a short group), so a group costs a number of template calls linear in its length, each on at most
``GROUP_WINDOW + 1`` messages, plus two renders of the whole group where it ends. For templates
that decide a boundary from its neighbours (as Gyre's and Qwen's decide a tool result's closing
``<|im_end|>`` from the next message's role) this finds the same cuts as testing every boundary in
the whole window. A sliding window the template refuses to render is treated as cuttable, so that
boundary gets the whole-window test.

Memory. A rendering of a window holds every long message in it once more, so at most one is held
at a time: a rendering that a later one is only tested against (the window's base, the group so
far) is kept as its length and digest once it is longer than :data:`KEEP_TEXT_CHARS`, and a
segment's text is cut out of the later rendering that starts with it. A request holding a
200 KB text then peaks at that text, one rendering and the segment's text (the caller may decline
to copy it out: ``encode_span``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from gyre.proxy.messages import ROLE_ASSISTANT, ROLE_USER, Message
from gyre.proxy.parse import THINK_CLOSE, THINK_OPEN
from gyre.proxy.piece_encode import PieceEncoder
from gyre.proxy.prompt_size import probe_kept_parts

__all__ = ["ChatRenderer", "RenderError", "Segment", "DeltaRender"]

_PROBE = "\u2063GYRE_PROBE\u2063"
_PROBE_R = "\u2063GYRE_PROBE_REASONING\u2063"
_EMPTY_THINK = re.escape(THINK_OPEN) + r"\s*" + re.escape(THINK_CLOSE) + r"\s*"
#: Messages of a group tested in the group's whole window; later boundaries of a longer group are
#: tested in a sliding window of this many messages first (see the module docstring).
GROUP_WINDOW = 2
#: A rendering kept for later prefix tests is kept as its text up to this many characters, as its
#: length and digest when longer (:class:`_Kept`).
KEEP_TEXT_CHARS = 1 << 15
_DIGEST_CHUNK = 1 << 14


def _digest(text: str, n: int) -> bytes:
    """BLAKE2b-128 of ``text[:n]`` (UTF-8, lone surrogates passed through), read a chunk at a time."""
    h = hashlib.blake2b(digest_size=16)
    for at in range(0, n, _DIGEST_CHUNK):
        h.update(text[at:min(at + _DIGEST_CHUNK, n)].encode("utf-8", "surrogatepass"))
    return h.digest()


class _Kept:
    """A rendering kept only to test whether a later one starts with it: its length ``n``, and its
    text while it is at most :data:`KEEP_TEXT_CHARS` long, else its digest (a long message is then
    not held once more for each rendering that was made of it; equal digests of unequal texts
    have a probability of about 2**-128)."""

    __slots__ = ("n", "text", "digest")

    def __init__(self, text: str) -> None:
        self.n = len(text)
        long = self.n > KEEP_TEXT_CHARS
        self.text: str | None = None if long else text
        self.digest = _digest(text, self.n) if long else b""

    def prefix_of(self, t: str) -> bool:
        """Whether ``t`` starts with the kept rendering."""
        if self.text is not None:
            return t.startswith(self.text)
        return len(t) >= self.n and _digest(t, self.n) == self.digest


class RenderError(ValueError):
    """The template's rendering is not prefix-stable at the requested boundary."""


@dataclass(slots=True)
class Segment:
    """Tokens of ``new[first:last + 1]`` (``int`` token ids, or the ``encode`` callback's
    placeholder), ending at a cuttable boundary."""

    first: int
    last: int
    ids: Any


@dataclass(slots=True)
class DeltaRender:
    """Result of :meth:`ChatRenderer.render_delta`.

    ``segments`` cover the new messages in order; ``gen_ids`` are the generation prompt's tokens
    (``[]`` when not requested, or when it could not be cut off, in which case they are the tail
    of the last segment and ``gen_in_last`` is true).
    """

    segments: list[Segment]
    gen_ids: list[int]
    gen_in_last: bool = False


class ChatRenderer:
    """Renders and encodes messages with a ``transformers`` tokenizer's chat template.

    Args:
        tokenizer: a ``PreTrainedTokenizerFast`` with ``chat_template`` set.

    Attributes (probed once from the template):
        eos_id: ``tokenizer.eos_token_id`` (``<|im_end|>`` for Qwen).
        stop_ids: token ids that end a generation and are not text (EOS and, if set, the pad
            token, e.g. ``<|endoftext|>``), sorted.
        assistant_open: text the template writes between the generation prompt and the content
            of an assistant turn without reasoning: ``""`` for ChatML, the empty reasoning block
            ``"<think>\\n\\n</think>\\n\\n"`` for Qwen3's own template (which the model samples
            itself when it does not think); any other text is refused.
        assistant_close: text the template writes after an assistant message's content
            (``"<|im_end|>\\n"`` for ChatML).
        after_eos: the part of ``assistant_close`` after the EOS text (``"\\n"``): a template
            token that follows a sampled EOS, never a target.
        kept_parts: the parts of a request the template keeps in every position
            (:func:`gyre.proxy.prompt_size.probe_kept_parts`), which the prompt-size bound counts.
        pieces: the :class:`gyre.proxy.piece_encode.PieceEncoder` of :meth:`encode_prompt`.

    Raises:
        ValueError: the tokenizer has no chat template or no EOS token, or the template does not
            write an assistant turn as the generation prompt followed by what the model samples
            (the message names the text in the way and the fix).
    """

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("tokenizer has no chat_template")
        if tokenizer.eos_token_id is None:
            raise ValueError("tokenizer has no eos token")
        self.tokenizer = tokenizer
        self.eos_id: int = int(tokenizer.eos_token_id)
        self.eos_text: str = tokenizer.eos_token
        pad = getattr(tokenizer, "pad_token_id", None)
        self.stop_ids: list[int] = sorted({self.eos_id} | ({int(pad)} if pad is not None else set()))
        self._fast = getattr(tokenizer, "_tokenizer", None)
        self._fast_batch = getattr(self._fast, "encode_batch_fast", None)
        self.pieces = PieceEncoder(tokenizer)
        user = {"role": ROLE_USER, "content": "u"}
        with_gen = self.render([user], add_generation_prompt=True)
        full = self.render([user, {"role": ROLE_ASSISTANT, "content": _PROBE}])
        if not full.startswith(with_gen) or _PROBE not in full:
            raise ValueError("chat template does not render an assistant turn after its generation prompt")
        self.assistant_open: str = full[len(with_gen): full.index(_PROBE)]
        self.assistant_close: str = full[full.index(_PROBE) + len(_PROBE):]
        if self.assistant_open and self.assistant_open != self._empty_reasoning_block(user, with_gen):
            raise ValueError(
                f"chat template writes {self.assistant_open!r} between the generation prompt and an assistant "
                "message's content, and it is not the turn's (empty) reasoning block, so the proxy would count "
                "template text as sampled; fix: end the template's add_generation_prompt text with it")
        self.kept_parts: frozenset[str] = probe_kept_parts(self.render)
        self.after_eos: str = (
            self.assistant_close[len(self.eos_text):] if self.assistant_close.startswith(self.eos_text) else ""
        )
        self.after_eos_ids: list[int] = self.encode(self.after_eos) if self.after_eos else []
        self.close_ids: list[int] = self.encode(self.assistant_close)

    def _empty_reasoning_block(self, user: dict[str, Any], with_gen: str) -> str | None:
        """The text the template writes before the content of a turn that has reasoning ``r``, with
        ``r`` taken out (``"<think>\\n\\n</think>\\n\\n"`` for Qwen3's own template), when that is
        a think block in the output parser's format holding nothing but ``r`` and whitespace;
        otherwise ``None``."""
        try:
            full = self.render([user, {"role": ROLE_ASSISTANT, "content": _PROBE, "reasoning_content": _PROBE_R}])
        except Exception:
            return None
        if not full.startswith(with_gen) or _PROBE not in full:
            return None
        opening = full[len(with_gen): full.index(_PROBE)]
        before, found, after = opening.partition(_PROBE_R)
        if not found or not re.fullmatch(_EMPTY_THINK, before + after) or not before.startswith(THINK_OPEN):
            return None
        return before + after

    # ------------------------------------------------------------------ primitives
    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The template's text for ``messages`` (template dicts)."""
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added; special tokens in the text are matched)."""
        if not text:
            return []
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, as :meth:`encode` (the fast tokenizer's batch encoder releases the
        GIL; ``encode_batch_fast``, where the tokenizers library has it, skips the character offsets
        Gyre never reads: ~25 % less CPU)."""
        texts = list(texts)
        if not texts:
            return []
        if self._fast_batch is not None:
            return [e.ids for e in self._fast_batch(texts, add_special_tokens=False)]
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(texts, add_special_tokens=False)]
        return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]

    def encode_prompt(self, texts: Sequence[str], max_tokens: int | None = None, fixed: int = 0) -> list[Any]:
        """Token ids of each text as ``int32`` arrays, the same as :meth:`encode_batch`'s, encoded in
        bounded pieces (:class:`gyre.proxy.piece_encode.PieceEncoder`); with ``max_tokens``, raises
        :class:`gyre.proxy.piece_encode.PromptTooLong` (a 400) once ``fixed`` plus the tokens found
        exceed it, without encoding the rest."""
        return self.pieces.encode(texts, max_tokens, fixed)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens kept (``skip_special_tokens=False``)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def generation_prompt(self, template_kwargs: dict[str, Any] | None = None) -> str:
        """Text the template appends for ``add_generation_prompt=True``."""
        user = [{"role": ROLE_USER, "content": "u"}]
        a = self.render(user, template_kwargs=template_kwargs)
        b = self.render(user, add_generation_prompt=True, template_kwargs=template_kwargs)
        if not b.startswith(a):
            raise RenderError("generation prompt is not a suffix of the rendered history")
        return b[len(a):]

    # ------------------------------------------------------------------ outputs
    def assistant_output_text(self, message: Message, template_kwargs: dict[str, Any] | None = None) -> str:
        """What a model in this format samples for ``message``: its rendered content + EOS.

        Used by teacher-forced engines (``tools/replay_trace.py``, tests): the text after the
        generation prompt up to and including the EOS text (``"<|im_end|>"``), without the
        template's ``after_eos`` (``"\\n"``), which the model never samples.
        """
        user = {"role": ROLE_USER, "content": "u"}
        base = self.render([user], add_generation_prompt=True, template_kwargs=template_kwargs)
        full = self.render([user, message.template_dict()], template_kwargs=template_kwargs)
        if not full.startswith(base):
            # e.g. enable_thinking=False: the prompt's empty think block is not part of the turn
            plain = self.render([user], add_generation_prompt=True)
            if not full.startswith(plain):
                raise RenderError("assistant turn does not start with the generation prompt")
            base = plain
        text = full[len(base):]
        if self.after_eos and text.endswith(self.after_eos):
            text = text[: len(text) - len(self.after_eos)]
        return text

    # ------------------------------------------------------------------ deltas
    def render_delta(
        self,
        prev: Message | None,
        new: Sequence[Message],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None = None,
        encode: Callable[[str], Any] | None = None,
        encode_span: Callable[[str, int, int], Any] | None = None,
    ) -> DeltaRender:
        """Encode ``new`` messages following ``prev`` (``None``: start of the conversation).

        ``tools`` are only rendered when ``prev is None`` (they belong to the first block).
        Cost: O(tokens of ``prev`` + ``new``) -- independent of the history before ``prev``.
        ``encode`` replaces :meth:`encode` for each segment's text (a caller that encodes later,
        e.g. off the event loop, passes a function returning a placeholder); ``encode_span``, when
        given, is called as ``encode_span(rendering, start, end)`` instead of
        ``encode(rendering[start:end])`` for each segment's text, so that the caller may read a
        text before copying it out. Memory: one rendering of a window is held at a time (besides
        the texts the callbacks keep); a rendering a later one is tested against is kept as
        :class:`_Kept`.

        Raises:
            RenderError: the boundary after ``prev`` is not cuttable for this continuation (the
                caller backs off to an earlier boundary).
        """
        kw = template_kwargs or {}
        enc = encode or self.encode
        take = encode_span or (lambda text, start, end: enc(text[start:end]))
        segments: list[Segment] = []
        win: list[dict[str, Any]] = [prev.template_dict()] if prev is not None else []
        use_tools = tools if prev is None else None
        base = _Kept(self.render(win, None, template_kwargs=kw) if win else "")
        dicts = [m.template_dict() for m in new]
        n = len(dicts)
        gs = 0  # first message of the open group
        t_prev: _Kept | None = None  # rendering of win + dicts[gs:j]; None while the group is empty
        last: str | None = None  # without a generation prompt: the open group's whole rendering
        stale = False  # t_prev was not rendered for the current j (a long group, see the module docstring)
        j = 0
        while j < n:
            if j - gs > GROUP_WINDOW:
                if not self._cuts_locally(dicts, j, kw):
                    stale = True
                    j += 1
                    continue
                if stale:  # a cut in the sliding window: test it in the group's window
                    t_prev = _Kept(self._render_after(base, win + dicts[gs:j], use_tools, kw))
                    stale = False
            t = self._render_after(base, win + dicts[gs:j + 1], use_tools, kw)
            if t_prev is not None and t_prev.prefix_of(t):
                # the boundary between new[j-1] and new[j] is cuttable: close new[gs..j-1], whose
                # text is t_prev's after base, the same characters in t
                segments.append(Segment(gs, j - 1, take(t, base.n, t_prev.n)))
                del t  # not held while the new window renders (a long message is in both)
                t_prev = None
                win = [dicts[j - 1]]
                use_tools = None
                base = _Kept(self.render(win, None, template_kwargs=kw))
                gs = j
                continue  # re-render new[j] in the new window
            if add_generation_prompt or j + 1 < n:
                t_prev = _Kept(t)
            else:
                last = t
            del t
            j += 1
        if stale:  # the open long group's rendering
            t = self._render_after(base, win + dicts[gs:], use_tools, kw)
            t_prev, last = (_Kept(t), None) if add_generation_prompt else (None, t)
            del t
        if not add_generation_prompt:
            if gs < n:
                assert last is not None
                segments.append(Segment(gs, n - 1, take(last, base.n, len(last))))
            return DeltaRender(segments, [], False)
        gen_ids, gen_in_last = self._close_with_generation_prompt(segments, win, dicts, gs, base, t_prev, use_tools,
                                                                  kw, enc, take)
        return DeltaRender(segments, gen_ids, gen_in_last)

    def _render_after(self, base: _Kept, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      kw: dict[str, Any]) -> str:
        """The rendering of ``messages``; ``RenderError`` unless it starts with ``base``."""
        t = self.render(messages, tools, template_kwargs=kw)
        if not base.prefix_of(t):
            raise RenderError("rendering is not prefix-stable after the previous message")
        return t

    def _cuts_locally(self, dicts: list[dict[str, Any]], j: int, kw: dict[str, Any]) -> bool:
        """Whether the boundary before ``dicts[j]`` is cuttable in the sliding window of the
        ``GROUP_WINDOW`` messages before it (True when the template refuses that window: the
        group's window decides)."""
        ctx = dicts[j - GROUP_WINDOW:j]
        try:
            before = _Kept(self.render(ctx, None, template_kwargs=kw))
            return before.prefix_of(self.render(ctx + [dicts[j]], None, template_kwargs=kw))
        except Exception:  # the template refuses the sliding window: test in the group's window
            return True

    def _close_with_generation_prompt(self, segments: list[Segment], win: list[dict[str, Any]],
                                      dicts: list[dict[str, Any]], gs: int, base: _Kept, t_prev: _Kept | None,
                                      use_tools: list[dict[str, Any]] | None, kw: dict[str, Any],
                                      enc: Callable[[str], Any], take: Callable[[str, int, int], Any]
                                      ) -> tuple[Any, bool]:
        """Close the open group ``dicts[gs:]`` (rendered ``t_prev`` after ``base``) and add the
        generation prompt: ``(generation prompt ids, whether they are inside the last segment)``.
        The prompt is in the last segment when it is not a cuttable continuation of the group.
        Every text is cut out of the rendering with the prompt (the one rendering held)."""
        n = len(dicts)
        cur = t_prev if t_prev is not None else (base if win else _Kept(self.render([], use_tools, template_kwargs=kw)))
        tg = self.render(win + dicts[gs:], use_tools, add_generation_prompt=True, template_kwargs=kw)
        if cur.prefix_of(tg):
            if gs < n:
                segments.append(Segment(gs, n - 1, take(tg, base.n, cur.n)))
            elif not win and cur.n:  # no messages at all: the tools-only block
                segments.append(Segment(0, -1, take(tg, 0, cur.n)))
            return enc(tg[cur.n:]), False
        if gs < n and base.prefix_of(tg):
            segments.append(Segment(gs, n - 1, take(tg, base.n, len(tg))))
            return [], True
        raise RenderError("generation prompt is not prefix-stable after the previous message")
