"""Continuous-batching core (gyre/rollout/embedded/core.py) against a fake model.

The fake model's KV *is* the token ids, and its logits are a pseudo-random function of every
KV entry up to the fed position.  Any KV bookkeeping error (prefix cache, slot moves, padding,
retraction) therefore changes the outputs, which are compared with a reference that generates
each sequence alone with no cache.
"""

import hashlib
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.rollout.api.sglang_api import ProtocolError, SamplingParams, SeqSpec
from gyre.rollout.embedded.core import CoreConfig, EngineCore
from gyre.rollout.embedded.sampling import sample_next_tokens

V = 16
EOS = 15


def fake_logits(tokens, salt=0):
    h = int.from_bytes(hashlib.blake2b(repr((salt, tuple(tokens))).encode(), digest_size=8).digest(), "little")
    return torch.randn(V, generator=torch.Generator().manual_seed(h % (1 << 62))) * 2


class FakeRunner:
    def __init__(self, context_len=64):
        self.vocab_size, self.context_len = V, context_len
        self.kv = {}
        self.salt = 0           # "weights"
        self.prefilled = 0
        self.decoded = 0

    def _row(self, slot):
        return self.kv.setdefault(slot, [])

    def prefill(self, slot, token_ids, start):
        row = self._row(slot)
        assert len(row) >= start
        self.kv[slot] = row[:start] + [(t, self.salt) for t in token_ids]
        self.prefilled += len(token_ids)

    def decode(self, token_ids, positions):
        out = []
        for b, (t, p) in enumerate(zip(token_ids, positions)):
            row = self._row(b)
            assert len(row) >= p, "decode position beyond stored KV"
            self.kv[b] = row[:p] + [(t, self.salt)]
            assert all(s == self.salt for _, s in self.kv[b]), "stale KV from old weights"
            out.append(fake_logits([x for x, _ in self.kv[b]], self.salt))
            self.decoded += 1
        return torch.stack(out)

    def read_kv(self, slot, a, b):
        return list(self.kv[slot][a:b])

    def write_kv(self, slot, start, pieces):
        row = self._row(slot)[:start]
        for p in pieces:
            row += list(p)
        self.kv[slot] = row

    def move_slot(self, src, dst, length):
        self.kv[dst] = list(self.kv[src][:length])

    @staticmethod
    def slice_kv(payload, a, b):
        return payload[a:b]


def reference(input_ids, params, seed, salt=0, stop_strings_decode=None, context_len=64):
    """Generate one sequence alone, no cache, same sampling code."""
    gen = torch.Generator().manual_seed(seed)
    toks, out = list(input_ids), []
    while True:
        banned = [[EOS] + list(params.stop_token_ids)] if (not params.ignore_eos and len(out) < params.min_new_tokens) else None
        r = sample_next_tokens(fake_logits(toks, salt)[None], [params], [gen], banned=banned)
        t = r.token_ids[0]
        out.append(t)
        toks.append(t)
        if len(out) >= params.max_new_tokens:
            return out, {"type": "length", "length": len(out)}
        if not params.ignore_eos and (t == EOS or t in params.stop_token_ids):
            return out, {"type": "stop", "matched": t}
        if len(toks) >= context_len:
            return out, {"type": "length", "length": len(out)}


def spec(rid, ids, seed, **kw):
    return SeqSpec(rid=rid, group_rid=kw.pop("group", rid), index=kw.pop("index", 0), input_ids=list(ids),
                   params=SamplingParams(**kw), seed=seed, stream=False)


def make_core(**cfg):
    r = FakeRunner(cfg.pop("context_len", 64))
    return EngineCore(r, CoreConfig(**cfg), eos_token_ids=[EOS]), r


def run_to_end(core, max_steps=10_000):
    outs = {}
    for _ in range(max_steps):
        for seq, o in core.step():
            outs.setdefault(seq.rid, []).append((seq, o))
        if not core.has_work():
            break
    for seq, o in core.drain_outputs():
        outs.setdefault(seq.rid, []).append((seq, o))
    return outs


def final(outs, rid):
    seq, o = outs[rid][-1]
    assert o.finished
    return seq, o


