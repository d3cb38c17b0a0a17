import json
import os
import subprocess
import sys

import pytest
import torch

from gyre.embedded_model import (QWEN_TIKTOKEN_SHA256, TOKENIZER_FILE_SHA256, file_sha256, load_hf_model,
                                 load_tokenizer, qwen_tiktoken_path, tokenizer_vocab_size)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Run ls"},
    {"role": "assistant", "content": "", "reasoning_content": "use shell",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "shell", "arguments": {"cmd": "ls"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
    {"role": "assistant", "content": "Found a.py."},
]
TOOLS = [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}]
EXPECTED_TEXT = (
    '<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.'
    '\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n'
    '{"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}\n</tools>\n\n'
    'For each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    '</tool_call><|im_end|>\n<|im_start|>user\nRun ls<|im_end|>\n<|im_start|>assistant\n<think>\nuse shell\n'
    '</think>\n\n<tool_call>\n{"name": "shell", "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>\n'
    '<|im_start|>user\n<tool_response>\na.py\n</tool_response><|im_end|>\n<|im_start|>assistant\nFound a.py.'
    '<|im_end|>\n<|im_start|>assistant\n'
)
EXPECTED_LOCAL = [
    4097, 82, 612, 198, 3430, 293, 461, 823, 382, 2, 350, 1749, 82, 271, 2610, 1231,
    1618, 825, 476, 803, 729, 82, 311, 1071, 380, 448, 279, 1196, 3239, 382, 2610, 525,
    3897, 448, 729, 1841, 2789, 2878, 366, 983, 3069, 1472, 983, 3069, 29, 1599, 2668, 259,
    2032, 510, 27, 983, 3069, 397, 90, 1, 1313, 788, 330, 1688, 497, 330, 1688, 788,
    314, 1, 606, 788, 330, 927, 613, 497, 330, 903, 2424, 788, 314, 1, 1313, 788,
    330, 1700, 1, 3417, 532, 522, 983, 3069, 1339, 2461, 1817, 729, 1618, 11, 470, 264,
    2951, 1633, 448, 729, 829, 323, 1392, 2831, 2878, 220, 4110, 4111, 1599, 2668, 259, 2032,
    510, 4110, 198, 90, 1, 606, 788, 366, 1688, 12, 606, 29, 11, 330, 858, 2831,
    788, 366, 2116, 12, 2236, 12, 1700, 29, 532, 4111, 4098, 198, 4097, 872, 198, 49,
    359, 326, 82, 4098, 198, 4097, 395, 380, 517, 198, 4120, 198, 810, 557, 613, 198,
    4121, 271, 4110, 198, 90, 1, 606, 788, 330, 927, 613, 497, 330, 858, 2831, 788,
    314, 1, 66, 2277, 788, 330, 75, 82, 1, 92, 532, 4111, 4098, 198, 4097, 872,
    198, 4118, 198, 64, 556, 88, 198, 4119, 4098, 198, 4097, 395, 380, 517, 198, 37,
    795, 264, 556, 88, 13, 4098, 198, 4097, 395, 380, 517, 198,
]
EXPECTED_QWEN = [
    151644, 8948, 198, 3430, 9814, 382, 2, 13852, 271, 2610, 1231, 1618, 825, 476, 803, 5746,
    311, 7789, 448, 279, 1196, 3239, 382, 2610, 525, 3897, 448, 729, 32628, 2878, 366, 15918,
    1472, 15918, 29, 11874, 9492, 510, 27, 15918, 397, 4913, 1313, 788, 330, 1688, 497, 330,
    1688, 788, 5212, 606, 788, 330, 21384, 497, 330, 13786, 788, 5212, 1313, 788, 330, 1700,
    30975, 532, 522, 15918, 1339, 2461, 1817, 729, 1618, 11, 470, 264, 2951, 1633, 448, 729,
    829, 323, 5977, 2878, 220, 151657, 151658, 11874, 9492, 510, 151657, 198, 4913, 606, 788, 366,
    1688, 11494, 8066, 330, 16370, 788, 366, 2116, 56080, 40432, 31296, 151658, 151645, 198, 151644, 872,
    198, 6727, 19597, 151645, 198, 151644, 77091, 198, 151667, 198, 810, 12528, 198, 151668, 271, 151657,
    198, 4913, 606, 788, 330, 21384, 497, 330, 16370, 788, 5212, 8710, 788, 330, 4730, 95642,
    151658, 151645, 198, 151644, 872, 198, 151665, 198, 64, 7197, 198, 151666, 151645, 198, 151644, 77091,
    198, 6650, 264, 7197, 13, 151645, 198, 151644, 77091, 198,
]


def test_qwen_tiktoken_checksum():
    from gyre.embedded_model import file_sha256

    assert file_sha256(qwen_tiktoken_path()) == QWEN_TIKTOKEN_SHA256


@pytest.mark.parametrize("kind", ["local", "qwen"])
def test_tokenizer_files_checksum(kind, tiny_model_dir, tiny_qwen_model_dir):
    d = tiny_model_dir if kind == "local" else tiny_qwen_model_dir
    for name, digest in TOKENIZER_FILE_SHA256[kind].items():
        assert file_sha256(d / name) == digest, name


