"""`completiond bench --quality`: what a weight format costs in quality, formats side by side in one run.

For the model (default: the bundled one) and each weight format: held-out loss (mean next-token
cross-entropy, nats, on the model card's fixed 512-token windows of the held-out stdlib files) and
next-line exact match (the model card's task: cursor at the end of a held-out line, greedy, left to
right and FIM), computed by the engine itself with the weights loaded in that format (every pass in
native-step chunks, as decoding runs them), beside the float32 reference: transformers' forward on
the checkpoint's values. The bundled checkpoint is stored in bf16, so its float32 and bf16 rows hold
the same values (they differ only in summation order); int8 is the format that changes them.
"""

from __future__ import annotations

import math
import time

# The native step's widest pass: chunks this size keep every pass of the loss on it, as decoding's are.
CHUNK = 16


def engine_loss(engine, windows) -> float:
    """Mean next-token cross-entropy of the engine over windows [N, T+1] (inputs x, targets y)."""
    import torch
    import torch.nn.functional as F

    x, y = windows
    total = 0.0
    for i in range(x.shape[0]):
        ids = x[i].tolist()
        seq = engine.new_sequence(len(ids))
        logits = []
        with torch.inference_mode():
            for start in range(0, len(ids), CHUNK):
                chunk = ids[start : start + CHUNK]
                h = engine.run_layers(engine.embed(chunk), 0, engine.num_layers, start, seq)
                seq.commit(chunk)
                logits.append(engine.head(h).float())
        total += F.cross_entropy(torch.cat(logits), y[i].to(engine.device)).item()
    return total / x.shape[0]


def hf_loss(model, windows) -> float:
    import torch
    import torch.nn.functional as F

    x, y = windows
    with torch.inference_mode():
        return (
            sum(
                F.cross_entropy(model(input_ids=x[i : i + 1]).logits[0].float(), y[i]).item() for i in range(x.shape[0])
            )
            / x.shape[0]
        )


def engine_greedy(engine, ids, max_new, stop_ids=(), stop_fn=None, tok=None):
    """model_card.greedy's contract on the engine's plain greedy decoding: the tokens up to (not
    including) a stop id, or through the token after which stop_fn(decoded text) first holds."""
    from completiond.engine.engine import SamplingParams

    engine.cache.clear()  # each prompt cold: no reuse between formats or positions
    out = engine.generate(
        list(ids), SamplingParams(max_tokens=max_new, speculative=False, ignore_eos=True), history=None
    ).tokens
    for i, t in enumerate(out):
        if t in stop_ids:
            return out[:i], True
        if stop_fn is not None and stop_fn(tok.decode(out[: i + 1])):
            return out[: i + 1], False
    return out, False


def measure_quality(
    model: str | None, formats: list[str], windows: int = 48, positions: int = 200, device: str = "cpu", log=print
) -> dict:
    """{format: {heldout_loss, next_line: {left_to_right, fim_spm}}} plus the costs against the reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from completiond.engine.engine import Engine, EngineError
    from completiond.models import corpus, default_model_dir
    from completiond.models.training.model_card import greedy, next_line
    from completiond.models.training.train_default import heldout_windows

    files = corpus.heldout_files()
    rows: dict[str, dict] = {}
    windows_xy = None
    for fmt in ["float32"] + list(formats):
        t0 = time.perf_counter()
        if fmt == "float32":
            directory = model or default_model_dir()
            ref = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
            tok = AutoTokenizer.from_pretrained(directory)
            windows_xy = heldout_windows(tok, files, 512, windows)
            loss = hf_loss(ref, windows_xy)
            nl, n_nl, _ = next_line(ref, tok, files, positions, decode=greedy)
            in_use = "float32 (transformers, the reference)"
            del ref
        else:
            engine = Engine.load(model, device=device, weights=fmt)
            if engine.weights_in_use() != fmt:  # the native step could not be built: these are not fmt's values
                raise EngineError(
                    f"weights {fmt}: the engine runs {engine.weights_in_use()} ({engine.fwd.native_reason})"
                )
            tok = engine.tokenizer
            loss = engine_loss(engine, windows_xy)
            nl, n_nl, _ = next_line(engine, tok, files, positions, decode=engine_greedy)
            in_use = engine.weights_in_use()
            del engine
        rows[fmt] = {
            "weights_in_use": in_use,
            "heldout_loss": round(loss, 4),
            "next_line_exact_match": {k: round(v["exact_match"], 4) for k, v in nl.items() if k != "baseline"},
            "next_line_char_similarity": {k: round(v["char_similarity"], 4) for k, v in nl.items() if k != "baseline"},
            "seconds": round(time.perf_counter() - t0, 1),
        }
        log(
            f"{fmt:>8} ({in_use}): held-out loss {loss:.4f} nats, next-line exact match "
            f"{rows[fmt]['next_line_exact_match']}"
        )
    ref = rows["float32"]["heldout_loss"]
    for fmt, row in rows.items():
        if fmt != "float32":
            row["loss_cost_vs_float32_nats"] = round(row["heldout_loss"] - ref, 4)
    out = {
        "model": model or "bundled",
        "heldout_windows": windows,
        "window_tokens": 512,
        "next_line_positions": n_nl,
        "formats": rows,
    }
    if "int8" in rows:
        base = rows.get("bf16", rows["float32"])["heldout_loss"]
        out["int8_loss_cost_nats"] = round(rows["int8"]["heldout_loss"] - base, 4)
        out["int8_loss_cost_against"] = "bf16" if "bf16" in rows else "float32"
        out["int8_within_0.02_nats"] = not math.isnan(out["int8_loss_cost_nats"]) and out["int8_loss_cost_nats"] <= 0.02
    return out
