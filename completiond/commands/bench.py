"""`completiond bench`: speed measured side by side in one run, on one model and one set of prompts.

Compared: plain autoregressive decoding through our engine (with its native step and, where that is
in use, without it: `plain_torch`), our self-speculative
decoding, transformers' greedy `generate()`, and transformers'
`generate(assistant_early_exit=E)` at the same exit layer. Every variant
decodes the same held-out prompts with a cold cache and EOS ignored, so each
produces exactly `--max-tokens` tokens and greedy outputs can be compared
token for token. `--typing` replays a typing session through the editor path instead.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import sys
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from completiond.config import SETTINGS_BY_KEY
from completiond.engine.draft_kind import DraftKind
from completiond.errors import CompletionError

WEIGHTS = SETTINGS_BY_KEY["weights"].enum  # the formats Engine.load(weights=...) accepts


def _editing_settings(args: argparse.Namespace) -> dict[str, Any] | None:
    """--retrieval and each --setting KEY=VALUE (VALUE as JSON where it parses, else the string)."""
    settings: dict[str, Any] = {"contextRetrieval": args.retrieval} if args.retrieval else {}
    for item in args.setting:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CompletionError(f"--setting {item!r}: expected KEY=VALUE")
        try:
            settings[key.strip()] = json.loads(value)
        except ValueError:
            settings[key.strip()] = value
    return settings or None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory or hub id (default: the bundled model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--weights",
        choices=WEIGHTS,
        default="auto",
        help="weight format of the native CPU step (the weights setting): auto, bf16 or int8",
    )
    p.add_argument("--prompts", type=int, default=6, help="number of held-out prompts")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--exit-layer", type=int, default=None, help="default: calibrated")
    p.add_argument("--draft-k", type=int, default=None, help="default: calibrated")
    p.add_argument(
        "--files",
        nargs="*",
        default=None,
        help="source files for prompts (default: held-out stdlib files); with --editing: the files the session edits "
        "(default: held-out third-party modules)",
    )
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument("--draft-model", default=None, help="a separate draft model to measure too (completiond.draftModel)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per method, interleaved (medians reported)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--typing", action="store_true", help="typing-session benchmark through LSP and the daemon")
    p.add_argument(
        "--editing",
        action="store_true",
        help="editing-session benchmark through LSP and the daemon: opens, jumps (with and without rest), file "
        "switches and keystrokes, p50/p95 per event and the share of the prompt served from the KV cache "
        "(bench_editing.py; --model shape:qwen2.5-coder-0.5b: random weights in a bench-device shape)",
    )
    p.add_argument("--rounds", type=int, default=2, help="with --editing: times the session is repeated")
    p.add_argument("--jumps", type=int, default=3, help="with --editing: jumps (and as many rested jumps) per file")
    p.add_argument(
        "--rest-notes",
        choices=("on", "off"),
        default="on",
        help="with --editing: report the resting cursor before a rested jump's request (completiond/cursorRest, as "
        "our plugins do; off: a plain LSP client)",
    )
    p.add_argument(
        "--rest-delay-ms",
        type=int,
        default=None,
        help="with --editing: how long after the move the rest is reported (default: our plugins' delay)",
    )
    p.add_argument(
        "--file-count",
        type=int,
        default=4,
        help="with --editing and no --files: how many held-out files the session opens (20: issue 45's memory check)",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="with --editing: the daemon's threads (COMPLETIOND_THREADS)"
    )
    p.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --editing: an editor setting for the session (camelCase, a JSON value or a string; "
        "repeatable), e.g. fimTemplate=qwen2.5-coder for the bundled model's prefix-first layout",
    )
    p.add_argument(
        "--prefetch",
        choices=("on", "off"),
        default=None,
        help="with --editing: the daemon's background warm-ups on opens, rests and pauses (default on; off: "
        "COMPLETIOND_PREFETCH=0, to measure what they bring)",
    )
    p.add_argument(
        "--quality",
        action="store_true",
        help="what each weight format costs: held-out loss and next-line exact match of the model with "
        "its weights in float32 (the reference), bf16 and int8, side by side (bench_quality.py)",
    )
    p.add_argument("--quality-windows", type=int, default=48, help="with --quality: 512-token held-out windows")
    p.add_argument("--quality-positions", type=int, default=200, help="with --quality: next-line positions")
    p.add_argument(
        "--workload",
        choices=("prompts", "edit"),
        default="prompts",
        help="prompts: the text before a line a third into each file; edit: FIM prompts at each line "
        "start of a region being typed, with the real suffix (see edit_prompts)",
    )
    p.add_argument("--keystrokes", type=int, default=120, help="with --typing")
    p.add_argument("--file", default=None, help="with --typing: the file to type into (default: a held-out file)")
    p.add_argument(
        "--workspace",
        default=None,
        help="with --typing: a project directory holding --file, opened as the "
        "workspace folder (the context block draws on it; compare with --retrieval on/off)",
    )
    p.add_argument(
        "--retrieval", choices=("on", "off"), default=None, help="with --typing: the contextRetrieval setting"
    )
    p.add_argument(
        "--llama-server",
        action="store_true",
        help="with --typing: also replay it against llama.cpp's llama-server on this machine serving the "
        "bundled model (as GGUF; the binary from $COMPLETIOND_LLAMA_SERVER or PATH), p50/p95 side by side",
    )
    p.add_argument(
        "--endpoint",
        default=None,
        help="with --typing: also replay it against this team server (see README, For teams)",
    )
    p.add_argument("--backend", choices=("openai", "llamacpp-infill"), default="openai", help="with --endpoint")
    p.add_argument("--endpoint-model", default="", help="with --endpoint: the served model name")


def source_lines(files: list[Path] | None):
    """The lines of each readable file of at least 60 lines (default: the held-out stdlib files), in order."""
    if files is None:
        from completiond.models.corpus import heldout_files

        files = [f.path for f in heldout_files()]
    for path in files:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
        except (OSError, UnicodeDecodeError):
            continue
        if len(lines) >= 60:
            yield lines


def prompt_texts(files: list[Path] | None, count: int, chars: int = 1500) -> list[str]:
    """Deterministic prompts: the text before a line a third of the way into each file."""
    out = []
    for lines in source_lines(files):
        out.append("".join(lines[: len(lines) // 3])[-chars:])
        if len(out) == count:
            break
    if not out:
        raise SystemExit("completiond bench: no usable prompt files")
    return out


def edit_prompts(engine, files: list[Path] | None, n_files: int, lines: int = 8) -> list[list[int]]:
    """Prompts as an editor sends them while a region is typed: in each held-out file, the `lines`
    lines starting 40% into the file are the region; for each of its line starts, the document
    holds everything before that line (what was typed so far) and, after the cursor, the rest of
    the file past the region (the real suffix). The prompt is built by the real PromptBuilder
    (FIM template, suffix, chunked prefix) with default settings. Files under 60 lines are skipped."""
    from completiond import config
    from completiond.completion.prompt import PromptBuilder

    builder = PromptBuilder.for_engine(engine, config.Config())
    out, used = [], 0
    for all_lines in source_lines(files):
        start = int(len(all_lines) * 0.4)
        suffix = "".join(all_lines[start + lines :])
        for j in range(start, start + lines):
            before = "".join(all_lines[:j])
            prompt = builder.build(before + suffix, len(before))
            if prompt.skip_reason is None:
                out.append(prompt.ids)
        used += 1
        if used == n_files:
            break
    if not out:
        raise SystemExit("completiond bench: no usable files for the edit workload")
    return out


def long_text(files: list[Path] | None, tokenizer, tokens: int) -> str:
    """A prompt of about `tokens` tokens from consecutive source files."""
    parts, total = [], 0
    for text in prompt_texts(files, 50, chars=20000):
        parts.append(text)
        total += len(tokenizer(text).input_ids)
        if total >= tokens:
            break
    ids = tokenizer("".join(parts)).input_ids[:tokens]
    return tokenizer.decode(ids)


def _patch_hf_early_exit() -> None:
    """transformers 5.2's EarlyExitCandidateGenerator drops an argument its parent requires.

    Forward it, so the baseline runs as upstream intends; a fixed release is left untouched.
    """
    from transformers.generation import candidate_generator as cg

    cls = getattr(cg, "EarlyExitCandidateGenerator", None)
    if (
        cls is None
        or "is_first_iteration" not in inspect.signature(cg.AssistedCandidateGenerator.get_candidates).parameters
    ):
        return
    src = inspect.getsource(cls.get_candidates)
    if "super().get_candidates(input_ids)" not in src:
        return

    def get_candidates(self, input_ids, is_first_iteration):
        base = getattr(self.assistant_model, self.assistant_model.base_model_prefix)
        layers = base.config.num_hidden_layers
        base.config.num_hidden_layers = self.assistant_early_exit
        try:
            return cg.AssistedCandidateGenerator.get_candidates(self, input_ids, is_first_iteration)
        finally:
            base.config.num_hidden_layers = layers

    cls.get_candidates = get_candidates


def _transformers_model(engine):
    """transformers' own model of the engine's checkpoint, for its baselines: the engine reads the checkpoints
    it can with engine/checkpoint.py, whose modules hold the weights but have no forward pass."""
    import torch

    from completiond.engine.checkpoint import CausalLM

    if not isinstance(engine.model, CausalLM):
        return engine.model  # read by transformers already (reader "transformers", or a model it alone reads)
    from transformers import AutoModelForCausalLM

    dtype = next(engine.model.parameters()).dtype  # the dtype the engine read the weights in
    model = AutoModelForCausalLM.from_pretrained(
        str(engine.model_dir), dtype=dtype, use_safetensors=True, local_files_only=True
    )
    placed: torch.nn.Module = model.to(engine.device)
    return placed.eval()


def _hf_generate(model, ids: list[int], max_tokens: int, early_exit: dict | None = None) -> tuple[list[int], float]:
    import torch

    x = torch.tensor([ids], device=model.device)
    kwargs = dict(
        max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    kwargs.update(early_exit or {})
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, **kwargs)
    return out[0, len(ids) :].tolist(), time.perf_counter() - t


def _timed(engine, ids, params, cold: bool = True, history=None):
    """One generation, timed. `history`: the output history it drafts from (engine.lookup.OutputHistory);
    None, none, so that no measurement drafts from an earlier run of its own prompt."""
    if cold:
        engine.cache.clear()
    t = time.perf_counter()
    gen = engine.generate(ids, params, history=history)
    return gen, time.perf_counter() - t


def synchronize(device) -> None:
    """Wait for the device's queue: timings of asynchronous devices mean nothing without it."""
    import torch

    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize()
    elif kind == "mps":
        torch.mps.synchronize()