@pytest.mark.parametrize("kind", ["local", "qwen"])
def test_chat_template_multi_turn_tool_calling_exact_ids(kind, tiny_model_dir, tiny_qwen_model_dir):
    tok = load_tokenizer(tiny_model_dir if kind == "local" else tiny_qwen_model_dir)
    text = tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text == EXPECTED_TEXT
    ids = tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids == (EXPECTED_LOCAL if kind == "local" else EXPECTED_QWEN)
    assert tok.decode(ids) == EXPECTED_TEXT


def test_qwen_ids_match_qwen3_special_and_common_tokens(tiny_qwen_model_dir):
    tok = load_tokenizer(tiny_qwen_model_dir)
    # Qwen2/Qwen3 ids: <|im_start|>system\n, <|im_end|>, <tool_call>, <think>, "assistant", "user"
    assert tok.encode("<|im_start|>system\n") == [151644, 8948, 198]
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                                      "<tool_response>", "<think>", "</think>"]) == [
        151643, 151645, 151657, 151658, 151665, 151667, 151668]
    assert tok.encode("assistant") == [77091] and tok.encode("user") == [872]
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert len(tok) == tokenizer_vocab_size("qwen") == 151669
    # <tool_call>/<think> are added but not special: decoding with skip_special_tokens keeps them
    assert tok.decode([151657, 151667, 151645], skip_special_tokens=True) == "<tool_call><think>"


def test_tool_call_arguments_as_string_are_kept_verbatim(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": "ok", "tool_calls": [
                {"type": "function", "function": {"name": "edit", "arguments": '{"path":"a.py",  "n": 1}'}}]}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text.endswith('<|im_start|>assistant\nok\n<tool_call>\n{"name": "edit", "arguments": {"path":"a.py",  "n": 1}}'
                         '\n</tool_call><|im_end|>\n')


def test_generation_prompt_without_thinking(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                   tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_hf_tiny_model_forward(tiny_model_dir):
    model = load_hf_model(tiny_model_dir)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 128, 4, 2)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 4224
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[4097, 872, 198, 603, 4098, 198, 4097, 395, 380, 517, 198]])
    with torch.no_grad():
        out = model(ids, labels=ids)
    assert out.logits.shape == (1, 11, 4224) and out.logits.dtype == torch.float32
    # a randomly initialised model predicts ~uniformly: loss close to log(vocab)
    assert abs(out.loss.item() - torch.log(torch.tensor(4224.0)).item()) < 0.5
    # causal: the first 5 positions do not depend on later tokens
    ids2 = ids.clone()
    ids2[0, 7:] = 5
    with torch.no_grad():
        out2 = model(ids2)
    torch.testing.assert_close(out.logits[:, :5], out2.logits[:, :5], rtol=0, atol=1e-6)
    assert not torch.allclose(out.logits[:, 8:], out2.logits[:, 8:])


@pytest.mark.slow  # a process
def test_model_loads_with_network_off(tiny_model_dir):
    code = ("import sys; from gyre.embedded_model import load_hf_model, load_tokenizer; "
            "m = load_hf_model(sys.argv[1]); t = load_tokenizer(sys.argv[1]); print(type(m).__name__, len(t))")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9")
    r = subprocess.run([sys.executable, "-c", code, str(tiny_model_dir)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-2:] == ["Qwen3ForCausalLM", "4122"]


@pytest.mark.slow  # the CLI as a process
def test_make_tiny_model_cli(tmp_path):
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "m"
    r = subprocess.run([sys.executable, str(root / "tools" / "make_tiny_model.py"), "--out", str(out), "--tokenizer", "local"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"model_dir": str(out)}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file(), name
    assert file_sha256(out / "tokenizer.json") == TOKENIZER_FILE_SHA256["local"]["tokenizer.json"]
    r = subprocess.run([sys.executable, str(root / "tools" / "make_tiny_model.py"), "--out", str(out), "--tokenizer", "nope"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_build_cached_dir_builds_once_and_leaves_nothing_when_a_build_fails(tmp_path):
    """One build per directory however many callers race for it; a build that raises leaves
    neither the directory nor its temporary sibling."""
    from concurrent.futures import ThreadPoolExecutor

    from gyre.embedded_model import build_cached_dir

    builds = []

    def build(tmp):
        builds.append(tmp)
        (tmp / "weights").write_text("w")
        (tmp / "done").write_text("")

    target = tmp_path / "cache" / "model-v1"
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: build_cached_dir(target, "done", build), range(8)))
    assert got == [target] * 8 and len(builds) == 1 and (target / "weights").read_text() == "w"

    def fail(tmp):
        (tmp / "half").write_text("")
        raise RuntimeError("conversion failed")

    other = tmp_path / "cache" / "model-v2"
    with pytest.raises(RuntimeError, match="conversion failed"):
        build_cached_dir(other, "done", fail)
    assert sorted(p.name for p in other.parent.iterdir() if not p.name.endswith(".lock")) == ["model-v1"]
