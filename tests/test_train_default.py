"""The training pipeline of the bundled model: corpus split, FIM layouts, LayerSkip weights, and a
quick end-to-end `completiond train-default` run with a tiny budget."""

from __future__ import annotations

import json
import random

import pytest

from completiond.models import corpus


def test_corpus_split_is_deterministic_and_disjoint():
    tr, ho = corpus.training_files(), corpus.heldout_files()
    assert tr and ho
    assert [f.relpath for f in tr] == sorted(f.relpath for f in tr)
    assert not {f.relpath for f in tr} & {f.relpath for f in ho}
    assert all(corpus.is_heldout(f.relpath) for f in ho)
    assert not any(corpus.is_heldout(f.relpath) for f in tr)
    share = len(ho) / (len(tr) + len(ho))
    assert 0.02 < share < 0.10
    assert all("site-packages" not in f.relpath.split("/") for f in tr + ho)
    # the split depends on the path only
    assert corpus.is_heldout("json/decoder.py") == corpus.is_heldout("json/decoder.py")


def test_layer_weights_increase_with_depth_and_normalize():
    from completiond.models.train_default import layer_weights

    w = layer_weights(10, 0.1)
    assert len(w) == 10
    assert sum(w) == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(w, w[1:]))
    assert w[-1] == max(w)


@pytest.fixture(scope="module")
def small_data():
    from completiond.models import tokenizer_build
    from completiond.models.train_default import Data

    files = corpus.training_files()[:20]
    tok = tokenizer_build.train_tokenizer((f.read_text() for f in files), vocab_size=400)
    return tok, Data(tok, files, seq_len=128, fim_rate=1.0, spm_rate=0.5, rng=random.Random(0))


def test_fim_layouts(small_data):
    tok, data = small_data
    prefix, middle, suffix = "def f(x):\n    ", "return x + 1", "\n\n\nprint(f(2))\n"
    psm = tok.decode(data.fim_layout(prefix, middle, suffix, spm=False))
    spm = tok.decode(data.fim_layout(prefix, middle, suffix, spm=True))
    assert psm == f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>{middle}<|endoftext|>"
    assert spm == f"<|fim_prefix|><|fim_suffix|>{suffix}<|fim_middle|>{prefix}{middle}<|endoftext|>"


def test_fim_samples_have_one_sentinel_each_in_psm_or_spm_order(small_data):
    tok, data = small_data
    seen = {"spm": 0, "psm": 0}
    pad = data.ids["<|fim_pad|>"]
    for _ in range(40):
        x, y = data.batch(1)
        ids = x[0].tolist() + [y[0, -1].item()]
        ids = [i for i in ids if i not in (pad, -100)]
        text = tok.decode(ids)
        assert text.startswith("<|fim_prefix|>")
        for sentinel in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"):
            assert text.count(sentinel) == 1
        if text.startswith("<|fim_prefix|><|fim_suffix|>"):
            seen["spm"] += 1
        else:
            seen["psm"] += 1
            assert text.index("<|fim_suffix|>") < text.index("<|fim_middle|>")
        # labels are the inputs shifted by one; padding is masked out of the loss
        assert ((y[0, :-1] == x[0, 1:]) | (y[0, :-1] == -100)).all()
        assert not (y[0] == pad).any()
    assert seen["spm"] > 5 and seen["psm"] > 5


def test_custom_forward_matches_transformers(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from completiond.models.train_default import forward_all_exits

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    x = torch.randint(0, model.config.vocab_size, (2, 17))
    with torch.no_grad():
        ref = model(x).logits
        ours, exits = forward_all_exits(model, x, None, slice(None))
    assert torch.allclose(ref, ours, atol=1e-5)
    assert len(exits) == model.config.num_hidden_layers - 1


@pytest.mark.slow
def test_quick_train_default_run(tmp_path):
    """`completiond train-default` end to end with a tiny config on a slice of the data."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from completiond import cli

    out = tmp_path / "mini"
    rc = cli.main(["train-default", "--out", str(out), "--minutes", "0.5", "--max-steps", "12", "--layers", "2",
                   "--hidden", "64", "--heads", "2", "--kv-heads", "2", "--intermediate", "128", "--vocab", "512",
                   "--max-files", "20", "--seq-len", "128", "--batch-size", "4", "--log-every", "4",
                   "--eval-every", "8", "--no-progress"])
    assert rc == 0
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "completiond.json", "train_log.jsonl", "training_summary.json"):
        assert (out / name).is_file(), name
    assert not (tmp_path / "mini.training").exists()
    meta = json.loads((out / "completiond.json").read_text())
    assert meta["train_context"] == 128
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps"] == 12 and summary["tokens_seen"] > 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(log[0]["exit_losses"]) == 2
    assert any("heldout_exit_losses" in r for r in log)
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.num_hidden_layers == 2 and model.config.tie_word_embeddings
    assert tok.eos_token == "<|endoftext|>" and model.config.eos_token_id == tok.eos_token_id
    with torch.no_grad():
        logits = model(torch.tensor([tok("def f():\n    return 1\n")["input_ids"]])).logits
    assert torch.isfinite(logits).all()

    # a continuation stage (--init-from): same tokenizer and architecture, cumulative steps and log
    out2 = tmp_path / "mini2"
    rc = cli.main(["train-default", "--out", str(out2), "--init-from", str(out), "--minutes", "0.5", "--max-steps",
                   "4", "--max-files", "20", "--seq-len", "128", "--batch-size", "4", "--log-every", "4",
                   "--eval-every", "0", "--warmup", "2", "--no-progress"])
    assert rc == 0
    s2 = json.loads((out2 / "training_summary.json").read_text())
    assert s2["steps"] == 16 and [s["stage"] for s in s2["stages"]] == [1, 2]
    assert AutoTokenizer.from_pretrained(out2).get_vocab() == tok.get_vocab()
    log2 = [json.loads(line) for line in (out2 / "train_log.jsonl").read_text().splitlines()]
    assert log2[-1]["step"] == 16 and log2[-1]["stage"] == 2
