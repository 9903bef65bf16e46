"""engine/tokenizer.py: the tokenizer without transformers stands in only where a check has shown that it acts
as AutoTokenizer's; a daemon process on engine/checkpoint.py then never imports transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from completiond.engine import tokenizer as light_mod
from completiond.engine import tokenizer_check
from completiond.engine.hub import read_json
from completiond.models import default_model_dir
from completiond.models.tiny import make_tiny_model
from tests.test_checkpoint_reader import FAMILIES
from tests.test_native_step import _need_native

TEXTS = ["def f(x):\n    return x  # ünïcode\t<|fim_prefix|>", "\n\n        y = 1\r\n", "日本 🙂 don't , .", ""]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A verdict cache of the test's own; the check runs in this process (transformers is loaded here anyway:
    the child process it stands for is tested once, below); transformers counts as not loaded."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(light_mod, "transformers_loaded", lambda: False)
    runs = []

    def in_process(directory, key):
        runs.append(directory)
        tokenizer_check.check(directory)
        return light_mod.read_verdict(key)

    monkeypatch.setattr(light_mod, "_run_check", in_process)
    return runs


def _bundled_copy(tmp_path, model_type=None):
    d = tmp_path / "bundled"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(default_model_dir() / name, d / name)
    if model_type:
        raw = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**raw, "model_type": model_type}))
    return d


def _same(ours, theirs):
    for text in TEXTS:
        assert ours(text).input_ids == list(theirs(text)["input_ids"])
        ids = theirs.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert ours.encode(text, add_special_tokens=False, split_special_tokens=True) == ids
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids)
    assert (ours.eos_token_id, ours.bos_token_id, ours.unk_token_id, len(ours)) == \
        (theirs.eos_token_id, theirs.bos_token_id, theirs.unk_token_id, len(theirs))
    assert ours.get_vocab() == theirs.get_vocab()
    ids = list(range(len(theirs)))
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert [ours.decode([i]) for i in ids] == [theirs.decode([i]) for i in ids]
    # what the completion layer reads besides: healing's byte table, the FIM template's choice and ids
    from completiond.completion.healing import TokenBytes
    from completiond.models.fim import make_template

    assert sorted(ours.all_special_ids) == sorted(theirs.all_special_ids)
    assert TokenBytes(ours).table == TokenBytes(theirs).table
    mine, ref = make_template(ours, "auto"), make_template(theirs, "auto")
    assert (type(mine), vars(mine).keys()) == (type(ref), vars(ref).keys())
    assert {k: v for k, v in vars(mine).items() if k != "tokenizer"} == \
        {k: v for k, v in vars(ref).items() if k != "tokenizer"}


def test_the_bundled_tokenizer_stands_in_and_acts_as_autotokenizer(tmp_path, cache):
    d = _bundled_copy(tmp_path)
    raw = read_json(d / "config.json")
    ours = light_mod.load_tokenizer(d, raw, False)
    assert isinstance(ours, light_mod.LightTokenizer)
    _same(ours, light_mod.auto_tokenizer(d, raw, False))
    assert ours.convert_tokens_to_ids("<|fim_middle|>") == ours.get_vocab()["<|fim_middle|>"]
    assert ours.convert_tokens_to_ids("<|no such token|>") == ours.unk_token_id
    assert ours.decode(ours.get_vocab()["<|fim_middle|>"]) == "<|fim_middle|>"
    assert light_mod.describe(ours) == \
        "tokenizers alone (tokenizer.json, checked to act as transformers' TokenizersBackend)"
    assert light_mod.describe(light_mod.auto_tokenizer(d, raw, False)) == "transformers (TokenizersBackend)"


def test_status_names_the_tokenizer(tmp_path):
    from completiond.commands.status import describe

    status = {"state": "ready", "pid": 1, "model": "m", "device": "cpu", "uptime_s": 1.0,
              "tokenizer": "tokenizers alone (tokenizer.json, checked to act as transformers' Qwen2Tokenizer)"}
    stats = {"status": status, "requests": 0, "completed": 0, "superseded": 0, "cancelled": 0, "errors": 0}
    assert f"  tokens   {status['tokenizer']}" in describe(stats, tmp_path)


def test_a_class_that_rebuilds_the_pipeline_keeps_autotokenizer(tmp_path, cache):
    """Qwen2Tokenizer lays Qwen's split over any vocabulary: the bundled tokenizer.json read alone splits
    indentation otherwise, so the check must find that, and the load must give transformers' tokenizer."""
    d = _bundled_copy(tmp_path, model_type="qwen2")
    raw = read_json(d / "config.json")
    ours = light_mod.load_tokenizer(d, raw, False)
    assert not isinstance(ours, light_mod.LightTokenizer)
    verdict = light_mod.read_verdict(light_mod.verdict_key(d, raw))
    assert verdict["same"] is False and verdict["tokenizer_class"] == "Qwen2Tokenizer"
    assert any("tokenizer(" in diff or "encode(" in diff for diff in verdict["differences"])
    # what transformers' class saves describes what it does: that tokenizer.json stands in
    light_mod.auto_tokenizer(d, raw, False).save_pretrained(str(d))
    again = light_mod.load_tokenizer(d, raw, False)
    assert isinstance(again, light_mod.LightTokenizer)
    _same(again, light_mod.auto_tokenizer(d, raw, False))


