"""`completiond bench-device`: real-model shapes, weight formats, resident memory and the llama.cpp peer row.

Speed figures are not asserted (shared, noisy machines): only that every figure is present and
consistent, that greedy early exit equals plain decoding, that --weights reaches the engine, and that
the peer row converts the same model, calls llama.cpp's tools as documented and parses their output
(a fake llama-bench and llama-quantize here: no llama.cpp build in the tests).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from completiond.commands import bench_device
from tests.conftest import ROOT, make_tiny_model

FAST = ["--repeats", "1", "--max-tokens", "8", "--max-k", "2", "--prompts", "1", "--context", "48",
        "--bandwidth-mb", "16"]


def bench_device_json(*args: str) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-m", "completiond.cli", "bench-device", "--json", *args],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout), out.stderr


@pytest.fixture(scope="module")
def peaked_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bench-device-model"), layers=4, peaked=True, seed=5)


def test_device_report_runs_on_the_cpu(peaked_dir):
    """End to end here: a random-weight shape and a model directory, every figure present, greedy early
    exit identical to plain, and a directory that is not a model reported without stopping the run."""
    r, _ = bench_device_json("--repeats", "1", "--max-tokens", "12", "--bandwidth-mb", "64", "--context", "64",
                             "--models", f"tiny-qwen2,{peaked_dir},/nonexistent/model")
    assert r["device"] == "cpu" and r["copy_bandwidth_gbs"] > 0 and "not built" in r["cuda_graphs"]
    assert r["context"] == 64 and r["threads"] >= 1 and r["llama_cpp"] == {}
    shape, tiny, missing = r["models"]
    assert shape["model"] == "tiny-qwen2 (random weights, 8192-token vocabulary)" and shape["layers"] == 4
    assert shape["vocab"] == "real: 8192 tokens" and shape["weights"] == "auto"
    assert shape["reader"] == tiny["reader"] == "completiond (engine/checkpoint.py)"  # never transformers' modelling code
    # transformers is not imported for the model, so the light tokenizer serves once checked against it
    assert shape["tokenizer"] == "tokenizers alone (tokenizer.json, checked to act as transformers' Qwen2Tokenizer)"
    assert "does not exist" in missing["error"]
    for m in (shape, tiny):
        assert m["context"] == 64  # every prompt exactly --context tokens
        assert m["weight_bytes"] > 0 and m["plain_ms_per_token"] > 0 and m["bandwidth_bound_ms_per_token"] > 0
        assert m["plain_vs_bound"] == pytest.approx(m["plain_ms_per_token"] / m["bandwidth_bound_ms_per_token"],
                                                    rel=0.01, abs=0.006)  # each figure is rounded
        assert m["rss_after_load_bytes"] > 0 and m["rss_load_delta_bytes"] is not None
        assert m["rss_after_warmup_bytes"] > 0 and m["rss_vs_weight_bytes"] > 0
        assert m["weights_in_use"] and m["kernel"] and m["load_s"] >= 0
        # prefill_ms is rounded to 0.01 ms, and a tiny model's native prefill takes well under a millisecond
        ms = m["prefill_ms"]
        assert ms > 0 and 64_000 / (ms + 0.005) <= m["prefill_tokens_per_s"] <= 64_000 / max(ms - 0.005, 1e-9)
        assert m["prefill_ms_per_token"] == pytest.approx(m["prefill_ms"] / 64, rel=0.01, abs=0.002)
        assert m["prefill_rate_in_use"] > 0  # the engine's planning rate (CPU)
        assert list(m["verify_cost_by_k"]) == [str(k) for k in range(1, 9)]
        assert all(v > 0 for v in m["verify_cost_by_k"].values())
        assert all(s.get("tokens") == 24 for s in m["sampling_t0.8"].values()), m["sampling_t0.8"]
    # random bf16 weights: the native step reads them as bf16 panels, exactly
    assert shape["weights_in_use"] == "bf16", shape["decode_step"]
    assert tiny["early_exit"]["greedy_identical"] is True  # peaked weights: no near ties to flip


def test_every_weight_format_is_measured_and_stays_exact(peaked_dir):
    """--weights bf16,int8: the model loaded once per format, each row names the format the native step
    reads, int8's weights take fewer bytes, and greedy early exit equals plain in both."""
    r, _ = bench_device_json(*FAST, "--no-sampling", "--weights", "bf16,int8", "--models", str(peaked_dir))
    bf16, int8 = r["models"]
    assert (bf16["weights"], int8["weights"]) == ("bf16", "int8")
    assert (bf16["weights_in_use"], int8["weights_in_use"]) == ("bf16", "int8")
    assert "int8 weights" in int8["decode_step"]
    assert int8["weight_bytes"] < bf16["weight_bytes"]
    assert bf16["early_exit"]["greedy_identical"] and int8["early_exit"]["greedy_identical"]
    for m in (bf16, int8):  # the arithmetic floor under verify_cost_by_k, at 1..K+1 rows
        assert list(m["matmul_arithmetic_ms_by_rows"]) == ["1", "2", "3"]
        assert list(m["matmul_arithmetic_vs_plain_by_k"]) == ["1", "2"]
        assert all(v > 0 for v in m["matmul_arithmetic_ms_by_rows"].values())
        assert m["matmul_arithmetic_vs_plain_by_k"]["2"] == pytest.approx(
            m["matmul_arithmetic_ms_by_rows"]["3"] / m["plain_ms_per_token"], rel=0.05, abs=0.002)  # each rounded
    assert "sampling_t0.8" not in bf16