def test_concurrent_requests_equal_isolated_reference():
    core, runner = make_core(max_running_requests=3)
    rng = random.Random(0)
    specs = []
    for i in range(7):
        ids = [rng.randrange(V - 1) for _ in range(rng.randint(1, 9))]
        specs.append(spec(f"r{i}", ids, seed=i, max_new_tokens=rng.randint(1, 12), temperature=[1.0, 0.7, 0.0][i % 3]))
    core.add(specs)
    outs = run_to_end(core)
    for s in specs:
        seq, o = final(outs, s.rid)
        ref_out, ref_reason = reference(s.input_ids, s.params, s.seed)
        assert seq.output_ids == ref_out and o.finish_reason == ref_reason
        assert len(seq.logprobs) == len(seq.output_ids)
        assert o.weight_version == "default"


def test_requests_join_the_running_batch_between_steps():
    core, runner = make_core(max_running_requests=8)
    core.add([spec("a", [1, 2, 3], 1, max_new_tokens=6, ignore_eos=True)])
    core.step()
    core.step()
    assert len(core.running) == 1
    core.add([spec("b", [4, 5], 2, max_new_tokens=3, ignore_eos=True)])
    core.step()
    assert {s.rid for s in core.running} == {"a", "b"}          # b joined while a runs
    outs = run_to_end(core)
    assert final(outs, "b")[0].output_ids == reference([4, 5], SamplingParams(max_new_tokens=3, ignore_eos=True), 2)[0]
    assert final(outs, "a")[0].output_ids == reference([1, 2, 3], SamplingParams(max_new_tokens=6, ignore_eos=True), 1)[0]


def test_prefix_cache_reuses_kv_of_a_previous_call_and_reports_cached_tokens():
    core, runner = make_core()
    p = dict(max_new_tokens=5, ignore_eos=True, temperature=0.0)
    core.add([spec("a", [1, 2, 3, 4, 5, 6], 0, **p)])
    first = final(run_to_end(core), "a")[0]
    assert first.cached_tokens == 0
    follow = [1, 2, 3, 4, 5, 6] + first.output_ids + [7, 8]       # the harness's next call
    before = runner.prefilled
    core.add([spec("b", follow, 0, **p)])
    seq, o = final(run_to_end(core), "b")
    assert o.cached_tokens == 6 + 5 - 1                             # last sampled token has no KV yet
    assert runner.prefilled - before == len(follow) - 1 - o.cached_tokens
    assert seq.output_ids == reference(follow, SamplingParams(**p), 0)[0]


def test_parallel_samples_share_the_prompt_prefill():
    core, runner = make_core()
    specs = [spec(f"g_{j}", list(range(10)), j, group="g", index=j, max_new_tokens=3, ignore_eos=True) for j in range(4)]
    core.add(specs)
    outs = run_to_end(core)
    assert runner.prefilled == 9
    assert [final(outs, s.rid)[1].cached_tokens for s in specs] == [0, 9, 9, 9]
    for s in specs:
        assert final(outs, s.rid)[0].output_ids == reference(s.input_ids, s.params, s.seed)[0]


def test_stop_conditions():
    core, _ = make_core(context_len=12)
    core.add([spec("len0", [1], 0, max_new_tokens=0)])
    assert core.drain_outputs()[0][1].finish_reason == {"type": "length", "length": 0}
    # find a seed whose greedy path hits some token, then use it as a stop token
    out, _ = reference([3, 4], SamplingParams(max_new_tokens=6, ignore_eos=True), 5)
    core.add([spec("stoptok", [3, 4], 5, max_new_tokens=6, stop_token_ids=[out[2]])])
    seq, o = final(run_to_end(core), "stoptok")
    k = out.index(out[2])
    if EOS not in out[:k + 1]:
        assert seq.output_ids == out[:k + 1] and o.finish_reason == {"type": "stop", "matched": out[2]}
    core.add([spec("ctx", [1] * 10, 1, max_new_tokens=50, ignore_eos=True)])
    seq, o = final(run_to_end(core), "ctx")
    assert len(seq.output_ids) == 2 and o.finish_reason == {"type": "length", "length": 2}


def test_min_new_tokens_masks_eos_and_ignore_eos():
    # a model that always prefers EOS
    core, runner = make_core()
    runner.decode_orig = runner.decode

    def eos_loving(tokens, positions):
        logits = runner.decode_orig(tokens, positions)
        logits[:, EOS] = 100.0
        return logits

    runner.decode = eos_loving
    core.add([spec("a", [1], 0, max_new_tokens=5, min_new_tokens=3, temperature=0.0),
              spec("b", [1], 0, max_new_tokens=4, ignore_eos=True, temperature=0.0)])
    outs = run_to_end(core)
    a, oa = final(outs, "a")
    assert EOS not in a.output_ids[:3] and a.output_ids[3] == EOS and oa.finish_reason == {"type": "stop", "matched": EOS}
    b, ob = final(outs, "b")
    assert b.output_ids == [EOS] * 4 and ob.finish_reason["type"] == "length"


