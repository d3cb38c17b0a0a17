import json
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.embedded_model import load_tokenizer
from gyre.training.warmstart import Example, load_examples, render_example, sft_lr_factor
from tools.warmstart import tool_loop_examples, toy_largest_examples

ROOT = Path(__file__).resolve().parents[2]


def test_render_masks_everything_but_assistant_tokens(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    ex = Example([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "done"}])
    ids, labels = render_example(tok, ex)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\ndone<|im_end|>\n"
    targets = [t for t in labels if t != -100]
    assert tok.decode(targets) == "done<|im_end|>\n"
    assert labels[: len(ids) - len(targets)] == [-100] * (len(ids) - len(targets))


def test_tool_loop_examples_are_rendered_calls(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    exs = tool_loop_examples(2)
    assert len(exs) == 3
    ids, labels = render_example(tok, exs[2])
    text = tok.decode([t for t in labels if t != -100])
    assert text.count('<tool_call>\n{"name": "bash", "arguments": {"command": "echo step"}}\n</tool_call>') == 3


def test_toy_largest_examples_answer_a_listed_digit_and_skip_the_rl_lists(tiny_model_dir):
    from gyre.tasks import load_tasks

    rl = [t.instruction for t in load_tasks(ROOT / "examples" / "tasks" / "toy" / "largest.tasks.jsonl").tasks]
    exs = toy_largest_examples(rl, n=400, seed=3)
    assert len(exs) == 400
    prompts, answers = [], []
    for ex in exs:
        prompt, call = ex.messages[0]["content"], ex.messages[1]["tool_calls"][0]["function"]
        digits = prompt.removeprefix("What is the largest of ").removesuffix("? Write the result to answer.txt")
        assert call["name"] == "write_file" and call["arguments"]["path"] == "answer.txt"
        assert call["arguments"]["content"] in digits.split()
        prompts.append(prompt)
        answers.append(call["arguments"]["content"] == max(digits.split()))
    assert not set(prompts) & set(rl)
    assert 0.15 < sum(answers) / len(answers) < 0.45   # a random listed digit, not the largest
    assert [e.messages for e in toy_largest_examples(rl, n=5, seed=3)] == [e.messages for e in exs[:5]]
    skipped = toy_largest_examples([prompts[0]], n=400, seed=3)   # exclusion by instruction
    assert prompts[0] not in {e.messages[0]["content"] for e in skipped} and len(skipped) == 400
    tok = load_tokenizer(tiny_model_dir)
    ids, labels = render_example(tok, exs[0])
    assert tok.decode([t for t in labels if t != -100]).startswith('<tool_call>\n{"name": "write_file"')
    with pytest.raises(ValueError, match="n must be >= 1"):
        toy_largest_examples(n=0)


def test_load_examples_errors_name_the_line(tmp_path):
    p = tmp_path / "ex.jsonl"
    p.write_text('{"messages": []}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match=r"ex.jsonl:2: expected an object with a 'messages' list"):
        load_examples(p)
    p.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"ex.jsonl:1: not valid JSON"):
        load_examples(p)


@pytest.mark.slow  # the CLI as a process, a model trained
def test_cli_trains_and_saves(tmp_path, tiny_model_dir):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "warmstart.py"), "--out", str(tmp_path / "m"),
                        "--builtin", "tool-loop", "--steps", "3"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"model_dir": str(tmp_path / "m")}
    assert (tmp_path / "m" / "model.safetensors").is_file() and (tmp_path / "m" / "tokenizer.json").is_file()
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "warmstart.py"), "--out", str(tmp_path / "m2"),
                        "--examples", str(tmp_path / "missing.jsonl")], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_sft_lr_schedule_warmup_then_cosine():
    steps, warm, floor = 110, 10, 0.1
    f = [sft_lr_factor(i, steps, warm, floor) for i in range(steps + 1)]
    assert f[0] == pytest.approx(0.1) and f[4] == pytest.approx(0.5) and f[9] == pytest.approx(1.0)
    assert f[10] == pytest.approx(1.0)                       # decay starts at the peak
    assert f[60] == pytest.approx((1 + floor) / 2)           # half-way through the decay: cos(pi/2) = 0
    assert f[110] == pytest.approx(floor)                    # ends at min_lr_ratio
    assert all(a >= b for a, b in zip(f[10:], f[11:]))       # monotone after warm-up
    assert sft_lr_factor(500, steps, warm, floor) == pytest.approx(floor)  # clamped past the end
