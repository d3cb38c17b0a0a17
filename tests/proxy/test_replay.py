"""Every recorded harness trace (tests/data/traces, and the extra trace set when present) replays through the proxy core with exact token reuse
(gyre/proxy/replay.py, tools/replay_trace.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gyre.proxy.replay import replay_trace
from gyre.trajectory.store import TrajectoryStore
from tests.conftest import EXTRA_TRACES, TRACES, trace_sources

# trace -> (records, skipped, leaves_by_role, requests expected to extend an earlier path)
EXPECTED = {
    "recorded": {
        "claude-code/cc1_tools_subagent.jsonl": (10, 0, {"main": 2, "subagent": 1}, 8),
        "claude-code/cc2_autocompact.jsonl": (12, 0, {"compaction": 1, "main": 3, "subagent": 1}, 8),
        "claude-code/cc3_retry_500_429_529.jsonl": (11, 4, {"main": 2, "subagent": 1}, 9),
        "claude-code/cc4_timeout_drop.jsonl": (11, 2, {"main": 2, "subagent": 1}, 9),
        "codex/cx1_tools_subagent.jsonl": (9, 0, {"main": 1, "subagent": 1}, 7),
        "codex/cx2_gpt55_autocompact.jsonl": (6, 0, {"compaction": 1, "main": 2}, 3),
        "codex/cx3_retry_drop.jsonl": (9, 3, {"main": 1, "subagent": 1}, 7),
        "mini-swe-agent/ms1_toolcalling_chat.jsonl": (4, 0, {"main": 1}, 3),
        "mini-swe-agent/ms2_textbased_chat.jsonl": (4, 0, {"main": 1}, 3),
        "mini-swe-agent/ms3_retry.jsonl": (4, 3, {"main": 1}, 3),
    },
    "extra": {
        "claude-code/cc1_basic_tools_subagent.jsonl": (11, 0, {"main": 1, "subagent": 1}, 9),
        "claude-code/cc2a_autocompact.jsonl": (11, 0, {"compaction": 1, "main": 2, "subagent": 1}, 8),
        "claude-code/cc3_retry_500_429_529.jsonl": (10, 4, {"main": 1, "subagent": 1}, 8),
        "codex/cx1_basic_unknown_model.jsonl": (5, 0, {"main": 1}, 4),
        "codex/cx2_gpt55_autocompact.jsonl": (6, 0, {"compaction": 1, "main": 2}, 3),
        "codex/cx3_subagent.jsonl": (9, 0, {"main": 1, "subagent": 1}, 7),
        "mini-swe-agent/ms1_toolcalling_chat.jsonl": (4, 0, {"main": 1}, 3),
        "mini-swe-agent/ms2_textbased_chat.jsonl": (4, 0, {"main": 1}, 3),
        "mini-swe-agent/ms4_retry.jsonl": (4, 3, {"main": 1}, 3),
    },
}
ROOTS = {"recorded": TRACES, "extra": EXTRA_TRACES}
CASES = [(src, name) for src in trace_sources() for name in sorted(EXPECTED[src])]


def test_every_trace_is_covered(trace_source):
    source, root = trace_source
    found = {str(p.relative_to(root)) for p in root.glob("*/*.jsonl")}
    assert found == set(EXPECTED[source])


@pytest.mark.parametrize("source, name", CASES)
def test_trace_replays_exactly(local_renderer, source, name):
    records, skipped, leaves, extending = EXPECTED[source][name]
    res = replay_trace(ROOTS[source] / name, local_renderer, check_render=True)
    s = res.summary()
    assert (s["mismatches"], s["duplicates"], s["format_mismatches"], s["render_mismatches"]) == (0, 0, 0, 0)
    assert (s["records"], s["skipped"], s["leaves_by_role"]) == (records, skipped, leaves)
    reqs = s["requests"]
    assert sum(q["expected_parent_seq"] is not None for q in reqs) == extending
    for q in reqs:
        if q["expected_parent_seq"] is not None:  # exact reuse: the whole parent path plus the template "\n"
            assert q["extends_expected_parent"] and q["reused_tokens"] > q["rendered_tokens"]


def test_claude_code_compaction_structure(traces_dir, local_renderer):
    res = replay_trace(traces_dir / "claude-code/cc2_autocompact.jsonl", local_renderer)
    reqs = {q["seq"]: q for q in res.summary()["requests"]}
    assert [reqs[i]["role"] for i in range(1, 13)] == (
        ["main"] * 3 + ["compaction"] + ["main"] * 4 + ["subagent", "main", "subagent", "main"])
    assert reqs[4]["expected_parent_seq"] == 2  # the summarisation request drops the newest assistant turn
    tree = res.tree
    # pre-compaction main (seq 3), compaction (seq 4), the first post-compaction request (seq 5; the
    # next one re-sends its context changed), the final main answer and the sub-agent's last turn
    leaf_seqs = sorted(tree.owner(n).metadata["seq"] for n in tree.leaves())
    assert leaf_seqs == [3, 4, 5, 11, 12]
    # the post-compaction context is a new branch that carries the step-2 reply verbatim
    assert reqs[5]["expected_parent_seq"] is None and reqs[5]["identified_outputs"] == 1
    assert reqs[5]["reused_tokens"] > 0  # system + tools block and the spliced reply


def test_codex_subagent_threads(traces_dir, local_renderer):
    res = replay_trace(traces_dir / "codex/cx1_tools_subagent.jsonl", local_renderer)
    reqs = res.summary()["requests"]
    threads = {q["thread"] for q in reqs}
    assert len(threads) == 2
    assert [q["role"] for q in reqs] == ["main"] * 5 + ["subagent"] * 2 + ["main"] * 2


def test_codex_compaction_starts_a_new_window(traces_dir, local_renderer):
    res = replay_trace(traces_dir / "codex/cx2_gpt55_autocompact.jsonl", local_renderer)
    reqs = res.summary()["requests"]
    assert [q["role"] for q in reqs] == ["main"] * 3 + ["compaction"] + ["main"] * 2
    assert [q["expected_parent_seq"] for q in reqs] == [None, 1, 2, None, None, 5]
    assert sorted(res.tree.owner(n).metadata["seq"] for n in res.tree.leaves()) == [3, 4, 6]


def test_real_qwen_vocabulary(traces_dir, qwen_renderer):
    res = replay_trace(traces_dir / "claude-code/cc2_autocompact.jsonl", qwen_renderer, check_render=True)
    s = res.summary()
    assert (s["mismatches"], s["duplicates"], s["render_mismatches"]) == (0, 0, 0)


def test_cli_json_and_store(traces_dir, tmp_path):
    trace = traces_dir / "mini-swe-agent/ms3_retry.jsonl"
    out = subprocess.run([sys.executable, "tools/replay_trace.py", str(trace), "--json", "--save-dir", str(tmp_path)],
                         capture_output=True, text=True, check=True)
    s = json.loads(out.stdout)
    assert (s["records"], s["skipped"], s["mismatches"], s["duplicates"], s["leaves"]) == (4, 3, 0, 0, 1)
    assert {"seq", "reused_tokens", "tree_matched_tokens", "input_tokens"} <= set(s["requests"][0])
    tree = TrajectoryStore(tmp_path).load_tree("ms3_retry")
    assert len(tree.records) == 4 and len(tree.leaves()) == 1
    bad = subprocess.run([sys.executable, "tools/replay_trace.py", str(tmp_path / "nope.jsonl")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
