"""The repository-context training stage (`completiond train-context`): its samples are the daemon's own
prompts (retrieval and layout) followed by the missing middle, built offline from local archives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from completiond.models import default_model_dir
from tests.test_train_default import _wheel

UTIL = '''def clamp_between(value, lowest, highest):
    """value moved into [lowest, highest]."""
    if value < lowest:
        return lowest
    if value > highest:
        return highest
    return value


def chunked(items, size):
    for start in range(0, len(items), size):
        yield items[start:start + size]
'''

USER = '''from .util import clamp_between


class Gauge:
    def __init__(self, lowest, highest):
        self.lowest = lowest
        self.highest = highest
        self.value = lowest

    def set(self, value):
        self.value = clamp_between(value, self.lowest, self.highest)
        return self.value
'''


@pytest.fixture()
def archives(tmp_path):
    dl = tmp_path / "downloads"
    dl.mkdir()
    found = {
        "gauge": _wheel(dl, "gauge", "1.0", "License-Expression: MIT",
                        {"gauge/util.py": UTIL, "gauge/user.py": USER, "gauge/_vendor/x.py": "X = 1\n" * 80}),
        "held": _wheel(dl, "held", "1.0", "License-Expression: MIT", {"held/a.py": UTIL}),
        "gpl": _wheel(dl, "gpl", "1.0", "License-Expression: GPL-3.0-only", {"gpl/a.py": UTIL}),
    }
    listed = [("gauge", "MIT"), ("held", "MIT"), ("gpl", "GPL")]
    plist = tmp_path / "packages.txt"
    plist.write_text("".join(f"{n} {lic}\n" for n, lic in listed))
    return found, listed, plist, dl


def test_extract_keeps_admitted_training_packages_only(archives, tmp_path):
    from completiond.commands.train_context import extract

    found, listed, _, _ = archives
    roots = extract(found, listed, tmp_path / "src", heldout=("held",), log=lambda s: None)
    assert [r.name for r in roots] == ["gauge"]
    files = sorted(p.relative_to(roots[0]).as_posix() for p in roots[0].rglob("*.py"))
    assert files == ["gauge/user.py", "gauge/util.py"]   # the vendored copy is filtered as in the base run
    assert (roots[0] / "gauge" / "util.py").read_text() == UTIL


def test_a_retrieval_sample_is_the_daemons_prompt_then_the_middle(archives, tmp_path, monkeypatch):
    from completiond.completion.workspace import Workspace
    from completiond.commands import train_context as tc

    found, listed, _, _ = archives
    roots = tc.extract(found, listed, tmp_path / "src", heldout=("held",), log=lambda s: None)
    sampler = tc.ContextSampler(roots, default_model_dir(), 512, seed=1)
    user = roots[0] / "gauge" / "user.py"
    sampler.files = [(roots[0], user)]
    cut = USER.index("clamp_between(value, self")
    end = USER.index("\n", cut)
    monkeypatch.setattr(tc, "fim_split", lambda text, rng, share: (text[:cut], text[cut:end], text[end:]))
    seq = sampler._fim(with_context=True)

    doc = USER[:cut] + USER[end:]
    ws = Workspace([roots[0]], scan=False)
    ws.scan()
    ws.did_open(user, doc, "python")
    b = sampler.builder
    pb, sb, _ = b.budgets(True)
    context = ws.context(user, "python", b.context_tokens, lambda s: len(b.template.encode(s)), text=doc,
                         offset=cut, mode="retrieval", window_tokens=(pb, sb))
    assert any("def clamp_between" in snippet for _, snippet in context), context   # the definition is retrieved
    prompt = b.build(doc, cut, context=context, path="gauge/user.py", language="python", heal=False)
    middle = sampler.tok.encode(USER[cut:end], add_special_tokens=False)
    assert seq == list(prompt.ids) + middle + [sampler.eot]
    assert "def clamp_between" in sampler.tok.decode(prompt.context_ids)

    # without context: the same cursor, no block
    plain = sampler._fim(with_context=False)
    assert plain == list(b.build(doc, cut, context=[], path="gauge/user.py", language="python",
                                 heal=False).ids) + middle + [sampler.eot]
    assert len(plain) < len(seq)


def test_batches_mask_padding_and_resume_draws_the_same_samples(archives, tmp_path):
    from completiond.commands import train_context as tc

    found, listed, _, _ = archives
    roots = tc.extract(found, listed, tmp_path / "src", heldout=("held",), log=lambda s: None)
    a = tc.ContextSampler(roots, default_model_dir(), 256, seed=5)
    x, y = a.batch(4)
    assert x.shape == y.shape == (4, 256)
    pad = x == a.pad
    assert bool((y[:, :-1][pad[:, 1:]] == -100).all())   # a padded position is never a target
    assert int((y != -100).sum()) > 0
    state = a.state()
    nxt = [a.sample() for _ in range(6)]
    b = tc.ContextSampler(roots, default_model_dir(), 256, seed=99)
    b.load_state(state)
    assert [b.sample() for _ in range(6)] == nxt


def test_train_then_export_offline(archives, tmp_path):
    from transformers import AutoModelForCausalLM

    from completiond.commands import train_context as tc

    _, _, plist, dl = archives
    run = tmp_path / "run"
    out = tmp_path / "model"
    args = ["--run-dir", str(run), "--downloads", str(dl), "--packages", str(plist), "--steps", "2",
            "--seq-len", "128", "--batch-size", "2", "--threads", "1"]
    assert tc.main(args) == 0
    assert (run / "ckpt.pt").is_file()
    assert tc.main(["--run-dir", str(run), "--export", "--out", str(out)]) == 0
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["context_stage"]["steps"] == 2
    from completiond.models.training import model_card
    card = model_card._context_stage_md(summary)
    assert "Repository context" in card and "2 steps" in card and "retrieval 50%" in card
    assert model_card._context_stage_md(json.loads((default_model_dir() / "training_summary.json").read_text())) == ""
    # a second run resumes from the checkpoint (read with weights_only=True) and goes on to the new total
    assert tc.main(args[:args.index("--steps")] + ["--steps", "3"] + args[args.index("--steps") + 2:]) == 0
    assert tc.main(["--run-dir", str(run), "--export", "--out", str(out)]) == 0
    assert json.loads((out / "training_summary.json").read_text())["context_stage"]["steps"] == 3
    assert summary["parameters"] == json.loads((default_model_dir() / "training_summary.json").read_text())["parameters"]
    model = AutoModelForCausalLM.from_pretrained(str(out))
    base = AutoModelForCausalLM.from_pretrained(str(default_model_dir()))
    changed = [n for (n, p), (_, q) in zip(model.named_parameters(), base.named_parameters()) if not p.equal(q)]
    assert changed   # two steps moved the weights


def test_the_run_directory_must_be_outside_the_checkout(tmp_path):
    from completiond.commands import train_context as tc

    root = Path(__file__).resolve().parents[1]
    assert tc.main(["--run-dir", str(root / "runs-inside"), "--steps", "1"]) == 2
    assert not (root / "runs-inside").exists()


def test_context_free_samples_also_draw_from_the_extra_files(archives, tmp_path):
    from completiond.commands import train_context as tc

    found, listed, _, _ = archives
    roots = tc.extract(found, listed, tmp_path / "src", heldout=("held",), log=lambda s: None)
    lib = tmp_path / "stdlib"
    lib.mkdir()
    marker = "def only_in_the_extra_files(argument):\n    return argument * 2\n" * 6
    (lib / "extra.py").write_text(marker)
    s = tc.ContextSampler(roots, default_model_dir(), 256, seed=2, extra_files=[(lib, lib / "extra.py")])
    text = lambda seq: s.tok.decode(seq)  # noqa: E731
    plain = [text(s._plain()) for _ in range(40)]
    free = [text(s._fim(with_context=False) or []) for _ in range(40)]
    with_context = [text(s._fim(with_context=True) or []) for _ in range(20)]
    assert any("only_in_the_extra_files" in t for t in plain)
    assert any("only_in_the_extra_files" in t for t in free)
    assert not any("only_in_the_extra_files" in t for t in with_context)   # retrieval needs a package


def test_shares_are_checked():
    import argparse

    from completiond.commands import train_context as tc

    assert tc._shares("retrieval=1,none=0") == {"retrieval": 1.0, "none": 0.0}
    for bad in ("retrieval", "retrieval=x", "other=1", "none=0", "plain=-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            tc._shares(bad)