def test_bad_weights_are_refused_with_a_clear_message():
    out = subprocess.run([sys.executable, "-m", "completiond.cli", "bench-device", "--weights", "bf16,fp8"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "--weights 'bf16,fp8': expected a comma-separated list of auto, bf16, int8" in out.stderr
    out = subprocess.run([sys.executable, "-m", "completiond.cli", "bench-device", "--llama-types", "q4_0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "--llama-types 'q4_0'" in out.stderr


def test_weights_reach_the_engine(monkeypatch, capsys):
    """The flag becomes Engine.load(weights=...), once per format, in order."""
    from completiond.engine.engine import Engine, EngineError

    seen = []

    def fake_load(model=None, **kwargs):
        seen.append((kwargs.get("weights"), kwargs.get("reader")))
        raise EngineError("not loading in this test")

    monkeypatch.setattr(Engine, "load", staticmethod(fake_load))
    assert bench_device.main(["--json", "--models", "bundled", "--weights", "int8,bf16", "--bandwidth-mb", "1"]) == 0
    assert seen == [("int8", "auto"), ("bf16", "auto")]
    r = json.loads(capsys.readouterr().out)
    assert [(m["weights"], m["error"]) for m in r["models"]] == [("int8", "not loading in this test"),
                                                                 ("bf16", "not loading in this test")]
    seen.clear()
    assert bench_device.main(["--json", "--models", "bundled", "--weights", "bf16", "--reader", "auto,transformers",
                              "--bandwidth-mb", "1"]) == 0
    assert seen == [("bf16", "auto"), ("bf16", "transformers")]
    r = json.loads(capsys.readouterr().out)
    assert [m["reader"] for m in r["models"]] == ["auto", "transformers"]
    with pytest.raises(SystemExit):
        bench_device.main(["--reader", "fast"])


# ----------------------------------------------------------------------------- the llama.cpp peer

def _script(path, body: str) -> None:
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_llama(tmp_path):
    """llama-quantize that copies its input (and logs its arguments); llama-bench that logs its arguments
    and prints llama-bench's JSON with samples of 2, 6 and 3 ms per token per type (medians 3 ms)."""
    tools = tmp_path / "bin"
    tools.mkdir()
    log = tmp_path / "calls.jsonl"
    _script(tools / "llama-quantize", f"""
        import json, shutil, sys
        open({str(log)!r}, "a").write(json.dumps(["llama-quantize"] + sys.argv[1:]) + "\\n")
        shutil.copy(sys.argv[1], sys.argv[2])
        """)
    _script(tools / "llama-bench", f"""
        import json, sys
        a = sys.argv[1:]
        open({str(log)!r}, "a").write(json.dumps(["llama-bench"] + a) + "\\n")
        n, d = int(a[a.index("-n") + 1]), int(a[a.index("-d") + 1])
        scale = 2 if "q8_0" in a[a.index("-m") + 1] else 1  # q8_0: twice as slow as bf16, for the ratios
        samples = [s * scale * n * 1000000 for s in (2, 6, 3)]
        print("llama-bench: progress on stderr", file=sys.stderr)
        if n == 0:  # passes over p new tokens: (4 + p) ms each (medians), whatever the type
            print(json.dumps([{{"n_prompt": int(p), "n_gen": 0, "n_depth": d, "avg_ns": 1,
                               "samples_ns": [(4 + int(p)) * f * 1000000 for f in (1, 3, 0.5)]}}
                              for p in a[a.index("-p") + 1].split(",")]))
            sys.exit(0)
        print(json.dumps([{{"build_commit": "fake", "build_number": 1, "cpu_info": "test", "model_type": "qwen2 ?B",
                           "model_size": 123, "n_threads": int(a[a.index("-t") + 1]), "n_prompt": 0, "n_gen": n,
                           "n_depth": d, "avg_ns": sum(samples) // 3, "samples_ns": samples}}], indent=2))
        """)
    return tools, log


def test_llama_peer_row(fake_llama, tmp_path):
    """The same random model as GGUF (our writer, Qwen2 layout, bf16 as stored), quantised to q8_0 by
    llama-quantize, each timed by llama-bench at our context, tokens and threads; ours ÷ theirs for the
    like-for-like type."""
    tools, log = fake_llama
    r, stderr = bench_device_json(*FAST, "--no-sampling", "--threads", "2", "--models", "tiny-qwen2",
                                  "--llama-bench", str(tools), "--llama-types", "bf16,q8_0", "--llama-repeats", "3",
                                  "--llama-k", "4,2")
    label = "tiny-qwen2 (random weights, 8192-token vocabulary)"
    peer = r["llama_cpp"][label]
    assert peer["layout"].startswith("qwen2")
    bf16, q8 = peer["types"]["bf16"], peer["types"]["q8_0"]
    assert bf16["made_by"] == "models/to_gguf.py" and q8["made_by"] == "llama-quantize from the bf16 file"
    assert bf16["ms_per_token"] == 3.0 and bf16["samples_ms_per_token"] == [2.0, 6.0, 3.0]
    assert bf16["mean_ms_per_token"] == pytest.approx(11 / 3, abs=1e-3) and q8["ms_per_token"] == 6.0
    assert bf16["n_gen"] == 8 and bf16["n_depth"] == 48 and bf16["threads"] == 2
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    quantize = [c for c in calls if c[0] == "llama-quantize"]
    assert len(quantize) == 1 and quantize[0][3:] == ["Q8_0", "2"]
    benches = [c for c in calls if c[0] == "llama-bench"]
    assert len(benches) == 6  # per type: token generation, a cold prompt, then the passes
    for c in benches:
        run = (c[c.index("-p") + 1], c[c.index("-n") + 1], c[c.index("-d") + 1])
        assert run in (("0", "8", "48"), ("48", "0", "0"), ("1,3,5", "0", "48"))
        assert c[c.index("-t") + 1] == "2" and c[c.index("-r") + 1] == "3" and c[c.index("-o") + 1] == "json"
    # the pass over K+1 tokens ÷ the pass over one, medians: (4 + 5) / (4 + 1) at K=4, (4 + 3) / 5 at K=2
    assert bf16["pass_ms_by_rows"] == {"1": 5.0, "3": 7.0, "5": 9.0}
    # a cold prompt of --context (48) tokens: 52 ms, so 923.1 tokens/s
    assert bf16["prefill_ms"] == 52.0 and bf16["prefill_tokens_per_s"] == 923.1
    assert bf16["pass_cost_by_k"] == q8["pass_cost_by_k"] == {"2": 1.4, "4": 1.8}
    (ours,) = r["models"]
    assert ours["weights_in_use"] == "bf16" and ours["peer"]["type"] == "bf16"
    assert ours["peer"]["ours_over_peer"] == pytest.approx(ours["plain_ms_per_token"] / 3.0, abs=1e-3)
    assert ours["vs_llama_cpp"]["q8_0"] == pytest.approx(ours["plain_ms_per_token"] / 6.0, abs=1e-3)
    # beside ours at each K both measured (--max-k 2 here: ours has no K=4)
    assert ours["peer"]["pass_cost_by_k"] == {"2": 1.4, "4": 1.8}
    assert ours["peer"]["verify_cost_by_k"] == {"2": ours["verify_cost_by_k"]["2"]}
    assert ours["peer"]["prefill_tokens_per_s"] == 923.1
    assert ours["peer"]["prefill_ours_over_peer"] == pytest.approx(ours["prefill_ms"] / 52.0, abs=1e-3)
    assert "cold prefill: ours" in stderr
    assert "K=2: a verify pass costs" in stderr and "1.4 in llama.cpp" in stderr


def test_a_missing_llama_bench_fails_before_any_model_is_built(tmp_path):
    out = subprocess.run([sys.executable, "-m", "completiond.cli", "bench-device", "--models", "qwen2.5-coder-1.5b",
                          "--llama-bench", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 1 and "llama-bench is not an executable" in out.stderr
    assert "copy bandwidth" not in out.stdout + out.stderr


def test_llama_bench_output_is_parsed_or_refused():
    row = {"n_prompt": 0, "n_gen": 4, "n_depth": 512, "avg_ns": 8_000_000, "samples_ns": [6_000_000, 10_000_000, 8_000_000]}
    parsed = bench_device.parse_llama_bench(json.dumps([row]))
    assert parsed["ms_per_token"] == 2.0 and parsed["n_depth"] == 512
    with pytest.raises(bench_device.BenchDeviceError, match="no JSON"):
        bench_device.parse_llama_bench("error: model not found")
    with pytest.raises(bench_device.BenchDeviceError, match="no token-generation result"):
        bench_device.parse_llama_bench(json.dumps([{**row, "n_gen": 0, "n_prompt": 512}]))
    passes = [{"n_prompt": p, "n_gen": 0, "avg_ns": 9, "samples_ns": [p * 1_000_000, p * 3_000_000, p * 2_000_000]}
              for p in (1, 5)]
    assert bench_device.parse_llama_passes(json.dumps(passes + [row])) == {1: 2.0, 5: 10.0}
    with pytest.raises(bench_device.BenchDeviceError, match="no prompt-processing result"):
        bench_device.parse_llama_passes(json.dumps([row]))
    with pytest.raises(bench_device.BenchDeviceError, match="no JSON"):
        bench_device.parse_llama_passes("")


@pytest.mark.parametrize("value, ks", [("4", [4]), ("4,1,4", [1, 4]), ("", [])])
def test_llama_k_values(value, ks):
    assert bench_device._ks(value) == ks


@pytest.mark.parametrize("value", ["0", "-1", "x", "64", "4,,a"])
def test_llama_k_refuses_what_is_no_draft_length(value):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="--llama-k"):
        bench_device._ks(value)


def test_context_prompts_are_exactly_the_context():
    from transformers import AutoTokenizer

    from completiond.models import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    prompts = bench_device.context_prompts(tok, 3, 512)
    assert len(prompts) == 3 and all(len(p) == 512 for p in prompts) and len({tuple(p) for p in prompts}) == 3


def test_random_shapes_carry_the_real_configs():
    """The stand-ins: Qwen2.5-Coder-0.5B's and 1.5B's real shapes (tied embeddings, 151,936 tokens, rope
    theta 1e6), or the bundled tokenizer's 8,192 tokens on request."""
    small = bench_device.shape_config("qwen2.5-coder-0.5b")
    assert (small["hidden_size"], small["num_hidden_layers"], small["num_attention_heads"],
            small["num_key_value_heads"], small["intermediate_size"]) == (896, 24, 14, 2, 4864)
    assert small["vocab_size"] == 151936 and small["tie_word_embeddings"] and small["rope_theta"] == 1e6
    assert bench_device.shape_config("qwen2.5-coder-0.5b", "bundled")["vocab_size"] == 8192
    large = bench_device.shape_config("qwen2.5-coder-1.5b")
    assert (large["hidden_size"], large["num_hidden_layers"], large["intermediate_size"]) == (1536, 28, 8960)
    with pytest.raises(bench_device.BenchDeviceError, match="unknown shape"):
        bench_device.shape_config("qwen9")


def test_random_model_is_bf16_with_random_biases(tmp_path):
    import torch
    from safetensors.torch import load_file

    model = bench_device.random_model("tiny-qwen2", tmp_path / "m")
    tensors = load_file(str(model / "model.safetensors"))
    assert {v.dtype for v in tensors.values()} == {torch.bfloat16}
    assert tensors["model.layers.0.self_attn.k_proj.bias"].abs().sum() > 0
    assert "lm_head.weight" not in tensors  # tied, as the real models
    assert json.loads((model / "config.json").read_text())["model_type"] == "qwen2"
    again = bench_device.random_model("tiny-qwen2", tmp_path / "again")
    assert torch.equal(load_file(str(again / "model.safetensors"))["model.embed_tokens.weight"],
                       tensors["model.embed_tokens.weight"])  # seeded: the peer and we see one model
    assert os.path.exists(model / "tokenizer.json")


def test_the_table_prints_each_figure_under_its_heading(capsys):
    """The non-JSON report: one row per model, every cell under its own heading, the arithmetic floor beside
    the verify costs it bounds, and a model that failed reported in a row of the same width."""
    row = {"model": "m", "weights_in_use": "bf16", "plain_ms_per_token": 30.0, "bandwidth_bound_ms_per_token": 29.0,
           "rss_delta_vs_weight_bytes": 1.05, "early_exit": {"ms_per_token": 40.0, "greedy_identical": True},
           "verify_cost_by_k": {"1": 1.1, "2": 1.2}, "native_verify_cost_by_k": {"1": 1.15, "2": 1.25},
           "matmul_arithmetic_vs_plain_by_k": {"1": 0.45, "2": 0.6}, "sampling_t0.8": {"plain": {"ms_per_token": 31.0}},
           "prefill_tokens_per_s": 240.0, "peer": {"type": "bf16", "ms_per_token": 44.0, "ours_over_peer": 0.682,
                                                   "prefill_tokens_per_s": 146.0}}
    bench_device._print_table({"device_name": "cpu", "torch": "2", "threads": 2, "copy_bandwidth_gbs": 30.0,
                               "context": 512, "cuda_graphs": "no", "models": [row, {"model": "x", "error": "gone"}]})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    head, _, measured, failed = lines
    cells = dict(zip([c.strip() for c in head.split("|")[1:-1]], [c.strip() for c in measured.split("|")[1:-1]]))
    assert cells["verify cost K=1..8"] == "1.15, 1.25" and cells["its arithmetic floor"] == "0.45, 0.6"
    assert cells["sampling 0.8"] == "plain: 31.0" and cells["plain ms/token"] == "30.0"
    assert cells["cold prefill tokens/s (llama.cpp)"] == "240.0 (146.0)" and cells["ours ÷ peer"] == "0.682"
    assert cells["llama.cpp (type) ms/token"] == "44.0 (bf16)"
    assert len(failed.split("|")) == len(head.split("|")) and "not measured: gone" in failed


def test_the_table_names_the_peers_pass_costs(capsys):
    peer = {"layout": "qwen2", "types": {"bf16": {"ms_per_token": 44.0, "pass_cost_by_k": {"4": 1.5}},
                                         "q8_0": {"ms_per_token": 29.0}}}
    bench_device._print_table({"device_name": "cpu", "torch": "2", "threads": 2, "copy_bandwidth_gbs": 30.0,
                               "context": 512, "cuda_graphs": "no", "models": [], "llama_cpp": {"m": peer}})
    out = capsys.readouterr().out
    assert "llama.cpp on m (GGUF layout qwen2): bf16 44.0, q8_0 29.0 ms/token" in out
    assert "  bf16: a pass over K+1 tokens ÷ a pass over one (verify cost): K=4: 1.5" in out and "q8_0:" not in out


def test_llama_prefill_and_passes_refuse_missing_rows(tmp_path):
    """A llama-bench that reports other prompt sizes than asked (an old build ignoring -d, say) is an
    error naming what is missing, not a ratio over the wrong rows."""
    bench = tmp_path / "llama-bench"
    _script(bench, """
        import json
        print(json.dumps([{"n_prompt": 7, "n_gen": 0, "avg_ns": 1, "samples_ns": [1000000]}]))
        """)
    with pytest.raises(bench_device.BenchDeviceError, match="no prompt of 48 tokens"):
        bench_device.run_llama_prefill(bench, "m.gguf", 48, 2, 1)
    with pytest.raises(bench_device.BenchDeviceError, match=r"no pass over \[1, 5\] tokens"):
        bench_device.run_llama_passes(bench, "m.gguf", [4], 48, 2, 1)