def test_stop_strings_use_decoded_tail():
    r = FakeRunner()
    core = EngineCore(r, CoreConfig(), eos_token_ids=[EOS], decode_tail=lambda ids: "".join(chr(97 + t) for t in ids))
    out, _ = reference([1, 2], SamplingParams(max_new_tokens=8, ignore_eos=True), 3)
    target = "".join(chr(97 + t) for t in out[1:3])
    core.add([spec("s", [1, 2], 3, max_new_tokens=8, ignore_eos=True, stop=[target])])
    seq, o = final(run_to_end(core), "s")
    text = "".join(chr(97 + t) for t in seq.output_ids)
    assert target in text and target not in text[:-1]
    assert o.finish_reason == {"type": "stop", "matched": target}


def test_abort_running_and_waiting_and_unknown():
    core, _ = make_core(max_running_requests=1)
    core.add([spec("a", [1, 2], 0, max_new_tokens=50, ignore_eos=True), spec("b", [3], 1, max_new_tokens=5)])
    core.step()
    core.step()
    assert core.abort("a") == ["a"]
    outs = core.drain_outputs()
    assert outs[0][1].finish_reason["type"] == "abort" and len(outs[0][0].output_ids) == 2
    assert core.abort("zzz") == []
    assert core.abort("b") == ["b"]                               # b was still waiting
    assert core.drain_outputs()[0][1].finish_reason["type"] == "abort"
    assert not core.has_work() and not core.by_rid


def test_abort_by_group_rid_aborts_every_sample():
    core, _ = make_core()
    core.add([spec(f"g_{j}", [1], j, group="g", index=j, max_new_tokens=9, ignore_eos=True) for j in range(3)])
    core.step()
    assert sorted(core.abort("g")) == ["g_0", "g_1", "g_2"]


def test_duplicate_rid_rejected():
    core, _ = make_core()
    core.add([spec("a", [1], 0, max_new_tokens=5)])
    with pytest.raises(ProtocolError):
        core.add([spec("a", [1], 0)])
    with pytest.raises(ProtocolError):
        core.add([spec("x", [1], 0), spec("x", [2], 0)])


def test_pause_in_place_freezes_and_continue_resumes_identically():
    core, _ = make_core()
    s = spec("a", [1, 2, 3], 4, max_new_tokens=8, ignore_eos=True)
    core.add([s])
    core.step()
    core.pause("in_place")
    n = len(core.running[0].output_ids)
    assert not core.has_work() and core.step() == [] and len(core.running[0].output_ids) == n
    core.add([spec("b", [5], 1, max_new_tokens=2)])
    assert [x.rid for x in core.waiting] == ["b"]                # queued while paused
    core.continue_generation()
    outs = run_to_end(core)
    assert final(outs, "a")[0].output_ids == reference(s.input_ids, s.params, 4)[0]


def test_pause_retract_recomputes_from_cache_and_matches_reference():
    core, runner = make_core()
    s = spec("a", [1, 2, 3, 4], 4, max_new_tokens=8, ignore_eos=True)
    core.add([s])
    for _ in range(3):
        core.step()
    assert core.pause("retract") == ["a"]
    assert not core.running and core.waiting[0].rid == "a"
    runner.kv.clear()                                            # slot KV is gone; the prefix cache holds it
    before = runner.prefilled
    core.continue_generation()
    outs = run_to_end(core)
    assert runner.prefilled == before                            # fully served from the prefix cache
    assert final(outs, "a")[0].output_ids == reference(s.input_ids, s.params, 4)[0]


def test_pause_abort_aborts_all_and_queues_new_requests():
    core, _ = make_core()
    core.add([spec("a", [1], 0, max_new_tokens=9, ignore_eos=True)])
    core.step()
    assert core.pause("abort") == ["a"]
    assert core.drain_outputs()[0][1].finish_reason["type"] == "abort"
    core.add([spec("b", [2], 0, max_new_tokens=2)])
    assert core.step() == [] and core.waiting
    core.continue_generation()
    assert final(run_to_end(core), "b")


