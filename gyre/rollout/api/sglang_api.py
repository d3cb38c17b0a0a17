"""SGLang's native API as the embedded engine serves it: parsing, validation, building (no I/O).

Sampling parameters, request bodies and their checks, finish reasons, ``meta_info`` and
log-prob triples, stop-string trimming and incremental detokenisation: the server
(``gyre/rollout/embedded/routes/``) and the engine core use these, and the clients send
:class:`SamplingParams`.  Names, defaults and shapes follow sgl-project/sglang:
``managers/io_struct.py`` (``GenerateReqInput`` and the control bodies),
``sampling/sampling_params.py`` (``max_new_tokens`` 128, ``temperature`` 1.0, ``top_p`` 1.0,
``top_k`` -1, ``min_p`` 0.0; ``temperature == 0`` is greedy), ``managers/schedule_batch.py``
(finish reasons ``stop`` with ``matched``, ``length`` with ``length``, ``abort`` with
``message``; the length check runs first) and ``managers/tokenizer_manager.py`` (``meta_info``
keys, ``output_token_logprobs`` as ``[logprob, token_id, text_or_null]``).

Bad input raises :class:`ProtocolError`, which the server answers with HTTP 400
``{"error": {"message": ..., "code": 400}}``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Sequence

#: Finish-reason ``type`` values (SGLang's ``FINISH_MATCHED_*``, ``FINISH_LENGTH``, ``FINISH_ABORT``).
FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = "stop", "length", "abort"
#: ``/pause_generation`` modes (SGLang ``PauseGenerationReqInput.mode``).
PAUSE_MODES = ("abort", "in_place", "retract")
#: ``/release_memory_occupation`` tags (SGLang ``GPU_MEMORY_TYPE_WEIGHTS`` / ``_KV_CACHE`` /
#: ``_CUDA_GRAPH``; the embedded engine has no CUDA graphs: that tag only gates generation).
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
#: Upper bound on ``n`` per request (parallel samples of one prompt).
MAX_N = 256


from gyre.rollout.api.request_validators import (  # noqa: E402
    ProtocolError,
    check_keys as _check_keys,
    is_int as _is_int,
    is_number as _is_number,
    opt_bool as _opt_bool,
    want_bool as _want_bool,
    want_float as _want_float,
    want_int as _want_int,
    want_object as _want_object,
)


# --------------------------------------------------------------------------- sampling params


@dataclass(slots=True)
class SamplingParams:
    """Sampling parameters of one request (SGLang ``sampling_params.py`` names and defaults).

    ``temperature == 0`` means greedy (argmax; the returned log-prob is then
    ``log_softmax(logits)`` at temperature 1, as SGLang does).  ``top_k == -1`` disables top-k;
    ``top_p == 1`` and ``min_p == 0`` disable nucleus and min-p truncation.  ``stop`` strings are
    matched on the decoded output; ``stop_token_ids`` and the model's EOS ids stop on the sampled
    token unless ``ignore_eos`` (which, as in SGLang, ignores both).  ``min_new_tokens`` masks the
    stop ids until that many tokens were produced.  ``sampling_seed`` seeds the request's own
    ``torch.Generator`` (sample ``j`` of ``n`` uses ``sampling_seed + j``).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    n: int = 1
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        """Whether top-k, top-p or min-p removes any probability mass."""
        return self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0

    def to_json(self) -> dict[str, Any]:
        """The SGLang ``sampling_params`` dict (only fields that differ from the defaults)."""
        out: dict[str, Any] = {}
        default = SamplingParams()
        for f in fields(self):
            v = getattr(self, f.name)
            if v != getattr(default, f.name):
                out[f.name] = list(v) if isinstance(v, list) else v
        return out

    @classmethod
    def from_json(cls, body: Any, vocab_size: int | None = None) -> "SamplingParams":
        """Parse and check a ``sampling_params`` object.

        Args:
            body: the JSON value (``None`` = all defaults).
            vocab_size: model vocabulary (rows of the embedding); bounds ``stop_token_ids``.
        Raises:
            ProtocolError: unknown or unsupported keys, wrong types, out-of-range values.
        """
        if body is None:
            return cls()
        body = _want_object("sampling_params", body)
        known = {f.name for f in fields(cls)}
        neutral = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
        unsupported_if_set = {"json_schema", "regex", "ebnf", "structural_tag", "logit_bias",
                              "custom_params", "stream_interval"}
        p = cls()
        for key, value in body.items():
            if key in neutral:
                if value is not None and (not _is_number(value) or float(value) != neutral[key]):
                    raise ProtocolError(f"sampling_params.{key}={value!r} is not supported by the "
                                        f"embedded engine (only {neutral[key]})")
                continue
            if key in unsupported_if_set:
                if value is not None:
                    raise ProtocolError(f"sampling_params.{key} is not supported by the embedded engine")
                continue
            if key not in known:
                raise ProtocolError(f"sampling_params: unknown field {str(key)[:100]!r}")
            if value is None:
                continue  # SGLang treats null as "use the default"
            if key == "max_new_tokens":
                p.max_new_tokens = _want_int(key, value, lo=0)
            elif key == "temperature":
                p.temperature = _want_float(key, value, lo=0.0)
            elif key == "top_p":
                p.top_p = _want_float(key, value, lo=0.0, hi=1.0, lo_open=True)
            elif key == "top_k":
                k = _want_int(key, value)
                if k != -1 and k < 1:
                    raise ProtocolError(f"top_k must be -1 (disabled) or >= 1, got {k}")
                p.top_k = k if (vocab_size is None or k < vocab_size) else -1
            elif key == "min_p":
                p.min_p = _want_float(key, value, lo=0.0, hi=1.0)
            elif key == "stop":
                stops = [value] if isinstance(value, str) else value
                if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                    raise ProtocolError("stop must be a non-empty string or a list of non-empty strings")
                p.stop = list(stops)
            elif key == "stop_token_ids":
                if not isinstance(value, list):
                    raise ProtocolError("stop_token_ids must be a list of token ids")
                p.stop_token_ids = [
                    _want_int("stop_token_ids[]", t, lo=0, hi=None if vocab_size is None else vocab_size - 1)
                    for t in value
                ]
            elif key in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
                setattr(p, key, _want_bool(key, value))
            elif key == "min_new_tokens":
                p.min_new_tokens = _want_int(key, value, lo=0)
            elif key == "n":
                p.n = _want_int(key, value, lo=1, hi=MAX_N)
            elif key == "sampling_seed":
                p.sampling_seed = _want_int(key, value)
        if p.min_new_tokens > p.max_new_tokens:
            raise ProtocolError(f"min_new_tokens ({p.min_new_tokens}) > max_new_tokens ({p.max_new_tokens})")
        return p


