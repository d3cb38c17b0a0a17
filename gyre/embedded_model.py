"""The embedded CPU default: an offline Qwen tokenizer and a tiny Qwen3 model.

Nothing here touches a hub.  Two tokenizers are built from the real Qwen byte-level BPE
ranks that ship inside PyPI ``dashscope==2.0.2`` (``dashscope/resources/qwen.tiktoken``,
sha256-checked):

* ``qwen``: the full 151,643-rank vocabulary plus Qwen2/Qwen3's 26 added tokens at their
  usual ids (``<|endoftext|>`` = 151643, ``<|im_start|>`` = 151644, ``<|im_end|>`` = 151645,
  ``<think>`` = 151667, ...); token ids equal Qwen3's.
* ``local``: the same BPE truncated to its first :data:`LOCAL_BPE_RANKS` ranks (a prefix of a
  rank-ordered BPE is itself a valid BPE), with the same added tokens renumbered after it;
  the smaller vocabulary keeps tests and CPU demos light.

Both get Gyre's ``tokenizer_config.json`` (eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos)
and Qwen-format chat template (``gyre/chat_template.jinja``).  The model is a
``Qwen3ForCausalLM`` from :func:`tiny_qwen3_config` with a fixed seed, saved as safetensors
under :func:`default_cache_dir` by :func:`ensure_tiny_model` (safe from several ranks at once).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Literal

from filelock import FileLock

TokenizerKind = Literal["qwen", "local"]

#: sha256 of dashscope 2.0.2's ``qwen.tiktoken`` (151,643 base64 ``token rank`` lines).
QWEN_TIKTOKEN_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
#: Ranks kept by the ``local`` tokenizer (256 single bytes + 3840 merges).
LOCAL_BPE_RANKS = 4096
#: Pre-tokenisation regex of Qwen's tiktoken encoding (digits split one by one).
QWEN_PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
#: Added tokens in id order (offset 0 = first id after the BPE ranks); ``True`` = special.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
#: sha256 of the generated tokenizer files; a mismatch means the conversion changed.
TOKENIZER_FILE_SHA256: dict[str, dict[str, str]] = {
    "qwen": {
        "tokenizer.json": "498dc91c3adb39fd15b89c6f6d0fb11f44b46e6b1c1d4f677625f4e4844bca14",
        "tokenizer_config.json": "208e09795f3c9277f9f0a2d2a26595b41b6fd9db30c25d31c3805ddfbf285829",
    },
    "local": {
        "tokenizer.json": "d5ae7cf85c1c88623baeffdd17b6f441acbe1c15296a835bcaf9703885170d02",
        "tokenizer_config.json": "bbefd834ce93b8688251db077bffb5243fa162cbd9ecef42d93b4cdea5fc52f7",
    },
}
CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")
_FORMAT_VERSION = "1"  # bump when the on-disk layout of a cached model changes


def default_cache_dir() -> Path:
    """Return where embedded models are cached.

    ``$GYRE_CACHE_DIR`` if set; else ``<venv>/share/gyre`` inside an active virtual
    environment; else ``~/.cache/gyre``.
    """
    env = os.environ.get("GYRE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "share" / "gyre"
    return Path.home() / ".cache" / "gyre"


def qwen_tiktoken_path() -> Path:
    """Locate dashscope's ``qwen.tiktoken`` and check its sha256.

    Raises:
        FileNotFoundError: dashscope 2.0.2 is not installed (``pip install --no-deps
            dashscope==2.0.2``).
        ValueError: the file's sha256 differs from :data:`QWEN_TIKTOKEN_SHA256`.
    """
    try:
        files = importlib.metadata.files("dashscope") or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            "dashscope==2.0.2 is not installed; install it with pip --no-deps"
        ) from exc
    for f in files:
        if str(f).endswith("resources/qwen.tiktoken"):
            path = Path(f.locate())
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            if digest != QWEN_TIKTOKEN_SHA256:
                raise ValueError(f"{path}: sha256 {digest} != expected {QWEN_TIKTOKEN_SHA256}")
            return path
    raise FileNotFoundError("dashscope is installed but has no resources/qwen.tiktoken")


def load_qwen_bpe_ranks(max_ranks: int | None = None) -> dict[bytes, int]:
    """Read the Qwen BPE as ``{token_bytes: rank}``, ranks ``0..n-1`` (n = 151,643 or ``max_ranks``)."""
    ranks: dict[bytes, int] = {}
    for line in qwen_tiktoken_path().read_text().splitlines():
        if not line:
            continue
        token, rank = line.split()
        r = int(rank)
        if max_ranks is not None and r >= max_ranks:
            continue
        ranks[base64.b64decode(token)] = r
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("qwen.tiktoken ranks are not contiguous")
    return ranks


def build_tokenizer(out_dir: str | os.PathLike, kind: TokenizerKind = "qwen") -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

    The BPE is converted with ``transformers``' ``TikTokenConverter`` (vocab + merges in rank
    order, byte-level pre-tokeniser with Qwen's split regex).

    Args:
        out_dir: directory to write into (created).
        kind: ``"qwen"`` (151,669 ids) or ``"local"`` (:data:`LOCAL_BPE_RANKS` + 26 ids).
    Returns:
        ``Path(out_dir)``.
    """
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    if kind not in ("qwen", "local"):
        raise ValueError(f"unknown tokenizer kind {kind!r} (expected 'qwen' or 'local')")
    ranks = load_qwen_bpe_ranks(None if kind == "qwen" else LOCAL_BPE_RANKS)

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(_url: str) -> dict[bytes, int]:
            return ranks

    with tempfile.TemporaryDirectory(prefix="gyre-bpe-") as tmp:
        # Newer transformers read the ranks through the override above; older ones (5.3) open
        # ``vocab_file`` with tiktoken, so it is a real file in tiktoken's format as well.
        vocab_file = Path(tmp) / "ranks.tiktoken"
        vocab_file.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
        tok = _Converter(vocab_file=str(vocab_file), pattern=QWEN_PRETOKENIZE_PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    tok.add_tokens(
        [AddedToken(t, special=s, normalized=False) for t, s in ADDED_TOKENS]
    )
    base = len(ranks)
    for i, (t, _) in enumerate(ADDED_TOKENS):
        assert tok.token_to_id(t) == base + i, (t, tok.token_to_id(t))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 131072,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE_PATH.read_text(),
        "gyre_tokenizer_kind": kind,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2) + "\n"
    )
    return out