# tokenizer classes a tokenizer_config.json may declare (None: none declared)
DECLARED = [None, "TokenizersBackend", "PreTrainedTokenizerFast", "Qwen2Tokenizer", "LlamaTokenizerFast",
            "GPT2TokenizerFast"]


def _declaring(tmp_path, fam, declared):
    """A tiny model of family fam whose tokenizer_config.json declares the class declared; (directory, config)."""
    d = make_tiny_model(tmp_path / "m", family=fam, layers=1, tokenizer=FAMILIES[fam] or None)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.pop("tokenizer_class", None)
    if declared:
        tc["tokenizer_class"] = declared
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    return d, json.loads((d / "config.json").read_text())


@pytest.mark.parametrize("fam", sorted(FAMILIES))
@pytest.mark.parametrize("declared", DECLARED)
def test_the_tokenizer_is_the_one_autotokenizer_picks(tmp_path, fam, declared):
    """auto_tokenizer tells AutoTokenizer the model type without loading a config class: the same class."""
    from transformers import AutoTokenizer

    d, raw = _declaring(tmp_path, fam, declared)
    ours, theirs = light_mod.auto_tokenizer(d, raw, False), AutoTokenizer.from_pretrained(d)
    assert type(ours) is type(theirs)
    text = "def f(x):\n    return x  # ünïcode\t<|fim_prefix|>"
    assert ours(text).input_ids == theirs(text).input_ids
    assert ours.decode(ours(text).input_ids) == theirs.decode(theirs(text).input_ids)
    assert (ours.eos_token_id, ours.unk_token_id, ours.all_special_ids) == \
        (theirs.eos_token_id, theirs.unk_token_id, theirs.all_special_ids)
    assert ours.get_vocab() == theirs.get_vocab()


@pytest.mark.parametrize("fam", sorted(FAMILIES))
@pytest.mark.parametrize("declared", DECLARED)
def test_whatever_the_load_returns_acts_as_autotokenizer(tmp_path, cache, fam, declared):
    from transformers import AutoTokenizer

    d, raw = _declaring(tmp_path, fam, declared)
    ours = light_mod.load_tokenizer(d, raw, False)
    _same(ours, AutoTokenizer.from_pretrained(d))
    verdict = light_mod.read_verdict(light_mod.verdict_key(d, raw))
    assert isinstance(ours, light_mod.LightTokenizer) == verdict["same"]
    if fam == "llama" and declared in (None, "TokenizersBackend", "PreTrainedTokenizerFast"):
        assert verdict["same"], verdict   # the generic classes run tokenizer.json as it is: nothing may refuse them


def test_a_verdict_is_reused_and_changed_files_are_checked_again(tmp_path, cache):
    d = _bundled_copy(tmp_path)
    raw = read_json(d / "config.json")
    assert isinstance(light_mod.load_tokenizer(d, raw, False), light_mod.LightTokenizer)
    assert isinstance(light_mod.load_tokenizer(d, raw, False), light_mod.LightTokenizer)
    assert len(cache) == 1
    key = light_mod.verdict_key(d, raw)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tc, "clean_up_tokenization_spaces": True}))
    assert light_mod.verdict_key(d, raw) != key
    ours = light_mod.load_tokenizer(d, raw, False)
    assert len(cache) == 2 and isinstance(ours, light_mod.LightTokenizer)
    # transformers 5 skips the clean-up for a BPE model whatever the file says: the verdict follows what it does
    theirs = light_mod.auto_tokenizer(d, raw, False)
    assert theirs.clean_up_tokenization_spaces and not ours.clean_up_tokenization_spaces
    _same(ours, theirs)
    assert ours.decode(ours.encode("a , b .", add_special_tokens=False)) == "a , b ."
    assert light_mod.verdict_key(d, {**raw, "model_type": "qwen2"}) != light_mod.verdict_key(d, raw)