# --------------------------------------------------------------------------- /generate


#: Top-level ``GenerateReqInput`` keys accepted and ignored (they do not change the output).
IGNORED_GENERATE_KEYS = frozenset({"log_metrics", "priority", "data_parallel_rank", "extra_key",
                                   "bootstrap_host", "bootstrap_port", "bootstrap_room",
                                   "return_routed_experts", "no_logs"})
#: Top-level keys the embedded engine cannot honour; non-null values are rejected.
UNSUPPORTED_GENERATE_KEYS = frozenset({"input_embeds", "image_data", "audio_data", "video_data",
                                       "lora_path", "lora_id", "custom_logit_processor",
                                       "token_ids_logprob", "session_params"})
GENERATE_KEYS = frozenset({"text", "input_ids", "sampling_params", "rid", "return_logprob",
                           "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
                           "stream", "return_hidden_states"}) | IGNORED_GENERATE_KEYS | UNSUPPORTED_GENERATE_KEYS


@dataclass(slots=True)
class SeqSpec:
    """One sequence to generate: input ``i`` of a request, parallel sample ``j`` of ``n``.

    ``rid`` is unique on the engine (``meta_info.id``); ``group_rid`` is the request's ``rid``
    (``/abort_request`` with it aborts every sample).  ``input_ids`` are token ids
    ``0 <= id < vocab_size``.  ``seed`` is ``None`` (engine-chosen) or the generator seed.
    """

    rid: str
    group_rid: str
    index: int
    input_ids: list[int]
    params: SamplingParams
    seed: int | None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False