def tokenizer_vocab_size(kind: TokenizerKind) -> int:
    """Number of token ids the tokenizer can emit (BPE ranks + added tokens)."""
    return (151643 if kind == "qwen" else LOCAL_BPE_RANKS) + len(ADDED_TOKENS)


def tiny_qwen3_config(kind: TokenizerKind = "local", **overrides):
    """Return the tiny ``Qwen3Config`` of the embedded model.

    2 layers, hidden 128, 4 query heads and 2 KV heads of dim 32 (GQA), SwiGLU 384,
    RMSNorm eps 1e-6, RoPE theta 1e6, qk-norm, tied embeddings, fp32.  The vocabulary is
    padded to a multiple of 128 (151,936 for ``qwen``, as in Qwen3; 4,224 for ``local``).
    """
    from transformers import Qwen3Config

    n = tokenizer_vocab_size(kind)
    eos = (151643 if kind == "qwen" else LOCAL_BPE_RANKS) + 2  # <|im_end|>
    pad = eos - 2  # <|endoftext|>
    cfg = dict(
        vocab_size=(n + 127) // 128 * 128,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=False,
        hidden_act="silu",
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
    )
    cfg.update(overrides)
    return Qwen3Config(**cfg)


def build_tiny_model(
    out_dir: str | os.PathLike, kind: TokenizerKind = "local", seed: int = 1234, **overrides
) -> Path:
    """Write a complete HF-layout model directory: config, safetensors, tokenizer files.

    The weights are ``Qwen3ForCausalLM(tiny_qwen3_config(kind))`` initialised under
    ``torch.manual_seed(seed)`` (deterministic for a given torch build).
    """
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, kind)
    config = tiny_qwen3_config(kind, **overrides)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=False
    ).save_pretrained(out)
    (out / "gyre_model.json").write_text(
        json.dumps({"format": _FORMAT_VERSION, "tokenizer": kind, "seed": seed}) + "\n"
    )
    return out