def test_the_space_clean_up_is_transformers_own():
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    for text in ("a , b . c ? d ! e ' f", "I 'm you 're we 've it 's don n't", "  x  ,  y  ", "no change"):
        assert light_mod.clean_up_spaces(text) == PreTrainedTokenizerBase.clean_up_tokenization(None, text)


def test_a_damaged_or_foreign_verdict_is_checked_again(tmp_path, cache, caplog):
    d = _bundled_copy(tmp_path)
    raw = read_json(d / "config.json")
    key = light_mod.verdict_key(d, raw)
    path = light_mod.cache_dir() / f"{key}.json"
    path.parent.mkdir(parents=True)
    for bad in (b"{not json", json.dumps({"key": "other", "same": True}).encode(),
                json.dumps({"key": key, "same": True, "clean_up_tokenization_spaces": False,
                            "eos_token_id": "0"}).encode(), b"\xff\xfe"):
        path.write_bytes(bad)
        assert isinstance(light_mod.load_tokenizer(d, raw, False), light_mod.LightTokenizer)
        assert "ignoring the tokenizer verdict" in caplog.text
        caplog.clear()
    assert len(cache) == 4


def test_a_failed_or_hung_check_leaves_the_load_to_transformers(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(light_mod, "transformers_loaded", lambda: False)
    d = _bundled_copy(tmp_path)
    raw = read_json(d / "config.json")
    for outcome in (subprocess.CompletedProcess([], 1, "", "Traceback: boom"),
                    subprocess.TimeoutExpired(["python"], light_mod.CHECK_TIMEOUT_S), OSError("no python")):
        def run(*a, outcome=outcome, **k):
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        monkeypatch.setattr(light_mod.subprocess, "run", run)
        assert not isinstance(light_mod.load_tokenizer(d, raw, False), light_mod.LightTokenizer)
        assert "tokenizer through transformers: the check" in caplog.text
        caplog.clear()
    assert not light_mod.cache_dir().exists() or not list(light_mod.cache_dir().iterdir())


def test_the_environment_can_insist_on_transformers(tmp_path, cache, monkeypatch, caplog):
    d = _bundled_copy(tmp_path)
    raw = read_json(d / "config.json")
    monkeypatch.setenv("COMPLETIOND_TOKENIZER", "transformers")
    assert light_mod.describe(light_mod.load_tokenizer(d, raw, False)) == "transformers (TokenizersBackend)"
    assert cache == []
    monkeypatch.setenv("COMPLETIOND_TOKENIZER", "tokenizers")   # not a value: reported, auto used
    assert isinstance(light_mod.load_tokenizer(d, raw, False), light_mod.LightTokenizer)
    assert "neither auto nor transformers" in caplog.text


def test_remote_code_or_no_tokenizer_json_is_never_checked(tmp_path, cache):
    d = _bundled_copy(tmp_path)
    raw = read_json(d / "config.json")
    assert light_mod.light_tokenizer(d, raw, True) is None
    assert light_mod.light_tokenizer(d, {**raw, "auto_map": {"AutoTokenizer": "x.Y"}}, False) is None
    tc = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tc, "auto_map": {"AutoTokenizer": ["x.Y", None]}}))
    assert light_mod.light_tokenizer(d, raw, False) is None
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "tokenizer.json").unlink()
    assert light_mod.light_tokenizer(d, raw, False) is None
    assert cache == []


def test_a_daemon_process_loads_models_without_importing_transformers(tmp_path, monkeypatch):
    """The point of it all: a fresh process (as the daemon is) checks once in a child, then reads the
    tokenizer and the checkpoint, and decodes, with transformers never imported: the bundled model (small,
    read in float32; its verdict checked here beforehand, which costs this process no import) and a bf16
    checkpoint the native step packs layer by layer (checked by the child)."""
    _need_native()
    d = make_tiny_model(tmp_path / "m", family="llama", layers=2, dtype="bfloat16")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert tokenizer_check.check(default_model_dir())["same"]
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    code = ("import sys; from completiond.engine import forward, checkpoint, tokenizer; "
            "from completiond.engine.engine import Engine, SamplingParams\n"
            "def run(model):\n"
            "    e = Engine.load(model, device='cpu'); assert isinstance(e.model, checkpoint.CausalLM)\n"
            "    out = e.generate(e.tokenizer('def f(x):\\n    return').input_ids, SamplingParams(max_tokens=4))\n"
            "    return e.tokenizer_in_use().split(' (')[0], e.fwd.released, 0 < len(out.tokens) <= 4\n"
            "bundled = run(None); forward.TRANSPOSED_COPY_LIMIT = 0; large = run(sys.argv[1])\n"
            "print(bundled, large, sorted(m for m in sys.modules if m.startswith('transformers'))[:3])")
    for _ in range(2):   # the first start runs the tiny model's check, the second reads its verdict
        done = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == \
            "('tokenizers alone', False, True) ('tokenizers alone', True, True) []"
    assert len(list((tmp_path / "cache" / "completiond" / "tokenizers").glob("*.json"))) == 2


