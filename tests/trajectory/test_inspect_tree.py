"""tools/inspect_tree.py and gyre.trajectory.tree_views: text, JSON and HTML views of a stored tree."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from gyre.trajectory import RecordWriter, TrajectoryTree
from gyre.trajectory.tree_views import find_run_tokenizer, render_html, tree_stats

from .helpers import EXT, POL, rec

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "inspect_tree.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("inspect_tree_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tool = _load_tool()

SYS, USER = [1, 2, 3], [4, 5]


def compaction_records():
    return [
        rec(0, SYS + USER, [10, 11]),
        rec(1, SYS + USER + [10, 11, 6, 7], [12, 13], version=1),
        rec(2, SYS + USER + [10, 11, 6, 7, 12, 13, 8], [14], version=1),
        rec(3, SYS + USER + [10, 11, 6, 7, 12, 13, 8, 14, 90, 91], [50, 51, 52], role="compaction", version=2),
        rec(4, SYS + [93, 50, 51, 52], [15], prov=[EXT] * 4 + [POL] * 3, version=2),
        rec(5, [200, 201], [202], role="subagent", delivered=False, version=2),
    ]


@pytest.fixture()
def stored(tmp_path) -> Path:
    path = tmp_path / "exec-1.jsonl"
    with RecordWriter(path) as w:
        for r in compaction_records():
            w.append(r)
    return path


def test_text_view_exact(stored, capsys):
    assert tool.main([str(stored)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "+ branch at token 0",
        "  #7 subagent call=5 v=2 new=3 (in 2 / out 1) total=3 trainable=0 delivered=no finish=stop leaf",
        "#5 main call=0 v=0 new=3 (in 3 / out 0) total=3 trainable=0 delivered=yes finish=stop",
        "+ branch at token 3",
        "  #6 main call=4 v=2 new=5 (in 4 / out 1) total=8 trainable=1 delivered=yes finish=stop leaf",
        "#1 main call=0 v=0 new=4 (in 2 / out 2) total=7 trainable=2 delivered=yes finish=stop",
        "#2 main call=1 v=1 new=4 (in 2 / out 2) total=11 trainable=2 delivered=yes finish=stop",
        "#3 main call=2 v=1 new=2 (in 1 / out 1) total=13 trainable=1 delivered=yes finish=stop",
        "#4 compaction call=3 v=2 new=5 (in 2 / out 3) total=18 trainable=3 delivered=yes finish=stop leaf",
        "execution exec-1: 6 records, 7 nodes, 3 leaves (compaction 1, main 1, subagent 1); "
        "tokens total 60, unique 26, trainable 9",
    ]


def test_json_stats_exact(stored, capsys):
    assert tool.main([str(stored), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats == {
        "records": 6,
        "nodes": 7,
        "leaves": 3,
        "leaves_by_role": {"compaction": 1, "main": 1, "subagent": 1},
        "tokens_total": 7 + 11 + 13 + 18 + 8 + 3,
        "tokens_unique": 26,
        "trainable_tokens": 9,
    }
    assert list(stats) == ["records", "nodes", "leaves", "leaves_by_role", "tokens_total", "tokens_unique",
                           "trainable_tokens"]
    assert tool.main([str(stored), "--json", "--include-undelivered"]) == 0
    assert json.loads(capsys.readouterr().out)["trainable_tokens"] == 10


class _Counter(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[str, int] = {}
        self.open: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []

    def handle_starttag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        self.attrs.extend(attrs)
        if tag not in ("meta", "br"):
            self.open.append(tag)

    def handle_endtag(self, tag):
        assert self.open and self.open[-1] == tag, (tag, self.open[-5:])
        self.open.pop()


def test_html_is_self_contained_and_well_formed(stored, tmp_path, capsys):
    out = tmp_path / "tree.html"
    assert tool.main([str(stored), "--html", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    page = out.read_text(encoding="utf-8")
    parser = _Counter()
    parser.feed(page)
    parser.close()
    assert parser.open == []  # every tag closed, properly nested
    # 7 nodes + 2 branches, each an expandable <details>
    assert parser.tags["details"] == 9 and parser.tags["summary"] == 9
    # one inline script (the expand all / collapse all buttons), nothing loaded from elsewhere
    assert parser.tags["script"] == 1 and parser.tags["button"] == 2
    assert "link" not in parser.tags and "img" not in parser.tags
    assert not any(k in ("src", "href") for k, _ in parser.attrs)
    assert '<button type="button" onclick="gyreSetAll(true)">expand all</button>' in page
    assert '<button type="button" onclick="gyreSetAll(false)">collapse all</button>' in page
    assert "function gyreSetAll(o){document.querySelectorAll('details').forEach(function(d){d.open=o;});}" in page
    assert page.startswith("<!DOCTYPE html>")
    # token ids shown without a tokenizer; trainable outputs marked
    assert '<span class="ext">93</span><span class="pol"> 50 51 52</span><span class="tgt"> 15</span>' in page


def test_html_elides_long_nodes():
    tree = TrajectoryTree()
    tree.insert(rec(0, list(range(100)), [7] * 10))
    page = render_html(tree, max_tokens=20)
    assert "[... 90 tokens ...]" in page


def test_cli_errors(tmp_path, capsys):
    assert tool.main([str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such record file" in err
    bad = tmp_path / "bad.jsonl"
    with RecordWriter(bad) as w:
        for r in compaction_records()[:3]:
            w.append(r)
    lines = bad.read_bytes().split(b"\n")
    lines[0] = lines[0].replace(b"engine-0", b"engine-X")
    bad.write_bytes(b"\n".join(lines))
    assert tool.main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "corrupt record line" in err
    with pytest.raises(SystemExit) as e:
        tool.main(["--bogus"])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    good = tmp_path / "exec-1.jsonl"
    with RecordWriter(good) as w:
        w.append(compaction_records()[0])
    assert tool.main([str(good), "--tokenizer", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot load a tokenizer" in err
    assert tool.main([str(good), "--html", str(tmp_path / "no" / "dir" / "x.html")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_torn_file_is_inspected_with_a_warning(stored, capsys):
    with open(stored, "ab") as f:
        f.write(b'{"v":1,"seq":6')
    assert tool.main([str(stored), "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["records"] == 6
    assert "warning" in cap.err and "torn final record" in cap.err


def test_runs_as_a_script(stored):
    proc = subprocess.run([sys.executable, str(TOOL), str(stored), "--json"], capture_output=True, text=True,
                          timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["nodes"] == 7


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    try:
        from gyre.embedded_model import build_tokenizer

        return build_tokenizer(tmp_path_factory.mktemp("tok"), "local")
    except (ImportError, FileNotFoundError) as e:  # dashscope (the BPE source) not installed
        pytest.skip(f"embedded tokenizer unavailable: {e}")


def test_html_decodes_with_tokenizer(tokenizer_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    prompt = tok.encode("Fix the failing test.", add_special_tokens=False)
    answer = tok.encode("I will run pytest & read <the> log.", add_special_tokens=False)
    path = tmp_path / "exec-1.jsonl"
    with RecordWriter(path) as w:
        w.append(rec(0, prompt, answer))
    out = tmp_path / "t.html"
    assert tool.main([str(path), "--html", str(out), "--tokenizer", str(tokenizer_dir)]) == 0
    page = out.read_text(encoding="utf-8")
    assert '<span class="ext">Fix the failing test.</span>' in page
    assert '<span class="tgt">I will run pytest &amp; read &lt;the&gt; log.</span>' in page
    capsys.readouterr()
    assert tool.main([str(path), "--tokenizer", str(tokenizer_dir)]) == 0
    assert '"Fix the failing test.I will run pytest & read <the> log."' in capsys.readouterr().out


def test_tree_stats_of_an_empty_tree():
    assert tree_stats(TrajectoryTree("e")) == {
        "records": 0, "nodes": 0, "leaves": 0, "leaves_by_role": {}, "tokens_total": 0, "tokens_unique": 0,
        "trainable_tokens": 0,
    }


def _run_dir(tmp_path, records, args=None):
    """A run directory RUN/ with RUN/records/exec-1.jsonl and (when given) RUN/args.json."""
    run = tmp_path / "run"
    (run / "records").mkdir(parents=True)
    path = run / "records" / "exec-1.jsonl"
    with RecordWriter(path) as w:
        for r in records:
            w.append(r)
    if args is not None:
        (run / "args.json").write_text(json.dumps(args))
    return run, path


def _encoded(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    return tok.encode("Fix the failing test.", add_special_tokens=False), tok.encode("Done.", add_special_tokens=False)


def test_run_tokenizer_from_the_newest_checkpoint(tokenizer_dir, tmp_path, capsys):
    import shutil

    prompt, answer = _encoded(tokenizer_dir)
    run, path = _run_dir(tmp_path, [rec(0, prompt, answer)], {"model_dir": "/nonexistent", "tokenizer_kind": "local"})
    assert find_run_tokenizer(path) is None  # model_dir without a tokenizer, no checkpoint
    for it in ("iter_0000002", "iter_0000010"):
        shutil.copytree(tokenizer_dir, run / "checkpoints" / it / "hf")
    (run / "checkpoints" / "iter_0000011" / "hf").mkdir(parents=True)  # no tokenizer files: skipped
    assert find_run_tokenizer(path) == run / "checkpoints" / "iter_0000010" / "hf"
    out = tmp_path / "t.html"
    assert tool.main([str(path), "--html", str(out)]) == 0
    cap = capsys.readouterr()
    assert f"decoding with the run's tokenizer {run / 'checkpoints' / 'iter_0000010' / 'hf'}" in cap.err
    page = out.read_text(encoding="utf-8")
    assert '<span class="ext">Fix the failing test.</span><span class="tgt">Done.</span>' in page
    assert tool.main([str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith('"Fix the failing test.Done."')
    # --ids shows token ids; --json alone loads no tokenizer
    assert tool.main([str(path), "--ids"]) == 0
    cap = capsys.readouterr()
    assert "Fix" not in cap.out and cap.err == ""
    assert tool.main([str(path), "--json"]) == 0
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as e:
        tool.main([str(path), "--ids", "--tokenizer", str(tokenizer_dir)])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_run_tokenizer_from_args_model_dir(tokenizer_dir, tmp_path):
    _run, path = _run_dir(tmp_path, [rec(0, SYS, [10])], {"model_dir": str(tokenizer_dir), "tokenizer_kind": "qwen"})
    assert find_run_tokenizer(path) == tokenizer_dir


def test_run_tokenizer_of_the_embedded_model(tiny_model_dir, tmp_path):
    # model_dir null: the embedded tiny model of the run's tokenizer kind and cache dir
    _run, path = _run_dir(tmp_path, [rec(0, SYS, [10])],
                          {"model_dir": None, "tokenizer_kind": "local", "model_cache_dir": str(tiny_model_dir.parent)})
    assert find_run_tokenizer(path) == tiny_model_dir
    (tmp_path / "run" / "args.json").write_text(json.dumps({"model_dir": None, "tokenizer_kind": "bogus"}))
    assert find_run_tokenizer(path) is None


def test_no_run_tokenizer_outside_a_run_directory(stored, tmp_path):
    assert find_run_tokenizer(stored) is None  # tmp_path/exec-1.jsonl: not under records/
    bare = tmp_path / "x" / "records"
    bare.mkdir(parents=True)
    (bare / "e.jsonl").write_bytes(stored.read_bytes())
    assert find_run_tokenizer(bare / "e.jsonl") is None  # records/ of a directory without args.json or checkpoints