@dataclass(slots=True)
class GenerateRequest:
    """A parsed ``/generate`` body.  ``single`` selects the response shape (object vs list)."""

    input_ids: list[list[int]]
    params: list[SamplingParams]
    rids: list[str]
    return_logprob: bool
    top_logprobs_num: int
    return_text_in_logprobs: bool
    stream: bool
    single: bool

    def expand(self) -> list[SeqSpec]:
        """Flatten to sequences in SGLang's order: input-major, then sample ``j`` of ``n``."""
        out: list[SeqSpec] = []
        k = 0
        for i, (ids, p, rid) in enumerate(zip(self.input_ids, self.params, self.rids)):
            for j in range(p.n):
                out.append(SeqSpec(
                    rid=rid if p.n == 1 else f"{rid}_{j}", group_rid=rid, index=k, input_ids=ids,
                    params=p, seed=None if p.sampling_seed is None else p.sampling_seed + j,
                    return_logprob=self.return_logprob, top_logprobs_num=self.top_logprobs_num,
                    return_text_in_logprobs=self.return_text_in_logprobs, stream=self.stream))
                k += 1
        return out


def _parse_ids(name: str, ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise ProtocolError(f"{name} must be a non-empty list of token ids")
    for t in ids:
        if not _is_int(t):
            raise ProtocolError(f"{name} must contain integers, got {type(t).__name__} {t!r}"[:300])
        if not 0 <= t < vocab_size:
            raise ProtocolError(f"{name} has token id {t} outside the vocabulary [0, {vocab_size})")
    return list(ids)


def parse_generate(
    body: Any,
    *,
    vocab_size: int,
    context_len: int,
    tokenize: Callable[[str], list[int]] | None = None,
    new_rid: Callable[[], str] = lambda: uuid.uuid4().hex,
) -> GenerateRequest:
    """Parse and check a ``/generate`` body (SGLang ``GenerateReqInput``).

    Args:
        body: the decoded JSON body.
        vocab_size: model vocabulary rows; every id must be in ``[0, vocab_size)``.
        context_len: longest sequence the engine serves (tokens); a prompt must be shorter.
        tokenize: text -> ids for ``text`` inputs (``None``: ``text`` is rejected).
        new_rid: id factory for requests without ``rid``.
    Returns:
        The request; ``single`` is true when ``text``/``input_ids`` was one prompt.
    Raises:
        ProtocolError: unknown or unsupported fields, wrong types, ids outside the vocabulary,
            a prompt as long as the context, bad or duplicate rids.
    """
    body = _want_object("body", body)
    _check_keys("generate", body, set(GENERATE_KEYS))
    for key in UNSUPPORTED_GENERATE_KEYS:
        if body.get(key) not in (None, False, [], {}):
            raise ProtocolError(f"{key} is not supported by the embedded engine")
    if body.get("return_hidden_states"):
        raise ProtocolError("return_hidden_states is not supported by the embedded engine")
    inputs, single = _generate_inputs(body, vocab_size, context_len, tokenize)
    params = _generate_params(body.get("sampling_params"), len(inputs), vocab_size)
    rids = _generate_rids(body.get("rid"), single, len(inputs), new_rid)

    rl = body.get("return_logprob")
    return_logprob = False if rl is None else (
        _uniform_bool(rl) if isinstance(rl, list) else _want_bool("return_logprob", rl))
    lsl = body.get("logprob_start_len")
    if lsl is not None and (not _is_int(lsl) or lsl != -1):
        raise ProtocolError("logprob_start_len: only -1 (output tokens only) is supported by the embedded engine")
    top_n = body.get("top_logprobs_num")
    top_n = 0 if top_n is None else _want_int("top_logprobs_num", top_n, lo=0, hi=vocab_size)
    return GenerateRequest(
        input_ids=inputs, params=params, rids=rids, return_logprob=return_logprob,
        top_logprobs_num=top_n,
        return_text_in_logprobs=_opt_bool(body, "return_text_in_logprobs"),
        stream=_opt_bool(body, "stream"),
        single=single and params[0].n == 1)


def _generate_inputs(body: dict, vocab_size: int, context_len: int,
                     tokenize: Callable[[str], list[int]] | None) -> tuple[list[list[int]], bool]:
    """The prompts of a ``/generate`` body as id lists, and whether the body held one prompt."""
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise ProtocolError("exactly one of input_ids or text is required")
    if has_ids:
        raw = body["input_ids"]
        if not isinstance(raw, list) or not raw:
            raise ProtocolError("input_ids must be a non-empty list of token ids or a list of such lists")
        single = not isinstance(raw[0], list)
        batch = [raw] if single else raw
        inputs = [_parse_ids("input_ids" if single else f"input_ids[{i}]", ids, vocab_size)
                  for i, ids in enumerate(batch)]
    else:
        if tokenize is None:
            raise ProtocolError("text input needs a tokenizer; this engine has none (send input_ids)")
        raw = body["text"]
        single = isinstance(raw, str)
        texts = [raw] if single else raw
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ProtocolError("text must be a string or a non-empty list of strings")
        inputs = []
        for i, t in enumerate(texts):
            ids = tokenize(t)
            if not ids:
                raise ProtocolError(f"text[{i}] is empty after tokenization")
            inputs.append(_parse_ids(f"text[{i}] tokens", ids, vocab_size))
    for i, ids in enumerate(inputs):
        if len(ids) >= context_len:
            raise ProtocolError(f"input {i} has {len(ids)} tokens; the context length is {context_len}")
    return inputs, single


def _generate_params(sp: Any, n_inputs: int, vocab_size: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per input: a list gives one each, one object is shared by all."""
    if isinstance(sp, list):
        if len(sp) != n_inputs:
            raise ProtocolError(f"sampling_params has {len(sp)} entries for {n_inputs} inputs")
        return [SamplingParams.from_json(s, vocab_size) for s in sp]
    return [SamplingParams.from_json(sp, vocab_size)] * n_inputs


def _generate_rids(rid: Any, single: bool, n_inputs: int, new_rid: Callable[[], str]) -> list[str]:
    """The request ids: given (a string for one prompt, a list for a batch) or drawn from ``new_rid``."""
    if rid is None:
        rids = [new_rid() for _ in range(n_inputs)]
    elif isinstance(rid, str) and single:
        rids = [rid]
    elif isinstance(rid, list) and not single:
        if len(rid) != n_inputs or not all(isinstance(r, str) for r in rid):
            raise ProtocolError("rid must be a list of strings, one per input")
        rids = list(rid)
    else:
        raise ProtocolError("rid must be a string (one input) or a list of strings (batch)")
    if any(not r for r in rids) or len(set(rids)) != len(rids):
        raise ProtocolError("rid values must be non-empty and distinct")
    return rids


def _uniform_bool(values: list) -> bool:
    if not values or not all(isinstance(v, bool) for v in values) or len(set(values)) != 1:
        raise ProtocolError("return_logprob as a list must hold one repeated boolean")
    return values[0]


# --------------------------------------------------------------------------- finish reasons and outputs


def finish_stop(matched: int | str) -> dict[str, Any]:
    """``{"type": "stop", "matched": token_id_or_string}``."""
    return {"type": FINISH_STOP, "matched": matched}


def finish_length(length: int) -> dict[str, Any]:
    """``{"type": "length", "length": n}`` (``n`` = output tokens when the cap was hit)."""
    return {"type": FINISH_LENGTH, "length": length}


def finish_abort(message: str) -> dict[str, Any]:
    """``{"type": "abort", "message": ...}``."""
    return {"type": FINISH_ABORT, "message": message}


@dataclass(slots=True)
class SeqOutput:
    """What the engine core emits for one sequence: new tokens since the last emission.

    ``new_logprobs`` are floats (natural log), one per ``new_token_ids`` entry;
    ``new_top_logprobs`` one list of ``(logprob, token_id)`` per token when requested.
    ``finish_reason`` is set on the final emission only.  Times are seconds.
    """

    rid: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[float]
    new_top_logprobs: list[list[tuple[float, int]]] | None
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    e2e_latency: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def final_text(output_ids: Sequence[int], finish_reason: Mapping[str, Any] | None,
               params: SamplingParams, decode: Callable[[list[int], bool], str] | None,
               eos_token_ids: frozenset[int] = frozenset()) -> str:
    """Decoded output text with SGLang's stop trimming.

    A matched stop token is dropped before decoding, and the text is cut at a matched stop
    string, unless ``no_stop_trim``.  ``decode(ids, skip_special_tokens)``; ``None`` -> ``""``.
    """
    if decode is None:
        return ""
    ids = list(output_ids)
    matched = finish_reason.get("matched") if finish_reason else None
    if not params.no_stop_trim and _is_int(matched) and ids and ids[-1] == matched:
        ids = ids[:-1]
    text = decode(ids, params.skip_special_tokens)
    if not params.no_stop_trim and isinstance(matched, str):
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    return text


class IncrementalDetokenizer:
    """Text of a growing id list in O(new tokens) per update (for streaming).

    Keeps ``decode(ids[:anchor])`` and decodes only ``ids[anchor:]``; the anchor moves to the end
    whenever that tail does not end in an incomplete UTF-8 sequence (``"\ufffd"``), where
    byte-level BPE decoding splits exactly.  :meth:`text` holds back a trailing ``"\ufffd"``.

    Args:
        decode: ``decode(ids, skip_special_tokens) -> str``.
        skip_special_tokens: passed to ``decode``.
    """

    __slots__ = ("decode", "skip", "anchor", "prefix")

    def __init__(self, decode: Callable[[list[int], bool], str], skip_special_tokens: bool = True):
        self.decode = decode
        self.skip = skip_special_tokens
        self.anchor = 0
        self.prefix = ""

    def text(self, ids: Sequence[int]) -> str:
        """Stable text of ``ids`` (``ids`` only ever grows between calls)."""
        tail = self.decode(list(ids[self.anchor:]), self.skip)
        if not tail.endswith("\ufffd"):
            self.prefix += tail
            self.anchor = len(ids)
            return self.prefix
        return self.prefix + tail.rstrip("\ufffd")


def logprob_triples(logprobs: Sequence[float], token_ids: Sequence[int],
                    token_text: Callable[[int], str] | None = None) -> list[list[Any]]:
    """SGLang ``output_token_logprobs``: ``[[logprob, token_id, text_or_null], ...]``."""
    if token_text is None:
        return [[float(lp), int(t), None] for lp, t in zip(logprobs, token_ids)]
    return [[float(lp), int(t), token_text(int(t))] for lp, t in zip(logprobs, token_ids)]


def top_logprob_triples(tops: Sequence[Sequence[tuple[float, int]]],
                        token_text: Callable[[int], str] | None = None) -> list[list[list[Any]]]:
    """SGLang ``output_top_logprobs``: per position a list of ``[logprob, token_id, text_or_null]``."""
    return [logprob_triples([lp for lp, _ in row], [t for _, t in row], token_text) for row in tops]


def build_meta_info(*, rid: str, finish_reason: Mapping[str, Any] | None, prompt_tokens: int,
                    completion_tokens: int, cached_tokens: int, weight_version: str,
                    output_token_logprobs: list | None = None, output_top_logprobs: list | None = None,
                    e2e_latency: float | None = None) -> dict[str, Any]:
    """``meta_info`` of a ``/generate`` response or stream chunk (SGLang key names)."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": dict(finish_reason) if finish_reason is not None else None,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens,
        "weight_version": weight_version,
    }
    if output_token_logprobs is not None:
        meta["output_token_logprobs"] = output_token_logprobs
    if output_top_logprobs is not None:
        meta["output_top_logprobs"] = output_top_logprobs
    if e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
    return meta


def error_body(message: str, code: int = 400) -> dict[str, Any]:
    """The error body of every 4xx answer: ``{"error": {"message": ..., "code": ...}}``."""
    return {"error": {"message": message, "code": code}}
