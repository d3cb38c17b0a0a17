"""HF model behind slot KV storage (gyre/rollout/embedded/model_runner.py) vs plain full forwards."""

import pytest
import torch

from gyre.embedded_model import load_hf_model
from gyre.rollout.embedded.model_runner import HFModelRunner, WeightError, read_weights


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    torch.set_num_threads(1)
    return load_hf_model(tiny_model_dir)


@pytest.fixture()
def runner(tiny_model_dir):
    return HFModelRunner(load_hf_model(tiny_model_dir), source_dir=tiny_model_dir, initial_capacity=8, max_slots=4)


def full_next_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)[None]).logits[0, -1].float()


def test_padded_decode_with_cached_prefixes_equals_full_forward(runner, ref):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in (7, 20, 2, 13)]
    seqs[3][:7] = seqs[0]                                    # shares a 7-token prefix with seq 0
    runner.prefill(0, seqs[0][:-1], 0)
    runner.prefill(1, seqs[1][:5], 0)                        # two prefill calls for one slot
    runner.prefill(1, seqs[1][5:-1], 5)
    runner.prefill(2, seqs[2][:-1], 0)
    runner.write_kv(3, 0, [runner.read_kv(0, 0, 3), runner.read_kv(0, 3, 6)])   # reuse KV of seq 0
    runner.prefill(3, seqs[3][6:-1], 6)
    logits = runner.decode([s[-1] for s in seqs], [len(s) - 1 for s in seqs])
    assert logits.shape == (4, runner.vocab_size) and logits.dtype == torch.float32
    for b, s in enumerate(seqs):
        assert torch.allclose(logits[b], full_next_logits(ref, s), atol=1e-4, rtol=0)
    # the KV store grew past its initial capacity of 8 columns and keeps decoding correctly
    nxt = logits.argmax(-1).tolist()
    logits2 = runner.decode(nxt, [len(s) for s in seqs])
    for b, s in enumerate(seqs):
        assert torch.allclose(logits2[b], full_next_logits(ref, s + [nxt[b]]), atol=1e-4, rtol=0)


def test_chunked_prefill_and_slot_move(tiny_model_dir, ref):
    r = HFModelRunner(load_hf_model(tiny_model_dir), source_dir=tiny_model_dir, prefill_chunk_tokens=3)
    ids = list(range(100, 111))
    r.prefill(2, ids[:-1], 0)
    r.move_slot(2, 0, len(ids) - 1)
    logits = r.decode([ids[-1]], [len(ids) - 1])
    assert torch.allclose(logits[0], full_next_logits(ref, ids), atol=1e-4, rtol=0)
    assert r.slice_kv(r.read_kv(0, 0, 10), 2, 5).shape[3] == 3


def test_weight_checks(runner):
    specs = runner.param_specs()
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(WeightError, match="unknown"):
        runner.check_weights({"nope": torch.zeros(1)}, require_all=False)
    with pytest.raises(WeightError, match="shape"):
        runner.check_weights({name: torch.zeros(3, 3)}, require_all=False)
    with pytest.raises(WeightError, match="floating"):
        runner.check_weights({name: torch.zeros(specs[name][0], dtype=torch.long)}, require_all=False)
    with pytest.raises(WeightError, match="missing"):
        runner.check_weights({name: torch.zeros(specs[name][0])}, require_all=True)
    runner.check_weights(runner.state_dict(), require_all=True)   # tied lm_head needs no own tensor
    with pytest.raises(WeightError):
        read_weights("/nonexistent/dir")


def test_load_release_resume_weights_bit_identical(runner, tiny_model_dir):
    ids = [5, 6, 7]
    runner.prefill(0, ids[:-1], 0)
    base = runner.decode([ids[-1]], [2]).clone()
    # clean weights: release frees storage, resume reloads from the model directory
    runner.release_weights()
    assert runner._params["model.embed_tokens.weight"].numel() == 0
    with pytest.raises(WeightError, match="released"):
        runner.load_weights({}, source_dir=None)
    runner.resume_weights()
    runner.prefill(0, ids[:-1], 0)
    assert torch.equal(runner.decode([ids[-1]], [2]), base)
    # changed weights: release spills them, resume restores the changed values
    name = "model.layers.1.self_attn.o_proj.weight"
    runner.load_weights({name: torch.randn(runner.param_specs()[name][0], generator=torch.Generator().manual_seed(1))})
    runner.prefill(0, ids[:-1], 0)
    changed = runner.decode([ids[-1]], [2]).clone()
    assert not torch.allclose(changed, base)
    runner.release_weights()
    runner.release_kv()
    runner.resume_weights()
    runner.prefill(0, ids[:-1], 0)
    assert torch.equal(runner.decode([ids[-1]], [2]), changed)
    # a full load from disk makes the directory the source again
    runner.load_weights(read_weights(tiny_model_dir), source_dir=str(tiny_model_dir))
    runner.prefill(0, ids[:-1], 0)
    assert torch.equal(runner.decode([ids[-1]], [2]), base)


def test_release_survives_a_deleted_update_directory(runner, tmp_path):
    from gyre.rollout.weights import save_weights_for_disk_update

    sd = runner.state_dict()
    name = "model.norm.weight"
    sd[name] = sd[name] * 2
    d = save_weights_for_disk_update(sd, tmp_path / "v1")
    runner.load_weights(read_weights(d), source_dir=str(d))
    runner.prefill(0, [1, 2], 0)
    want = runner.decode([3], [2]).clone()
    runner.release_weights()
    for f in d.iterdir():
        f.unlink()
    d.rmdir()                                                  # the publisher cleaned up
    runner.resume_weights()
    runner.prefill(0, [1, 2], 0)
    assert torch.equal(runner.decode([3], [2]), want)