def test_a_model_loaded_through_transformers_keeps_its_tokenizer_and_runs_no_check(cache, tmp_path):
    """A model read by transformers' classes (reader "transformers", or one engine/checkpoint.py cannot read):
    importing transformers is paid anyway, so no check runs and AutoTokenizer's tokenizer serves."""
    from completiond.engine.engine import Engine

    engine = Engine.load(None, device="cpu", reader="transformers")
    assert engine.tokenizer_in_use() == "transformers (TokenizersBackend)"
    assert cache == [] and not (tmp_path / "cache" / "completiond" / "tokenizers").exists()
    # the same model read here takes the light tokenizer, once checked
    assert Engine.load(None, device="cpu").tokenizer_in_use().startswith("tokenizers alone") and len(cache) == 1


def test_the_split_mode_is_set_and_used_under_one_lock(tmp_path):
    """encode_special_tokens is state on the shared Rust tokenizer: the daemon's threads (requests, token
    counting for context) must each get the mode they asked for, so setting it and encoding are one critical
    section. (CPython rarely switches threads between the two, so a stress test would not catch its loss.)"""
    import threading

    d = _bundled_copy(tmp_path)
    tok = light_mod.LightTokenizer(d / "tokenizer.json", {}, False)
    text = "x <|fim_prefix|> y"
    whole = tok.encode(text, add_special_tokens=False)
    split = tok.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert whole != split
    out = []
    with tok._lock:   # another thread mid-encode
        t = threading.Thread(target=lambda: out.append(tok.encode(text, add_special_tokens=False,
                                                                   split_special_tokens=True)))
        t.start()
        t.join(0.3)
        assert t.is_alive() and out == []   # it waits: it neither set the mode nor encoded yet
    t.join(10)
    assert out == [split]
    assert tok.encode(text, add_special_tokens=False) == whole   # the default mode is back


def test_suggestions_are_the_same_with_either_tokenizer(tmp_path, cache, monkeypatch):
    """Through the whole completion pipeline (prompt and FIM layout, token healing, stop rules, the
    speculative engine) a large bf16 checkpoint suggests the same text, token for token, whichever tokenizer
    the load took."""
    import torch

    from completiond import config
    from completiond.completion.completer import suggest
    from completiond.completion.suggest import LocalCompleter
    from completiond.engine import forward
    from completiond.engine.cancel import CancelToken
    from completiond.engine.engine import Engine

    _need_native()
    monkeypatch.setattr(forward, "TRANSPOSED_COPY_LIMIT", 0)   # "large": read by checkpoint.py, packed
    d = make_tiny_model(tmp_path / "m", family="qwen2", layers=3, seed=11, peaked=True, dtype="bfloat16",
                        tokenizer=FAMILIES["qwen2"])
    # as Qwen2Tokenizer saves it: the file then states what the class does, and the check passes
    light_mod.auto_tokenizer(d, read_json(d / "config.json"), False).save_pretrained(str(d))
    light = Engine.load(str(d), device="cpu")
    monkeypatch.setenv("COMPLETIOND_TOKENIZER", "transformers")
    auto = Engine.load(str(d), device="cpu")
    assert light.tokenizer_in_use().startswith("tokenizers alone") and auto.tokenizer_in_use().startswith("transformers")
    source = Path(light_mod.__file__).read_text(encoding="utf-8")[:3000]
    cfg, _ = config.merge(config.Config(), {"model": str(d), "maxTokens": 12})
    # after a keyword, after indentation, inside a call, mid-identifier, at the end
    offsets = [source.index("def ") + 4, source.index("\n    ", 1000) + 5, source.index("(", 1500) + 1,
               source.index("tokenizer", 2000) + 4, len(source)]
    with torch.inference_mode():
        for offset in offsets:
            got = [suggest(LocalCompleter(e), source, offset, cfg, cancel=CancelToken(), path="tokenizer.py")
                   for e in (light, auto)]
            (s1, g1), (s2, g2) = [(d.suggestion, d.generation) for d in got]
            assert g1 is not None and g1.tokens == g2.tokens, offset
            assert (s1.text if s1 else None) == (s2.text if s2 else None), offset