def test_weight_update_drains_in_flight_on_old_version_then_flushes():
    core, runner = make_core()
    old = spec("old", [1, 2, 3], 0, max_new_tokens=6, ignore_eos=True)
    core.add([old])
    core.step()
    assert core.begin_weight_update(abort=False) == []
    new = spec("new", [1, 2, 3], 0, max_new_tokens=6, ignore_eos=True)
    core.add([new])
    outs = {}
    while not core.ready_for_weight_update():
        for seq, o in core.step():
            outs.setdefault(seq.rid, []).append((seq, o))
    assert "new" not in outs and core.waiting[0].rid == "new"     # not admitted during the drain
    seq, o = final(outs, "old")
    assert o.weight_version == "default" and seq.output_ids == reference(old.input_ids, old.params, 0)[0]
    runner.salt = 1                                              # the swap
    core.finish_weight_update("v1")
    assert core.cache.total_tokens == 0
    seq, o = final(run_to_end(core), "new")
    assert o.weight_version == "v1" and o.cached_tokens == 0      # no stale KV reused
    assert seq.output_ids == reference(new.input_ids, new.params, 0, salt=1)[0]


def test_weight_update_with_abort_aborts_running_labelled_old_version():
    core, runner = make_core()
    core.add([spec("a", [1, 2], 0, max_new_tokens=9, ignore_eos=True)])
    core.step()
    core.add([spec("w", [4], 0, max_new_tokens=2)])               # waiting, not started: kept
    core.pause("in_place")
    core.continue_generation()
    assert core.begin_weight_update(abort=True) == ["a"]
    (seq, o), = core.drain_outputs()
    assert o.finish_reason["type"] == "abort" and o.weight_version == "default"
    assert core.ready_for_weight_update()
    runner.salt = 2
    core.finish_weight_update("v2")
    assert final(run_to_end(core), "w")[1].weight_version == "v2"


def test_update_while_paused_in_place_aborts_the_frozen_requests():
    core, _ = make_core()
    core.add([spec("a", [1, 2], 0, max_new_tokens=9, ignore_eos=True)])
    core.step()
    core.pause("in_place")
    assert core.begin_weight_update(abort=False) == ["a"] and core.ready_for_weight_update()


def test_release_requires_idle_and_blocks_admission():
    core, _ = make_core()
    core.add([spec("a", [1], 0, max_new_tokens=9, ignore_eos=True)])
    core.step()
    with pytest.raises(ProtocolError):
        core.release(["kv_cache"])
    core.pause("abort")
    core.continue_generation()
    core.release(["kv_cache", "weights"])
    core.add([spec("b", [1], 0, max_new_tokens=2)])
    assert not core.has_work()
    core.resume(["kv_cache", "weights"])
    assert final(run_to_end(core), "b")


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_interleavings_match_reference(data):
    """Random arrivals, shared prefixes, capacity limits and tiny prefill budgets."""
    core, _ = make_core(max_running_requests=data.draw(st.integers(1, 4)),
                        max_prefill_tokens=data.draw(st.integers(1, 8)),
                        prefix_cache_tokens=data.draw(st.sampled_from([0, 6, 1000])))
    base = data.draw(st.lists(st.integers(0, V - 2), min_size=1, max_size=6))
    pending = []
    for i in range(data.draw(st.integers(1, 6))):
        extra = data.draw(st.lists(st.integers(0, V - 2), max_size=5))
        p = SamplingParams(max_new_tokens=data.draw(st.integers(1, 7)),
                           temperature=data.draw(st.sampled_from([0.0, 1.0, 0.5])))
        pending.append((data.draw(st.integers(0, 6)), SeqSpec(rid=f"r{i}", group_rid=f"r{i}", index=0,
                                                               input_ids=base + extra, params=p, seed=i)))
    outs = {}
    step = 0
    while pending or core.has_work():
        for when, s in [x for x in pending if x[0] <= step]:
            core.add([s])
            pending.remove((when, s))
        for seq, o in core.step():
            outs.setdefault(seq.rid, []).append((seq, o))
        step += 1
        assert step < 500
    for seq, o in core.drain_outputs():
        outs.setdefault(seq.rid, []).append((seq, o))
    for rid, items in outs.items():
        seq, o = items[-1]
        ref_out, ref_reason = reference(seq.spec.input_ids, seq.params, seq.spec.seed)
        assert seq.output_ids == ref_out and o.finish_reason == ref_reason