def ensure_tiny_model(kind: TokenizerKind = "local", cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the cached embedded model directory for ``kind``, building it on first use.

    Concurrent callers (torchrun ranks) serialise on a lock file; the directory is built in
    a temporary sibling and renamed into place, so a half-written model is never visible.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-qwen3-{kind}-v{_FORMAT_VERSION}"
    if (target / "gyre_model.json").exists():
        return target
    return build_cached_dir(target, "gyre_model.json", lambda tmp: build_tiny_model(tmp, kind))


def build_cached_dir(target: Path, marker: str, build: Callable[[Path], object]) -> Path:
    """Return ``target`` once it holds ``marker``, building it with ``build(tmp)`` if it does not.

    Concurrent callers (torchrun ranks, test workers) serialise on a lock file beside ``target``;
    ``build`` writes into a temporary sibling that is renamed into place, so a half-written
    directory is never visible and a failed build leaves nothing behind."""
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(root / f".{target.name}.lock"):
        if (target / marker).exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
        try:
            build(tmp)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_tokenizer(model_dir: str | os.PathLike):
    """``AutoTokenizer.from_pretrained(model_dir)`` with the network off."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def load_hf_model(model_dir: str | os.PathLike, dtype: str = "float32"):
    """``AutoModelForCausalLM.from_pretrained(model_dir)`` in eval mode, network off."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(model_dir), local_files_only=True, dtype=getattr(torch, dtype)
    ).eval()


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


#: File names one of which a tokenizer directory holds (fast, sentencepiece, BPE or WordPiece vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
#: Weight files ``from_pretrained`` looks for, single-file or sharded (an index naming the shards).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def _short(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _weights_problem(root: Path) -> str | None:
    present = [n for n in WEIGHT_FILES if (root / n).is_file()]
    if not present:
        others = sorted(p.name for p in root.iterdir() if p.suffix in (".safetensors", ".bin"))
        return (f"no weight files ({', '.join(WEIGHT_FILES)})"
                + (f"; {', '.join(others[:3])} not loadable by transformers under those names" if others else ""))
    shards: list[str] = []
    for name in present:
        if name.endswith(".index.json"):
            try:
                weight_map = json.loads((root / name).read_text())["weight_map"]
                shards += sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                return f"{name}: not a readable shard index ({_short(exc)})"
        else:
            shards.append(name)
    for name in shards:
        path = root / name
        if not path.is_file():
            return f"weight file {name} is missing"
        try:
            if name.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(str(path), framework="pt") as f:
                    f.keys()
            else:
                import zipfile

                with open(path, "rb") as f:
                    head = f.read(4)
                if not head:
                    return f"weight file {name} is empty"
                if head == b"PK\x03\x04" and not zipfile.is_zipfile(path):  # torch.save's zip format
                    return f"weight file {name} is truncated (broken zip archive)"
        except OSError as exc:
            return f"weight file {name}: {exc.strerror or _short(exc)}"
        except Exception as exc:  # safetensors raises its own error type on a bad header or size
            return f"weight file {name}: not readable ({_short(exc)})"
    return None


def model_dir_problem(model_dir: str | os.PathLike) -> str | None:
    """What a run could not load from the HF-layout directory ``model_dir``, as one line; ``None`` if nothing.

    Checked in this order, the first failure reported: the directory exists; ``config.json`` is
    readable JSON that ``AutoConfig`` parses (local files only) into a model type with a
    causal-LM class in ``transformers``; one of :data:`TOKENIZER_FILES` is there and
    ``AutoTokenizer`` loads it offline into a tokenizer that encodes text; the weights of
    :data:`WEIGHT_FILES` (every shard an index names) are there and readable (safetensors
    headers and sizes checked, ``.bin`` zip archives checked for truncation).  Nothing is
    fetched from a hub and no weights are loaded.
    """
    import warnings

    root = Path(model_dir)
    if not root.exists():
        return "no such directory"
    if not root.is_dir():
        return "not a directory"
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        return "no config.json"
    try:
        data = json.loads(cfg_path.read_text(encoding="utf-8"))
    except OSError as exc:
        return f"config.json: {exc.strerror or _short(exc)}"
    except ValueError as exc:
        return f"config.json: not valid JSON ({_short(exc)})"
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        return "config.json: no model_type (not a transformers model config)"
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging as hf_logging

    model_type = data["model_type"]
    if model_type not in CONFIG_MAPPING_NAMES:
        return f"config.json: model_type {model_type!r} is unknown to this transformers"
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"config.json: model_type {model_type!r} has no causal-LM class in transformers"
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                AutoConfig.from_pretrained(str(root), local_files_only=True)
            except Exception as exc:
                return f"config.json: transformers cannot parse it ({_short(exc)})"
            if not any((root / n).is_file() for n in TOKENIZER_FILES):
                return f"no tokenizer files ({', '.join(TOKENIZER_FILES)})"
            try:
                tok = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
                if not tok("hello world")["input_ids"]:
                    return "the tokenizer encodes text to no tokens"
            except Exception as exc:
                return f"tokenizer: cannot load it offline ({_short(exc)})"
    finally:
        hf_logging.set_verbosity(verbosity)
    return _weights_problem(root)