def _spread(values: list[float]) -> dict:
    """Median, min, max and (max - min) / median of repeated measurements."""
    med = statistics.median(values)
    return {
        "median": med,
        "min": min(values),
        "max": max(values),
        "spread": (max(values) - min(values)) / med if med else None,
    }


def pass_flops(engine, positions: int, context: int) -> int:
    """Arithmetic of one forward pass over `positions` new tokens after `context` cached ones, through
    every layer and the full LM head: 2 FLOPs per multiply-add of the projections, of attention's
    scores and weighted sum over each query's visible keys, and of the head (norms, RoPE and
    activations are left out: O(d) per position)."""
    fwd = engine.fwd
    weights = sum(fwd.layer_numel[: engine.num_layers])  # counted at load: a large model's matrices are released
    visible = sum(context + i + 1 for i in range(positions))  # query i sees keys 0..context+i
    attention = engine.num_layers * 2 * 2 * fwd.H * fwd.hd * visible
    return 2 * weights * positions + attention + 2 * fwd.head_w.numel() * positions


def matmul_peak_gflops(repeats: int = 7, n: int = 1024) -> float:
    """What this machine's matrix multiply reaches on one large float32 n×n×n product with the engine's
    threads (median of `repeats`): the ceiling a compute-bound verify pass is measured against."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e9


def verify_cost(engine, prompt: list[int], k: int, repeats: int = 30, seq=None) -> dict:
    """One forward pass over k+1 positions ÷ one single-token step, both through every layer and
    the LM head, at the same context, interleaved; medians of `repeats`. With the arithmetic each
    does (pass_flops), the rate each ran at: a step that is bound by memory or overheads runs far
    below the machine's matmul rate, a pass over more positions nearer it. Where the native step runs,
    also the engine's one-call plain step and greedy verify pass (native_ratio): the costs a greedy round
    of prompt lookup actually weighs against each other.

    seq: a sequence that holds the prompt already, with room for k+2 more (nothing is committed to it):
    one prefill then serves every K, which on a large model costs more than the passes measured."""
    import torch

    from completiond.engine import native as native_mod

    one, many = [], []
    with torch.inference_mode():
        if seq is None:
            seq = engine.new_sequence(len(prompt) + k + 2)
            engine.prefill(seq, prompt, None)
        x1, xk = engine.embed(prompt[-1:]), engine.embed(prompt[-(k + 1) :])
        for _ in range(3):  # warm-up
            engine.head(engine.run_layers(xk, 0, engine.num_layers, seq.length, seq))
            engine.head(engine.run_layers(x1, 0, engine.num_layers, seq.length, seq))
        synchronize(engine.device)
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.head(engine.run_layers(x1, 0, engine.num_layers, seq.length, seq))
            synchronize(engine.device)  # an accelerator queues the pass: time its end, not its launch
            t1 = time.perf_counter()
            engine.head(engine.run_layers(xk, 0, engine.num_layers, seq.length, seq))
            synchronize(engine.device)
            t2 = time.perf_counter()
            one.append(t1 - t0)
            many.append(t2 - t1)
    step_s, pass_s = statistics.median(one), statistics.median(many)
    context = seq.length
    native = engine.fwd.native
    extra = {}
    if native is not None and k + 1 <= native_mod.MAX_ROWS:
        # What a greedy round really pays on the native step: a plain step and a verify pass each in one
        # call (embed, layers, head, argmax), with no Python between their parts (decode.speculative_round)
        L, head_w, head_b = engine.num_layers, engine.fwd.head_w, engine.fwd.head_b
        ids = prompt[-(k + 1) :]
        n_one, n_many = [], []
        with torch.inference_mode():
            for i in range(repeats + 3):
                t0 = time.perf_counter()
                native.draft_greedy(prompt[-1], L, context, 1, 0.0, seq, head_w, head_b, None, engine.eos_ids_tensor)
                t1 = time.perf_counter()
                native.verify_greedy(ids, L, context, seq, head_w, head_b)
                t2 = time.perf_counter()
                if i >= 3:  # the first three warm up
                    n_one.append(t1 - t0)
                    n_many.append(t2 - t1)
        extra = {
            "native_step_ms": 1000 * statistics.median(n_one),
            "native_pass_ms": 1000 * statistics.median(n_many),
            "native_ratio": statistics.median(n_many) / statistics.median(n_one),
        }
    step_f, pass_f = pass_flops(engine, 1, context), pass_flops(engine, k + 1, context)
    return {
        "k": k,
        "ratio": pass_s / step_s,
        "step_ms": 1000 * step_s,
        "pass_ms": 1000 * pass_s,
        **extra,
        "context": context,
        "step_mflops": step_f / 1e6,
        "pass_mflops": pass_f / 1e6,
        "step_gflops": step_f / step_s / 1e9,
        "pass_gflops": pass_f / pass_s / 1e9,
    }


def draft_cost_by_exit(engine, prompt: list[int], k: int = 4, repeats: int = 20) -> list[dict]:
    """Per exit layer E: one greedy early-exit draft step (layers < E and the draft head, as the engine
    drafts: native where it can, the calibrated draft vocabulary) ÷ one plain greedy step, both at the
    same context; a draft of k tokens timed beside a plain step, medians of `repeats`."""
    import torch

    from completiond.engine.draft import EarlyExitDraft
    from completiond.engine.engine import sampling

    warp = sampling.Warp()
    seq = engine.new_sequence(len(prompt) + k + 2)
    out = []
    with torch.inference_mode():
        engine.prefill(seq, prompt[:-1], None)
        n0, pending = seq.length, prompt[-1]

        def plain() -> float:
            t = time.perf_counter()
            engine.plain_step(seq, pending, [], warp, None, None)
            synchronize(engine.device)
            dt = time.perf_counter() - t
            seq.crop(n0)  # the step committed its token: back to the same context
            return dt

        for e in range(1, engine.num_layers):
            draft = EarlyExitDraft(engine, e)

            def drafted(draft: EarlyExitDraft = draft) -> float:
                t = time.perf_counter()
                got = draft.propose(seq, pending, [], k, 0.0, warp, None, None)  # writes scratch K/V only
                synchronize(engine.device)
                return (time.perf_counter() - t) / max(1, len(got.tokens))

            for _ in range(3):  # warm-up
                plain(), drafted()
            steps, drafts = [], []
            for _ in range(repeats):
                steps.append(plain())
                drafts.append(drafted())
            out.append(
                {
                    "exit_layer": e,
                    "cost": statistics.median(drafts) / statistics.median(steps),
                    "draft_vocab": 0 if engine.draft_ids is None else int(engine.draft_ids.numel()),
                    "repeats": repeats,
                    "draft_ms": 1000 * statistics.median(drafts),
                    "step_ms": 1000 * statistics.median(steps),
                }
            )
    return out


def measure(
    engine,
    files,
    n_prompts: int,
    max_tokens: int,
    exit_layer: int | None,
    draft_k: int | None,
    skip_hf: bool,
    log=print,
    repeats: int = 5,
    workload: str = "prompts",
) -> dict:
    """Every method warmed up, then timed `repeats` times in rotating order over the same prompts.

    Per repeat and method: decode milliseconds per token over all prompts (ours: the engine's own
    decode clock, after prefill; transformers: generate(N) minus generate(1), i.e. N-1 decode
    steps) and end-to-end tokens/s. Reported: medians with min, max and spread; every ratio is
    of decode-only medians.
    """
    import torch

    from completiond.engine import native as native_mod
    from completiond.engine.engine import CancelToken, SamplingParams
    from completiond.engine.lookup import OutputHistory

    # Where every pass runs natively (bf16 or int8 weights, or a model whose packed panels are its only
    # weights), the module's own tensors are not the model decoded: transformers' baselines and the
    # PyTorch path would run other values (or none at all).
    native_only = engine.fwd.native_all
    if native_only and not skip_hf:
        log("transformers baselines skipped: every pass runs the native step on its own weights")
        skip_hf = True
    if workload == "edit":
        prompts = edit_prompts(engine, files, n_prompts)
    else:
        prompts = [engine.tokenizer(t).input_ids for t in prompt_texts(files, n_prompts)]
    cal = engine.calibration
    E = exit_layer or cal.exit_layer
    K = draft_k or cal.draft_k
    threshold = cal.threshold
    plain_p = SamplingParams(max_tokens=max_tokens, speculative=False, ignore_eos=True)
    # the early-exit rows are early exit whatever draft the calibration chose (the other drafts get rows below)
    spec_p = SamplingParams(
        max_tokens=max_tokens, exit_layer=E, draft_k=K, ignore_eos=True, prompt_lookup=False, draft=DraftKind.EARLY_EXIT
    )
    lookup_p = SamplingParams(
        max_tokens=max_tokens, exit_layer=E, draft_k=K, ignore_eos=True, prompt_lookup=True, draft=DraftKind.EARLY_EXIT
    )
    # transformers' own self-speculation with our E, K and threshold (a constant K, as ours at most drafts K)
    hf_ee = {
        "assistant_early_exit": E,
        "num_assistant_tokens": K,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": threshold,
    }
    if not skip_hf:
        _patch_hf_early_exit()
    reference = None if skip_hf else _transformers_model(engine)

    # Each of our methods drafts from its own output history, emptied at every repeat: a repeat replays
    # the prompts as one editing session would, and never sees a previous repeat's outputs.
    histories: list[OutputHistory] = []

    def ours(params):
        history = OutputHistory()
        histories.append(history)

        def go(ids):
            gen, total = _timed(engine, ids, params, history=history)
            return gen.tokens, gen.stats.decode_ms / 1000, total, gen.stats

        return go

    def hf(early_exit):
        def go(ids):
            tokens, total = _hf_generate(reference, ids, max_tokens, early_exit)
            _, first = _hf_generate(reference, ids, 1, early_exit)
            # decode time of the N-1 tokens after the first, scaled to N so per-token figures compare
            return tokens, max(total - first, 1e-9) * max_tokens / max(max_tokens - 1, 1), total, None

        return go

    def torch_path(go):
        """The same method with the native step switched off: what it gains, side by side."""

        def run_(ids):
            saved, engine.fwd.native = engine.fwd.native, None
            try:
                return go(ids)
            finally:
                engine.fwd.native = saved

        return run_

    methods = {"plain": ours(plain_p), "spec": ours(spec_p), "spec_lookup": ours(lookup_p)}
    if engine.fwd.native is not None and not native_only:
        methods["plain_torch"] = torch_path(ours(plain_p))
    # The trained drafts the engine has (exit adapter, Medusa heads, a draft model), each alone and after
    # prompt lookup: label and method per name.
    # prompt lookup with no model draft behind it: a plain step where the n-gram index finds nothing
    methods["spec_lookup_alone"] = ours(
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_lookup=True, draft=DraftKind.NONE)
    )
    labels = {
        "spec": f"early exit E={E} K<={K}",
        "spec_lookup": f"prompt lookup, else early exit E={E} K<={K}",
        "spec_lookup_alone": "prompt lookup alone, else a plain step",
    }
    extra: list[tuple[DraftKind, str]] = []
    if engine.exit_adapter is not None:
        extra.append((DraftKind.ADAPTER, f"exit adapter E={engine.exit_adapter.exit_layer} K<={K}"))
    if engine.medusa is not None:
        extra.append(
            (DraftKind.MEDUSA, f"{engine.medusa.num_heads} Medusa heads, {len(engine.medusa.tree) + 1}-node tree")
        )
    if engine.draft_model is not None:
        extra.append((DraftKind.DRAFT_MODEL, f"draft model {engine.draft_model.name} K<={K}"))
    for kind, label in extra:
        for lk in (False, True):
            name = f"spec_{kind.value}" + ("_lookup" if lk else "")
            methods[name] = ours(
                SamplingParams(max_tokens=max_tokens, draft_k=K, ignore_eos=True, prompt_lookup=lk, draft=kind)
            )
            labels[name] = (
                "prompt lookup + " if lk and kind is DraftKind.MEDUSA else "prompt lookup, else " if lk else ""
            ) + label
    if not skip_hf:
        methods.update(hf=hf(None), hf_early_exit=hf(hf_ee))
    names = list(methods)
    for name in names:  # warm-up: first calls pay for allocator and kernel selection
        methods[name](prompts[0][:64])

    decode_ms: dict[str, list[float]] = {n: [] for n in names}  # per repeat: ms per generated token
    e2e_tps: dict[str, list[float]] = {n: [] for n in names}
    outputs: dict[str, list] = {n: [None] * len(prompts) for n in names}
    spec_stats = []
    draft_stats: dict[str, list] = {n: [] for n in labels}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no method always runs first
        dec = {n: 0.0 for n in names}
        tot = {n: 0.0 for n in names}
        for history in histories:
            history.clear()
        for i, ids in enumerate(prompts):
            for name in order:
                tokens, d, total, stats = methods[name](ids)
                dec[name] += d
                tot[name] += total
                outputs[name][i] = tokens
                if name == "spec" and r == 0:
                    spec_stats.append(stats)
                if name in draft_stats and r == 0:
                    draft_stats[name].append(stats)
        n_tokens = max_tokens * len(prompts)
        for name in names:
            decode_ms[name].append(1000 * dec[name] / n_tokens)
            e2e_tps[name].append(n_tokens / tot[name])
        log(f"repeat {r + 1}/{repeats}: " + ", ".join(f"{n} {decode_ms[n][-1]:.2f} ms/token" for n in names))
    identical = all(outputs[n] == outputs["plain"] for n in names)

    drafted = sum(s.drafted for s in spec_stats)
    accepted = sum(s.accepted for s in spec_stats)
    rejected = sum(s.rejected for s in spec_stats)
    rounds = sum(s.rounds for s in spec_stats)
    generated = sum(s.generated_tokens for s in spec_stats)
    alpha = accepted / (accepted + rejected) if accepted + rejected else 0.0  # per token, as Stats.alpha
    mean_k = drafted / rounds if rounds else 0.0
    med = {n: statistics.median(v) for n, v in decode_ms.items()}
    plain_token_ms = med["plain"]
    draft_step_ms = sum(s.draft_ms for s in spec_stats) / drafted if drafted else 0.0
    verify_pass_ms = sum(s.verify_ms for s in spec_stats) / rounds if rounds else 0.0
    c = draft_step_ms / plain_token_ms if plain_token_ms else 0.0
    expected = (1 - alpha ** (mean_k + 1)) / (1 - alpha) if alpha < 1 else mean_k + 1
    predicted = expected / (1 + mean_k * c)
    vc = verify_cost(engine, prompts[0], 3)
    vc_by_k = [verify_cost(engine, prompts[0], k, repeats=20) for k in range(1, 9)]
    costs_by_exit = draft_cost_by_exit(engine, prompts[0])
    peak = matmul_peak_gflops()

    # time to first token: cold 2,000-token prompt, then the same text plus one character (medians)
    text = long_text(files, engine.tokenizer, 2000)
    cold_ids = engine.tokenizer(text).input_ids
    warm_ids = engine.tokenizer(text + "x").input_ids
    one = SamplingParams(max_tokens=1, exit_layer=E, draft_k=K)
    colds, warms = [], []
    for _ in range(max(3, repeats // 2)):
        cold, t_cold = _timed(engine, cold_ids, one, cold=True)
        warm, t_warm = _timed(engine, warm_ids, one, cold=False)
        colds.append(t_cold)
        warms.append(t_warm)
    t_cold, t_warm = statistics.median(colds), statistics.median(warms)

    # cancel latency: cancel a long generation mid-flight, time until it returns
    cancel = CancelToken()
    result = {}
    long_p = SamplingParams(
        max_tokens=min(512, engine.max_context - len(prompts[0]) - 1), exit_layer=E, draft_k=K, ignore_eos=True
    )

    def worker():
        result["gen"] = engine.generate(prompts[0], long_p, cancel=cancel, history=None)
        result["end"] = time.perf_counter()

    engine.cache.clear()
    th = threading.Thread(target=worker)
    th.start()
    time.sleep(0.3)
    t_cancel = time.perf_counter()
    cancel.cancel()
    th.join()
    cancel_ms = 1000 * (result["end"] - t_cancel)
    g = result["gen"]
    round_ms = g.stats.decode_ms / g.stats.rounds if g.stats.rounds else 0.0

    def draft_row(name: str, label: str) -> dict:
        ss = draft_stats[name]
        acc, rej = sum(s.accepted for s in ss), sum(s.rejected for s in ss)
        rounds_ = sum(s.rounds for s in ss)
        dr = sum(s.drafted for s in ss)
        return {
            "method": name,
            "draft": label,
            "alpha": acc / (acc + rej) if acc + rej else 0.0,
            "tokens_per_round": sum(s.generated_tokens for s in ss) / rounds_ if rounds_ else 0.0,
            "draft_cost": (sum(s.draft_ms for s in ss) / dr) / med["plain"] if dr and med["plain"] else 0.0,
            "lookup_rounds": sum(s.lookup_rounds for s in ss),
            "rounds": rounds_,
            "drafted": dr,
            "accepted": acc,
            "generated": sum(s.generated_tokens for s in ss),
            # of the lookup rounds, those drafted from the repeat's earlier outputs, and what they committed
            "history_rounds": sum(s.history_rounds for s in ss),
            "history_accepted": sum(s.history_accepted for s in ss),
            "lookup_alpha": (
                sum(s.lookup_accepted for s in ss)
                / max(1, sum(s.lookup_accepted for s in ss) + sum(s.lookup_rejected for s in ss))
            ),
            "draft_gain": med["plain"] / med[name] if med[name] else None,
            "greedy_identical": outputs[name] == outputs["plain"],
        }

    def ratio(a, b):
        """How much faster a is than b, from decode ms per token medians."""
        return med[b] / med[a] if a in med and b in med and med[a] else None

    return {
        "model": engine.name,
        "model_id": engine.model_id,
        "device": engine.device,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "workload": workload,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "repeats": repeats,
        "exit_layer": E,
        "draft_k": K,
        "draft_threshold": threshold,
        "layers": engine.num_layers,
        "method": "decode-only ms/token per repeat (ours: after prefill; transformers: generate(N) - generate(1)); "
        "medians of interleaved repeats; ratios of medians",
        "hf_early_exit_settings": hf_ee if not skip_hf else None,
        "tokens_per_s": {n: statistics.median(v) for n, v in e2e_tps.items()},  # end to end, prefill included
        "decode_tokens_per_s": {n: 1000 / m for n, m in med.items()},
        "decode_ms_per_token": {n: _spread(v) for n, v in decode_ms.items()},
        "spread": {n: _spread(v)["spread"] for n, v in decode_ms.items()},
        "draft_gain": ratio("spec", "plain"),
        "drafts": [draft_row(name, label) for name, label in labels.items()],
        "best_draft_gain": max(ratio(name, "plain") or 0 for name in labels),
        "spec_vs_plain": ratio("spec", "plain"),
        "spec_vs_hf": ratio("spec", "hf"),
        "spec_vs_hf_early_exit": ratio("spec", "hf_early_exit"),
        "plain_vs_hf": ratio("plain", "hf"),
        # engine/native: one call per layer range instead of PyTorch's ~22 ops per layer (plain_torch: without it)
        "native_step": {
            "used": engine.fwd.native is not None,
            "reason": engine.fwd.native_reason,
            "weights": engine.weights,
            "weights_in_use": engine.weights_in_use(),
            "kernel": native_mod.kernel_name(),
        },
        "native_gain": ratio("plain", "plain_torch"),
        "greedy_identical": identical,
        "alpha": alpha,
        "mean_drafted_per_round": mean_k,
        "mean_accepted_per_round": generated / rounds if rounds else 0.0,
        "predicted_speedup": predicted,
        "draft_cost_ratio": c,
        "plain_ms_per_token": plain_token_ms,
        "draft_ms_per_step": draft_step_ms,
        "verify_ms_per_pass": verify_pass_ms,
        "verify_cost_ratio": vc["ratio"],
        "verify_cost": vc,
        "verify_cost_by_k": [
            {
                "k": v["k"],
                "ratio": v["ratio"],
                "pass_ms": v["pass_ms"],
                "pass_gflops": v["pass_gflops"],
                "native_ratio": v.get("native_ratio"),
            }
            for v in vc_by_k
        ],
        # one large float32 matmul on this machine, the engine's threads: the rate verify passes approach
        "matmul_peak_gflops": peak,
        # one drafted token at each exit ÷ one plain step (the model card's measured draft cost)
        "draft_cost_by_exit": costs_by_exit,
        "ttft_cold_ms": 1000 * t_cold,
        "ttft_warm_ms": 1000 * t_warm,
        "ttft_prompt_tokens": len(cold_ids),
        "warm_reused_tokens": warm.stats.reused_tokens,
        "warm_cold_ttft_ratio": t_warm / t_cold,
        "cancel_ms": cancel_ms,
        "cancel_round_ms": round_ms,
        "cancel_within_one_round": cancel_ms <= max(round_ms, 1e-9) * 1.0 + 1.0,
        "cancelled_tokens": len(g.tokens),
    }


def run(args: argparse.Namespace) -> int:
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    if args.quality:
        from completiond.commands.bench_quality import measure_quality
        from completiond.engine.engine import EngineError

        try:
            result = measure_quality(
                args.model,
                ["bf16", "int8"],
                args.quality_windows,
                args.quality_positions,
                device=args.device if args.device != "auto" else "cpu",
                log=log,
            )
        except EngineError as exc:
            print(f"completiond bench: {exc}", file=sys.stderr)
            return 1
    elif args.editing:
        from completiond.commands.bench_editing import run_editing_bench

        try:
            result = run_editing_bench(
                args.model,
                [Path(f) for f in args.files] if args.files else None,
                file_count=args.file_count,
                rest_notes=args.rest_notes == "on",
                **({} if args.rest_delay_ms is None else {"rest_delay_s": args.rest_delay_ms / 1000}),
                rounds=args.rounds,
                jumps=args.jumps,
                weights=args.weights if args.weights != "auto" else None,
                threads=args.threads,
                prefetch=None if args.prefetch is None else args.prefetch == "on",
                settings=_editing_settings(args),
                progress=log,
            )
        except (CompletionError, FileNotFoundError) as exc:
            print(f"completiond bench: {exc}", file=sys.stderr)
            return 1
    elif args.typing:
        from completiond.commands.bench_typing import run_typing_bench

        result = run_typing_bench(
            model=args.model,
            file=Path(args.file) if args.file else None,
            keystrokes=args.keystrokes,
            log=log,
            workspace=Path(args.workspace) if args.workspace else None,
            settings={"contextRetrieval": args.retrieval} if args.retrieval else None,
        )
        if args.llama_server or args.endpoint:
            try:
                result = _typing_remote(args, result, log)
            except CompletionError as exc:
                print(f"completiond bench: {exc}", file=sys.stderr)
                return 1
    else:
        from completiond.engine.engine import Engine, EngineError

        try:
            engine = Engine.load(
                args.model, device=args.device, dtype=args.dtype, draft_model=args.draft_model, weights=args.weights
            )
        except EngineError as exc:
            print(f"completiond bench: {exc}", file=sys.stderr)
            return 1
        files = [Path(f) for f in args.files] if args.files else None
        log(
            f"model {engine.name} on {engine.device}, {engine.num_layers} layers, calibration: {engine.calibration.source}"
        )
        result = measure(
            engine,
            files,
            args.prompts,
            args.max_tokens,
            args.exit_layer,
            args.draft_k,
            args.skip_hf,
            log,
            repeats=args.repeats,
            workload=args.workload,
        )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return 0


def _typing_remote(args: argparse.Namespace, local: dict, log) -> dict:
    """The same typing replay against a server: llama.cpp's on this machine (--llama-server) and/or
    --endpoint. The local engine's figures stay at the top level; each server's go under its name, and
    `typing_p50_ms` / `typing_p95_ms` of every run side by side under `compare`."""
    import tempfile

    from completiond.commands.bench_typing import run_typing_bench

    out = dict(local)
    compare = {"local": {"p50_ms": local["typing_p50_ms"], "p95_ms": local["typing_p95_ms"]}}
    file = Path(args.file) if args.file else None
    if args.llama_server:
        from completiond.backends.llama_server import ALIAS, serve_bundled

        with tempfile.TemporaryDirectory(prefix="completiond-llama-") as folder:
            server = serve_bundled(Path(folder))
            try:
                log(f"llama-server at {server.url} serving the bundled model as GGUF")
                run = run_typing_bench(
                    file=file,
                    keystrokes=args.keystrokes,
                    log=log,
                    settings={"backend": "openai", "endpoint": server.url, "endpointModel": ALIAS},
                )
            finally:
                server.stop()
        out["llama_server"] = run
        compare["llama_server"] = {"p50_ms": run["typing_p50_ms"], "p95_ms": run["typing_p95_ms"]}
    if args.endpoint:
        run = run_typing_bench(
            file=file,
            keystrokes=args.keystrokes,
            log=log,
            settings={"backend": args.backend, "endpoint": args.endpoint, "endpointModel": args.endpoint_model},
        )
        out["endpoint"] = run
        compare["endpoint"] = {"p50_ms": run["typing_p50_ms"], "p95_ms": run["typing_p95_ms"], "url": args.endpoint}
    out["compare"] = compare
    return out


def _print_table(r: dict) -> None:
    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:.3f}"
        if isinstance(v, dict):
            return ", ".join(f"{k} {fmt(x)}" for k, x in v.items())
        return str(v)

    for key, value in r.items():
        print(f"{key:>26}: {fmt(value)}")
