"""`completiond bench` and `completiond calibrate` run end to end on a tiny model.

Speed figures are not asserted (shared, noisy machines): only that every
measurement is present, well-formed, and that greedy outputs were identical.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from completiond.engine import native
from completiond.engine.calibration import Calibration, load_calibration, save_calibration
from completiond.engine.model_info import ModelInfo
from completiond.engine.engine import Engine, SamplingParams
from tests.conftest import ROOT, make_tiny_model

REQUIRED = ["spec_vs_plain", "spec_vs_hf_early_exit", "greedy_identical", "alpha", "mean_accepted_per_round",
            "predicted_speedup", "warm_cold_ttft_ratio", "cancel_ms", "model", "device", "plain_ms_per_token",
            "verify_cost_ratio", "spread", "draft_gain", "drafts", "best_draft_gain", "decode_tokens_per_s", "hf_early_exit_settings", "plain_vs_hf"]


@pytest.fixture(scope="module")
def peaked_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bench-model"), layers=4, peaked=True, seed=5)


def _prompt_files(tmp_path):
    # bench prompts come from files of at least 60 lines
    src = (ROOT / "completiond" / "engine" / "engine.py").read_text()
    f = tmp_path / "sample.py"
    f.write_text(src)
    return [str(f)]


def test_bench_json_has_every_figure(peaked_dir, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "completiond.cli", "bench", "--json", "--model", str(peaked_dir), "--prompts", "1",
         "--max-tokens", "12", "--exit-layer", "1", "--draft-k", "3", "--repeats", "2", "--files", *_prompt_files(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    for key in REQUIRED:
        assert key in result, key
    assert result["greedy_identical"] is True
    assert 0.0 <= result["alpha"] <= 1.0
    assert result["ttft_prompt_tokens"] > 100 and result["warm_reused_tokens"] > 0
    assert result["tokens_per_s"]["plain"] > 0 and result["tokens_per_s"]["hf_early_exit"] > 0
    assert result["repeats"] == 2
    for method in ("plain", "spec", "hf", "hf_early_exit"):
        d = result["decode_ms_per_token"][method]
        assert 0 < d["min"] <= d["median"] <= d["max"] and result["spread"][method] >= 0
    # transformers' early exit ran with our settings, and says so
    assert result["hf_early_exit_settings"]["assistant_early_exit"] == result["exit_layer"] == 1
    assert result["hf_early_exit_settings"]["num_assistant_tokens"] == result["draft_k"] == 3
    assert result["draft_gain"] == pytest.approx(result["decode_ms_per_token"]["plain"]["median"]
                                                 / result["decode_ms_per_token"]["spec"]["median"])
    assert result["verify_cost"]["k"] == 3 and result["verify_cost_ratio"] > 0
    assert [v["k"] for v in result["verify_cost_by_k"]] == list(range(1, 9))
    assert all(v["ratio"] > 0 and v["pass_ms"] > 0 and v["pass_gflops"] > 0 for v in result["verify_cost_by_k"])
    # the rates come from the arithmetic and the times beside them
    vc = result["verify_cost"]
    assert vc["context"] > 0 and vc["pass_mflops"] > vc["step_mflops"] > 0
    assert vc["step_gflops"] == pytest.approx(vc["step_mflops"] / vc["step_ms"])  # MFLOP per ms is GFLOP/s
    assert vc["pass_gflops"] == pytest.approx(vc["pass_mflops"] / vc["pass_ms"])
    assert result["matmul_peak_gflops"] > 0
    if result["native_step"]["used"]:  # the engine's own one-call step and verify pass, timed beside
        assert vc["native_ratio"] == pytest.approx(vc["native_pass_ms"] / vc["native_step_ms"])
        assert all(v["native_ratio"] > 0 for v in result["verify_cost_by_k"])
    for row in result["drafts"]:
        assert 0 <= row["history_accepted"] <= row["accepted"] <= row["drafted"]
        assert 0 <= row["history_rounds"] <= row["lookup_rounds"] <= row["rounds"]
        # a round commits its accepted drafts and one token of the verifier's (the last may be cut to max_tokens)
        assert row["rounds"] <= row["generated"] <= row["accepted"] + row["rounds"]
    assert [d["exit_layer"] for d in result["draft_cost_by_exit"]] == [1, 2, 3]  # every exit of the 4 layers
    assert all(d["cost"] > 0 and d["draft_ms"] > 0 and d["step_ms"] > 0 and d["repeats"] == 20
               for d in result["draft_cost_by_exit"])
    # the native step's gain is measured beside it (plain decoding on the PyTorch path), same outputs
    if result["native_step"]["used"]:
        assert result["native_gain"] == pytest.approx(result["decode_ms_per_token"]["plain_torch"]["median"]
                                                      / result["decode_ms_per_token"]["plain"]["median"])
    else:
        assert result["native_step"]["reason"] and result["native_gain"] is None


def test_calibrate_stores_a_record_the_engine_uses(peaked_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = subprocess.run(
        [sys.executable, "-m", "completiond.cli", "calibrate", "--json", "--model", str(peaked_dir), "--prompts", "1",
         "--max-tokens", "8", "--exit-layers", "1", "2", "--draft-ks", "2", "3", "--files", *_prompt_files(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env={**__import__("os").environ})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert len(result["candidates"]) >= 4
    assert result["saved_to"]
    engine = Engine.load(peaked_dir)
    assert engine.calibration.source.startswith("user calibration")
    assert engine.calibration.exit_layer == result["exit_layer"]
    assert engine.calibration.speculative == result["speculative"]


def test_no_speculation_record_turns_drafting_off(peaked_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    engine = Engine.load(peaked_dir)
    save_calibration(engine.model_id, Calibration(speculative=False, exit_layer=1, draft_k=4))
    engine = Engine.load(peaked_dir)
    gen = engine.generate([5, 6, 7], SamplingParams(max_tokens=6))
    assert gen.stats.drafted == 0
    # an explicit exit layer still asks for speculation
    gen = engine.generate([5, 6, 7], SamplingParams(max_tokens=6, exit_layer=1, ignore_eos=True))
    assert gen.stats.drafted > 0


def test_damaged_calibration_record_falls_back(peaked_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    engine = Engine.load(peaked_dir)
    from completiond.engine.calibration import record_path

    path = record_path(engine.model_id)
    path.parent.mkdir(parents=True)
    path.write_text('{"speculative": true, "exit_layer": 99, "draft_k": 4}')
    cal = load_calibration(engine.model_id, ModelInfo.read(peaked_dir), engine.num_layers)
    assert cal.source == "heuristic"


def test_generate_cli_spec_equals_no_spec(peaked_dir):
    def gen(*extra):
        out = subprocess.run([sys.executable, "-m", "completiond.cli", "generate", "--model", str(peaked_dir),
                              "--prompt", "def add(a, b):\n", "--max-tokens", "24", "--dtype", "float64", *extra],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-2000:]
        return out

    plain = gen("--no-spec")
    spec = gen("--exit-layer", "1", "--draft-k", "4", "--stats")
    assert spec.stdout == plain.stdout
    stats = json.loads(spec.stderr[spec.stderr.index("{"):])
    assert stats["drafted"] > 0 and stats["rounds"] > 0


def test_generate_cli_reports_bad_model(tmp_path):
    out = subprocess.run([sys.executable, "-m", "completiond.cli", "generate", "--model", str(tmp_path / "missing"),
                          "--prompt", "x"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 1
    assert "does not exist" in out.stderr


def test_bench_edit_workload(peaked_dir, tmp_path):
    """FIM prompts at each of the 8 line starts of the region being typed, with the file's real suffix."""
    out = subprocess.run(
        [sys.executable, "-m", "completiond.cli", "bench", "--json", "--workload", "edit", "--model", str(peaked_dir),
         "--prompts", "1", "--max-tokens", "8", "--exit-layer", "1", "--draft-k", "2", "--repeats", "1", "--skip-hf",
         "--files", *_prompt_files(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["workload"] == "edit" and result["prompts"] == 8
    assert result["greedy_identical"] is True
    assert [d["method"] for d in result["drafts"]] == ["spec", "spec_lookup", "spec_lookup_alone"]
    assert all(d["greedy_identical"] for d in result["drafts"])


def test_edit_prompts_hold_the_real_suffix(peaked_dir, tmp_path):
    from completiond.commands.bench import edit_prompts
    from completiond.engine.engine import Engine

    engine = Engine.load(peaked_dir, device="cpu")
    # A file of its own, short enough that every prefix fits the prompt budget whole (a longer prefix
    # is cut at a chunk boundary, and one more line can then make the prompt shorter)
    path = tmp_path / "edited.py"
    path.write_text("".join(f"x{i} = {i}\n" for i in range(64)))  # edit_prompts skips files under 60 lines
    prompts = edit_prompts(engine, [path], 1, lines=3)
    assert len(prompts) == 3
    lines = path.read_text().splitlines(keepends=True)
    tail = "".join(lines[int(len(lines) * 0.4) + 3:])
    tok = engine.tokenizer
    # each prompt carries (the start of) the text after the region as its suffix
    suffix_start = tok.decode(tok(tail[:200]).input_ids[:8])
    for ids in prompts:
        assert suffix_start in tok.decode(ids)
    # one line more of prefix each time: the prompts grow
    assert len(prompts[0]) < len(prompts[1]) < len(prompts[2])


class _ScriptedEngine:
    """Decode times scripted per call: plain runs take 10 ms; speculative runs take 10 / gain ms,
    the gains taken in turn from `gains`."""

    def __init__(self, gains):
        from completiond.engine.engine import Stats

        self._stats = Stats
        self.gains = list(gains)
        self.calls = 0
        self.draft_ids = None
        self.vocab_size = 100
        self.cache = type("C", (), {"clear": lambda self: None})()
        self.exit_adapter = self.draft_model = self.medusa = None  # no trained drafts attached

    def set_draft_vocab(self, ids):
        pass

    def generate(self, ids, params, cancel=None, history=None):
        from completiond.engine.engine import Generation

        s = self._stats(drafted=4, accepted=3, rejected=1, rounds=2, draft_ms=1.0, verify_ms=4.0)
        if params.speculative and params.max_tokens > 8:
            s.decode_ms = 10.0 / self.gains[self.calls % len(self.gains)]
            self.calls += 1
        else:
            s.decode_ms = 10.0
        return Generation([], "length", s)


@pytest.mark.parametrize("gains, on", [([1.10, 1.12, 1.11], True),      # clears the margin every time
                                       ([1.30, 0.95, 1.12], False),     # median 1.12, but one repeat lost
                                       ([1.03, 1.04, 1.02], False)])    # always faster, never by the margin
def test_calibrate_switches_on_only_where_the_gain_clears_the_noise(gains, on):
    from completiond.commands.calibrate import calibrate

    cal, rows = calibrate(_ScriptedEngine(gains), [[1, 2, 3]], 16, [1], [2], log=lambda *a: None, repeats=3)
    row = rows[0]
    assert row["speedup"] == pytest.approx(sorted(gains)[1])
    assert row["speedup_min"] == pytest.approx(min(gains)) and row["spread"] > 0
    assert cal.speculative is on


def test_calibrate_picks_lookup_alone_when_it_beats_every_model_draft():
    """A model draft that pays a little, lookup alone (no model draft) that pays more: the record keeps
    lookup and drops the model draft; when nothing clears the noise, lookup is off too."""
    from completiond.commands.calibrate import calibrate

    class Scripted(_ScriptedEngine):
        def generate(self, ids, params, cancel=None, history=None):
            gen = super().generate(ids, params)
            if params.speculative and params.max_tokens > 8 and params.draft == "none":
                gen.stats.decode_ms = 10.0 / self.alone
            return gen

    eng = Scripted([1.10, 1.12, 1.11])
    eng.alone = 1.5
    cal, rows = calibrate(eng, [[1, 2, 3]], 16, [1], [2], log=lambda *a: None, repeats=3)
    assert rows[-1]["draft"] == "none" and rows[-1]["prompt_lookup"] is True
    assert cal.speculative is False and cal.prompt_lookup is True
    assert cal.measured["speedup"] == pytest.approx(1.5)
    eng = Scripted([1.01, 1.02, 1.01])
    eng.alone = 1.03  # the best, but not by the margin
    cal, rows = calibrate(eng, [[1, 2, 3]], 16, [1], [2], log=lambda *a: None, repeats=3)
    assert cal.speculative is False and cal.prompt_lookup is False


def test_bench_drafts_table_covers_every_trained_draft(tmp_path):
    """With an exit adapter, Medusa heads and a draft model, each gets its rows (alone and after lookup),
    all greedy-identical."""
    import torch

    from completiond.models import exit_adapter as ea
    from completiond.models import medusa as md

    d = make_tiny_model(tmp_path / "m", layers=4, peaked=True, seed=5)
    eng = Engine.load(d, dtype="float64")
    ea.save_adapter(d / ea.ADAPTER_FILE, eng.model.model.layers[1], 1, eng.model_id, eng.model.config, {})
    h = eng.model.config.hidden_size
    md.save_heads(d / md.MEDUSA_FILE, [torch.zeros(h, h)] * 2, [torch.zeros(h)] * 2, eng.model_id, eng.model.config, {})
    out = subprocess.run(
        [sys.executable, "-m", "completiond.cli", "bench", "--json", "--model", str(d), "--draft-model", str(d),
         "--prompts", "1", "--max-tokens", "10", "--exit-layer", "1", "--draft-k", "2", "--repeats", "1", "--skip-hf",
         "--dtype", "float64", "--files", *_prompt_files(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    rows = {r["method"]: r for r in result["drafts"]}
    assert set(rows) == {"spec", "spec_lookup", "spec_lookup_alone", "spec_adapter", "spec_adapter_lookup",
                         "spec_medusa", "spec_medusa_lookup", "spec_draft_model", "spec_draft_model_lookup"}
    assert all(r["greedy_identical"] for r in rows.values()) and result["greedy_identical"] is True
    assert rows["spec_draft_model"]["alpha"] == 1.0  # the model drafting for itself
    assert result["best_draft_gain"] == max(r["draft_gain"] for r in rows.values())


def test_model_card_takes_the_measured_draft_costs_of_a_bench_run(tmp_path):
    """`model_card --from-results --bench`: the card's measured column comes from draft_cost_by_exit; a file
    that is not a bench output is refused with its name."""
    import shutil

    from completiond.models import default_model_dir
    from completiond.models.training.model_card import main

    model = tmp_path / "model"
    shutil.copytree(default_model_dir(), model)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"draft_cost_by_exit": [{"exit_layer": 4, "cost": 0.3125, "draft_ms": 1, "step_ms": 3}],
                                 "native_step": {"used": True}, "date": "2026-12-03", "cpu": "x86_64"}))
    assert main(["--model", str(model), "--from-results", "--bench", str(bench)]) == 0
    card = (model / "MODEL_CARD.md").read_text()
    assert "| 4 | " in card and "| 0.33 | 0.31 |" in card and "draft_cost_by_exit" in card
    assert json.loads((model / "eval_results.json").read_text())["measured_draft_cost"]["by_exit"][0]["cost"] == 0.3125
    bench.write_text("{}")
    with pytest.raises(SystemExit, match="bench.json"):
        main(["--model", str(model), "--from-results", "--bench", str(bench)])


def test_pass_flops_counts_the_models_parameters(peaked_dir):
    """One position at no context is twice the layers' and head's weights (a multiply-add each) plus
    attention over its own key; each further position and cached key adds what the formula says."""
    from completiond.commands.bench import pass_flops
    from completiond.engine.engine import Engine

    eng = Engine.load(str(peaked_dir), device="cpu", dtype="float32")
    layers = eng.model.model.layers
    weights = sum(p.numel() for L in layers for name, p in L.named_parameters() if "proj" in name and "weight" in name)
    head = eng.model.lm_head.weight.numel()
    H, hd, n = eng.fwd.H, eng.fwd.hd, eng.num_layers
    assert pass_flops(eng, 1, 0) == 2 * weights + 2 * head + n * 4 * H * hd
    # 3 positions after 10 cached tokens see 11, 12 and 13 keys
    assert pass_flops(eng, 3, 10) == 3 * (2 * weights + 2 * head) + n * 4 * H * hd * (11 + 12 + 13)


def test_engine_loss_is_the_reference_loss(peaked_dir):
    """bench --quality's loss through the engine (native-step chunks, K/V written as decoding does)
    equals transformers' on the same float32 weights, window by window."""
    import torch
    from transformers import AutoModelForCausalLM

    from completiond.commands.bench_quality import engine_loss, hf_loss

    engine = Engine.load(str(peaked_dir), device="cpu")
    torch.manual_seed(0)
    x = torch.randint(0, engine.tokenizer.vocab_size, (2, 40))
    windows = (x[:, :-1].contiguous(), x[:, 1:].contiguous())
    ref = AutoModelForCausalLM.from_pretrained(peaked_dir, dtype=torch.float32).eval()
    assert engine_loss(engine, windows) == pytest.approx(hf_loss(ref, windows), abs=1e-4)


def test_engine_greedy_keeps_the_model_cards_stop_rules(peaked_dir):
    from completiond.commands.bench_quality import engine_greedy

    engine = Engine.load(str(peaked_dir), device="cpu")
    tok = engine.tokenizer
    prompt = tok("def add(a, b):\n")["input_ids"]
    full, stopped = engine_greedy(engine, prompt, 12, tok=tok)
    assert len(full) == 12 and not stopped
    assert full == engine.generate(prompt, SamplingParams(max_tokens=12, speculative=False, ignore_eos=True)).tokens
    cut, stopped = engine_greedy(engine, prompt, 12, stop_ids=(full[3],), tok=tok)
    assert cut == full[:full.index(full[3])] and stopped
    first = engine_greedy(engine, prompt, 12, stop_fn=lambda text: len(text) > 0, tok=tok)[0]
    assert first == full[:1]


def test_bench_quality_puts_the_formats_side_by_side():
    """One run, the bundled model: the float32 reference, bf16 and int8, each with held-out loss and
    next-line exact match; bf16 holds the checkpoint's own values (it is stored in bf16), so its loss is
    the reference's up to summation order; int8's cost is reported against bf16."""
    out = subprocess.run([sys.executable, "-m", "completiond.cli", "bench", "--quality", "--quality-windows", "1",
                          "--quality-positions", "1", "--json"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    rows = r["formats"]
    assert list(rows) == ["float32", "bf16", "int8"]
    assert rows["bf16"]["weights_in_use"] == "bf16" and rows["int8"]["weights_in_use"] == "int8"
    assert rows["bf16"]["heldout_loss"] == pytest.approx(rows["float32"]["heldout_loss"], abs=2e-3)
    for row in rows.values():
        assert 0 < row["heldout_loss"] < 10
        assert set(row["next_line_exact_match"]) == {"left_to_right", "fim_spm"}
    assert r["int8_loss_cost_nats"] == pytest.approx(rows["int8"]["heldout_loss"] - rows["bf16"]["heldout_loss"],
                                                     abs=1e-3)
    assert r["int8_loss_cost_against"] == "bf16" and r["next_line_positions"] == 1


def test_bench_with_int8_weights(peaked_dir, tmp_path):
    """bench --weights int8: every pass runs the native step on the quantised panels, so transformers'
    baselines and the PyTorch path (other values) are left out, and speculation stays exact."""
    out = subprocess.run(
        [sys.executable, "-m", "completiond.cli", "bench", "--json", "--model", str(peaked_dir), "--weights", "int8",
         "--prompts", "1", "--max-tokens", "12", "--exit-layer", "1", "--draft-k", "3", "--repeats", "1",
         "--files", *_prompt_files(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["native_step"]["weights"] == "int8" and r["native_step"]["weights_in_use"] == "int8"
    assert r["native_step"]["kernel"] in native.KERNELS  # whichever build this CPU runs
    assert "plain_torch" not in r["decode_ms_per_token"] and "hf" not in r["decode_ms_per_token"]
    assert r["greedy_identical"] is True
    assert "transformers baselines skipped" in out.stderr
