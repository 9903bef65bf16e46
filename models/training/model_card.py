"""Measure the bundled model on held-out stdlib code and write its MODEL_CARD.md.

    python -m completiond.models.training.model_card [--model DIR] [--quick]

Everything is deterministic (fixed seeds, greedy decoding, fp32 evaluation) and
uses only held-out files (models/corpus.py). Writes into the model directory:

* MODEL_CARD.md          the card
* loss_curves.png        training / held-out loss per exit layer (from --train-log: the run's
                         train_log.jsonl, which stays in the run directory, not the model's)
* eval_results.json      every number in the card, machine-readable

Conventions: "exit layer l" (1-based) means the hidden state after the first l
decoder layers, passed through the model's own final RMSNorm and tied LM head;
exit layer L (the last) is the full model.

Metrics:

* held-out loss per exit layer: mean next-token cross-entropy on fixed 512-token
  windows of the held-out stream;
* greedy acceptance alpha per exit layer: for held-out prompts, the full model's
  greedy continuation is generated; along it, alpha is the fraction of positions
  where the exit layer's argmax equals the full model's argmax. With K=4 the
  self-speculative rounds are simulated exactly (greedy): a round drafts up to 4
  tokens from the exit layer, accepts the longest matching prefix, then the full
  model adds one token; we report mean accepted drafts per round and tokens per
  round (accepted + 1);
* next-line exact match: cursor at the end of a held-out line (before its newline),
  greedy completion; the line after the newline is compared with the real next line
  (trailing whitespace ignored), both left-to-right (prefix only) and with the
  rest of the file as FIM suffix (SPM); baseline: the previous line's indentation
  followed by its first token;
* FIM function bodies: held-out functions with the body removed, SPM and PSM
  prompts; how often generation ends with <|endoftext|> within 128 tokens, and
  exact match of the body;
* held-out packages: the same per-exit loss on the stream of the packages held out
  whole (models/training/data_prep.py), read from the prepared data (--data, default
  runs/data/) when it was tokenised with this model's tokenizer;
* draft cost per exit: FLOPs of the first l layers plus the LM head over a full
  step, and, with --bench (a `completiond bench --json` output of this model), the
  cost the engine measured per exit (draft_cost_by_exit). --from-results rewrites
  the card from eval_results.json without evaluating again.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import inspect
import json
import random
import re
import time
from pathlib import Path
from typing import Any

EOT, FILE_SEP = "<|endoftext|>", "<|file_sep|>"
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"


# ----------------------------------------------------------------------------- prompts (shared with tests)

def psm_prompt(prefix: str, suffix: str) -> str:
    return f"{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"


def spm_prompt(prefix: str, suffix: str) -> str:
    return f"{FIM_PREFIX}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}{prefix}"


def encode_fim(tok, prefix: str, suffix: str, order: str, max_prefix: int = 320, max_suffix: int = 128) -> list[int]:
    """Token ids of a FIM prompt; prefix and suffix are tokenized separately (as in training)
    and truncated to keep the end of the prefix and the start of the suffix."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE)}
    p = tok(prefix, add_special_tokens=False)["input_ids"][-max_prefix:] if prefix else []
    s = tok(suffix, add_special_tokens=False)["input_ids"][:max_suffix] if suffix else []
    if order == "spm":
        return [ids[FIM_PREFIX], ids[FIM_SUFFIX]] + s + [ids[FIM_MIDDLE]] + p
    return [ids[FIM_PREFIX]] + p + [ids[FIM_SUFFIX]] + s + [ids[FIM_MIDDLE]]


def greedy(model, input_ids: list[int], max_new: int, stop_ids=(), stop_fn=None, tok=None):
    """Plain greedy decoding with the HF KV cache. Returns (new_ids, stopped_by_token)."""
    import torch

    out: list[int] = []
    x = torch.tensor([input_ids])
    past = None
    # transformers 5.2x names the KV cache `cache` (past_key_values is deprecated, to go in 5.40); 4.x does not
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        for _ in range(max_new):
            r = model(input_ids=x, use_cache=True, **{kw: past})
            past = getattr(r, kw)
            nxt = int(r.logits[0, -1].argmax())
            if nxt in stop_ids:
                return out, True
            out.append(nxt)
            if stop_fn is not None and stop_fn(tok.decode(out)):
                break
            x = torch.tensor([[nxt]])
    return out, False


# ----------------------------------------------------------------------------- metrics

def exit_logits_all(model, ids):
    """Logits at every exit layer for a (1, T) tensor: list of (T, V) tensors, last = full model."""
    from .train_default import forward_all_exits

    with __import__("torch").no_grad():
        final, exits = forward_all_exits(model, ids, None, slice(None))
        out = [model.lm_head(model.model.norm(h))[0] for h in exits]
    return out + [final[0]]


def heldout_loss(model, tok, files, seq_len: int, count: int):
    import torch.nn.functional as F

    from .train_default import heldout_windows

    x, y = heldout_windows(tok, files, seq_len, count)
    sums = None
    for i in range(x.shape[0]):
        lg = exit_logits_all(model, x[i:i + 1])
        v = [F.cross_entropy(l.float(), y[i]).item() for l in lg]
        sums = v if sums is None else [a + b for a, b in zip(sums, v)]
    if sums is None:
        raise ValueError("no held-out windows")
    return [s / x.shape[0] for s in sums]


def acceptance(model, tok, files, n_prompts: int, prompt_len: int, gen_len: int, K: int = 4, seed: int = 7):
    import torch

    rng = random.Random(seed)
    sep = tok.convert_tokens_to_ids(FILE_SEP)
    streams = [tok(f.read_text(), add_special_tokens=False)["input_ids"] for f in files]
    streams = [s for s in streams if len(s) > prompt_len + 8]
    matches: list[list[bool]] | None = None
    n_layers = model.config.num_hidden_layers
    rounds = [[0, 0] for _ in range(n_layers)]  # per layer: (rounds, accepted)
    for _ in range(n_prompts):
        s = rng.choice(streams)
        start = rng.randrange(0, len(s) - prompt_len)
        prompt = s[start:start + prompt_len]
        cont, _ = greedy(model, prompt, gen_len, stop_ids=(sep,))
        if len(cont) < 2:
            continue
        full = torch.tensor([prompt + cont])
        lgs = exit_logits_all(model, full)
        # predictions for positions that produce cont[0..n-1]
        sl = slice(len(prompt) - 1, len(prompt) - 1 + len(cont))
        target = lgs[-1][sl].argmax(-1)
        m = [(lg[sl].argmax(-1) == target).tolist() for lg in lgs]
        if matches is None:
            matches = [[] for _ in lgs]
        for layer, row in enumerate(m):
            matches[layer].extend(row)
            i = 0
            while i < len(row):
                acc = 0
                while acc < K and i + acc < len(row) and row[i + acc]:
                    acc += 1
                rounds[layer][0] += 1
                rounds[layer][1] += acc
                i += acc + 1
    if matches is None:
        raise ValueError(f"none of {n_prompts} prompts continued for two tokens")
    alpha = [sum(r) / len(r) for r in matches]
    per_round = [a / max(1, r) for r, a in rounds]
    return alpha, per_round, len(matches[0])


_FIRST_TOKEN = re.compile(r"\w+|[^\w\s]")


def baseline_line(prev_line: str) -> str:
    indent = prev_line[: len(prev_line) - len(prev_line.lstrip())]
    body = prev_line.strip()
    m = _FIRST_TOKEN.match(body)
    return indent + (m.group(0) if m else "")


def _line_done(text: str) -> bool:
    """Stop once the text after the cursor holds a whole next line (or went wrong)."""
    if not text.startswith("\n"):
        return "\n" in text
    return "\n" in text[1:]


def _next_line_of(text: str) -> str | None:
    """The predicted next line: the completion must start with the newline that ends the cursor's line."""
    if not text.startswith("\n"):
        return None
    return text[1:].split("\n")[0].rstrip()


def next_line(model, tok, files, n: int, seed: int = 11, max_prefix: int = 320, max_new: int = 48, decode=greedy):
    """Cursor at the end of a held-out line (before its newline); predict the whole next line.

    decode(model, ids, max_new, stop_ids=, stop_fn=, tok=) -> (new ids, stopped): `greedy` here; the
    weight-format comparison (`completiond bench --quality`) passes the engine's plain greedy decoding.

    The cursor sits at a token boundary the model saw in training (the newline is tokenized together
    with the next line's indentation, so a prompt ending in a bare newline would be out of distribution:
    editors that put the cursor at column 0 need token healing, which the engine does)."""
    rng = random.Random(seed)
    texts = [f.read_text() for f in files]
    cands = []
    for ti, t in enumerate(texts):
        lines = t.split("\n")
        for li in range(1, len(lines) - 1):
            if lines[li].strip() and lines[li - 1].strip():
                cands.append((ti, li))
    picks = sorted(rng.sample(cands, min(n, len(cands))))
    res = {"left_to_right": [0, 0.0], "fim_spm": [0, 0.0], "baseline": [0, 0.0]}
    examples: list[dict[str, Any]] = []
    eot = tok.convert_tokens_to_ids(EOT)
    for ti, li in picks:
        lines = texts[ti].split("\n")
        prefix = "\n".join(lines[:li])
        suffix = "\n" + "\n".join(lines[li + 1:])
        truth = lines[li].rstrip()
        ids = tok(prefix, add_special_tokens=False)["input_ids"][-max_prefix:]
        g1, _ = decode(model, ids, max_new, stop_ids=(eot,), stop_fn=_line_done, tok=tok)
        l2r = _next_line_of(tok.decode(g1))
        g2, _ = decode(model, encode_fim(tok, prefix, suffix, "spm", max_prefix), max_new, stop_ids=(eot,),
                       stop_fn=_line_done, tok=tok)
        fim = _next_line_of(tok.decode(g2))
        base = baseline_line(lines[li - 1]).rstrip()
        for key, pred in (("left_to_right", l2r), ("fim_spm", fim), ("baseline", base)):
            res[key][0] += int(pred == truth)
            res[key][1] += difflib.SequenceMatcher(None, pred or "", truth).ratio()
        if len(examples) < 8:
            examples.append({"file": files[ti].relpath, "line": li + 1, "truth": truth, "left_to_right": l2r or "",
                             "fim_spm": fim or "", "baseline": base})
    k = len(picks)
    return {key: {"exact_match": v[0] / k, "char_similarity": v[1] / k} for key, v in res.items()}, k, examples


def small_functions(files, max_body_lines: int = 8, limit: int = 60, seed: int = 5):
    """(relpath, prefix, middle, suffix) for held-out functions whose body is a few lines.

    The cut is at the end of the line before the body (prefix ends with the def or docstring line, no
    newline); the middle is "\n" + the body lines without their final newline; the suffix starts with
    that newline. prefix + middle + suffix is the file."""
    rng = random.Random(seed)
    out = []
    for f in files:
        text = f.read_text()
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
                continue
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str) and len(node.body) > 1:
                first = node.body[1]  # keep the docstring in the prefix
            start, end = first.lineno - 1, node.end_lineno
            if end is None:  # ast.parse sets it on every node; only synthesised nodes lack it
                continue
            if first.lineno <= node.lineno or end - start > max_body_lines or end - start < 1:
                continue
            if not lines[start - 1].endswith("\n") or not lines[end - 1].endswith("\n"):
                continue
            prefix = "".join(lines[:start])[:-1]
            middle = "\n" + "".join(lines[start:end])[:-1]
            suffix = "\n" + "".join(lines[end:])
            assert prefix + middle + suffix == text
            out.append((f.relpath, prefix, middle, suffix))
    rng.shuffle(out)
    return out[:limit]


def end_token_prob(model, prompt: list[int], middle: list[int], eot: int) -> tuple[float, bool]:
    """Teacher-forced: the probability of the end token right after the true middle, and whether it
    is the model's first choice there. Greedy stopping needs it first at exactly that point, so this
    shows progress towards the stop target before greedy decoding gets there."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + middle])).logits[0, -1].float()
    return float(logits.softmax(-1)[eot]), bool(int(logits.argmax()) == eot)


def fim_bodies(model, tok, files, n: int, max_new: int = 128):
    eot = tok.convert_tokens_to_ids(EOT)
    res = {}
    funcs = small_functions(files, limit=n)
    example = None
    for order in ("spm", "psm"):
        stopped = exact = 0
        sim = 0.0
        end_p = end_top = 0.0
        for rel, prefix, body, suffix in funcs:
            prompt = encode_fim(tok, prefix, suffix, order)
            p_end, top = end_token_prob(model, prompt, tok(body, add_special_tokens=False)["input_ids"], eot)
            end_p, end_top = end_p + p_end, end_top + top
            g, hit = greedy(model, prompt, max_new, stop_ids=(eot,))
            text = tok.decode(g)
            stopped += int(hit)
            exact += int(hit and text.rstrip() == body.rstrip())
            sim += difflib.SequenceMatcher(None, text, body).ratio()
            if example is None and order == "spm" and hit:
                example = {"file": rel, "prefix_tail": "".join(prefix.splitlines(keepends=True)[-6:]),
                           "suffix_head": "".join(suffix.splitlines(keepends=True)[:3]), "truth": body,
                           "completion": text}
        k = max(1, len(funcs))
        res[order] = {"stops_at_eot": stopped / k, "exact_match": exact / k, "char_similarity": sim / k,
                      "end_token_prob": end_p / k, "end_token_top": end_top / k}
    return res, len(funcs), example


def samples(model, tok, files, n: int = 3, seed: int = 3, max_new: int = 64):
    rng = random.Random(seed)
    eot = tok.convert_tokens_to_ids(EOT)
    sep = tok.convert_tokens_to_ids(FILE_SEP)
    out = []
    pool = [f for f in files if f.path.stat().st_size > 3000]
    for f in rng.sample(pool, min(n, len(pool))):
        text = f.read_text()
        lines = text.split("\n")
        # the cursor at the end of a line inside a function body (before its newline)
        cands = [i for i in range(10, len(lines) - 10) if lines[i].startswith("        ") and lines[i - 1].strip()]
        li = rng.choice(cands) if cands else len(lines) // 2
        prefix = "\n".join(lines[:li])
        ids = tok(prefix, add_special_tokens=False)["input_ids"][-320:]
        g, _ = greedy(model, ids, max_new, stop_ids=(eot, sep))
        comp = tok.decode(g)
        comp = "\n".join(comp.split("\n")[:7])
        truth = "\n" + "\n".join(lines[li:li + 6])
        out.append({"file": f.relpath, "line": li + 1, "context": "\n".join(lines[max(0, li - 8):li]),
                    "completion": comp, "truth": truth})
    return out


# ----------------------------------------------------------------------------- plot & card

def plot(log_path: Path, png: Path, n_layers: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    train = [r for r in recs if "exit_losses" in r]
    held = [r for r in recs if "heldout_exit_losses" in r]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    show = sorted({0, n_layers // 4, n_layers // 2 - 1, n_layers // 2, (3 * n_layers) // 4, n_layers - 1})
    cmap = plt.get_cmap("viridis")
    for l in show:
        c = cmap(l / max(1, n_layers - 1))
        if train:
            pts = [(r["tokens"] / 1e6, r["exit_losses"][l]) for r in train if r["exit_losses"][l] is not None]
            xs = [x for x, _ in pts]
            # light smoothing of the noisy per-interval means
            sm, acc = [], None
            for _, v in pts:
                acc = v if acc is None else 0.9 * acc + 0.1 * v
                sm.append(acc)
            axes[0].plot(xs, sm, color=c, label=f"exit {l + 1}" + (" (full)" if l == n_layers - 1 else ""))
        if held:
            axes[1].plot([r["tokens"] / 1e6 for r in held], [r["heldout_exit_losses"][l] for r in held], "o-",
                         color=c, label=f"exit {l + 1}" + (" (full)" if l == n_layers - 1 else ""))
    pk = [r for r in recs if "heldout_packages_exit_losses" in r]
    if pk:
        axes[1].plot([r["tokens"] / 1e6 for r in pk], [r["heldout_packages_exit_losses"][-1] for r in pk], "s--",
                     color="tab:red", label="full, held-out packages")
    axes[0].set_title("training loss per exit layer (EMA)")
    axes[1].set_title("held-out loss per exit layer")
    for ax in axes:
        ax.set_xlabel("tokens seen (M)")
        ax.set_ylabel("cross-entropy (nats)")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
        ax.set_ylim(top=min(8.0, ax.get_ylim()[1]))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _fmt(v, l: int) -> str:
    return f"{v[l]:.3f}" if v else "not measured"


def draft_cost(t: dict, exit_layer: int, draft_vocab: int = 0) -> float:
    """Compute of an exit-layer draft step relative to a full step (FLOPs per token: the first
    exit_layer decoder layers plus the draft head, over all layers plus the full LM head). The
    engine's draft head scores only the draft_vocab most frequent ids (0: all). `completiond
    calibrate` measures the real ratio on a machine; on CPU it is close to this."""
    h, ff, L, v = t["hidden"], t["intermediate"], t["layers"], t["vocab"]
    kv = h * t["kv_heads"] // t["heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * ff
    return (exit_layer * layer + h * (draft_vocab or v)) / (L * layer + h * v)


def _data_md(data: dict, t: dict, manifest: dict | None) -> str:
    stdlib = (f"* CPython {data['python']} standard library sources (`sysconfig.get_paths()[\"stdlib\"]` =\n"
              f"  `{data['stdlib_root']}`), all `*.py` files, `site-packages` excluded, files that are\n"
              f"  not valid UTF-8 skipped, sorted by relative path. License: PSF.\n"
              f"* Held-out split by file: a file is held out when `int(sha1(relpath), 16) % 20 == 0`\n"
              f"  (`completiond.models.corpus.is_heldout`): {data['heldout_files']} files, "
              f"{data['heldout_bytes'] / 1e6:.2f} MB.")
    if not manifest:
        return (stdlib + f" Training: {data['training_files']} files, {data['training_bytes'] / 1e6:.1f} MB "
                f"({t['training_stream_tokens']:,} tokens). The tokenizer and the model never saw held-out files; "
                f"every figure below is on held-out files only.")
    sp = manifest["splits"]
    kept = [p for p in manifest["packages"] if p["split"] in ("train", "heldout_packages")]
    dropped = [p for p in manifest["packages"] if p["split"] not in ("train", "heldout_packages")]
    rows = "\n".join(
        f"| {p['name']} | {p['version']} | {p['licence']} | {'**held out**' if p['split'] == 'heldout_packages' else 'train'} "
        f"| {p['files']:,} | {p['tokens']:,} | {', '.join(f'{k} {v}' for k, v in sorted(p['dropped'].items())) or '-'} |"
        for p in sorted(kept, key=lambda p: p["name"].lower()))
    dropped_md = "".join(f"\n* Dropped whole: {p['name']} {p['version']} (licence metadata `{p['licence']}` "
                         f"is not in the allowed list)." for p in dropped)
    return f"""{stdlib}
* Third-party Python: the {len(manifest['packages'])} distributions of `models/training/train_packages.txt` (the project's
  list of permissively licensed packages), fetched with `pip download --no-deps` at the versions pinned in
  `models/training/train_packages.lock`. A distribution is kept only if its metadata (License-Expression, License or
  the trove classifiers) names MIT, BSD, Apache-2.0, PSF, ISC, HPND, Unlicense or 0BSD. Inside it only `.py`
  files are taken; dropped: vendored copies (`_vendor/`, `vendor/`, `vendored/`, `third_party/`, `externals/`),
  generated files (a "generated by" / "DO NOT EDIT" marker near the top, or mostly lines over 400
  characters), files over {manifest['rules']['max_file_bytes'] // 1000} kB (data tables), empty files and files that
  are not UTF-8.{dropped_md}
* De-duplicated by content across every source (held-out files claim their content first, so no copy of a
  held-out file is trained on). Held out whole: {', '.join(manifest['heldout_packages'])}.
* Pre-tokenised once with the model's tokenizer into flat uint16 streams (files joined by `<|file_sep|>`),
  memory-mapped by the trainer: training {sp['train']['files']:,} files, {sp['train']['bytes'] / 1e6:.1f} MB,
  **{sp['train']['tokens']:,} tokens**; held-out stdlib {sp['heldout_stdlib']['files']} files,
  {sp['heldout_stdlib']['tokens']:,} tokens; held-out packages {sp['heldout_packages']['files']} files,
  {sp['heldout_packages']['tokens']:,} tokens. The manifest is `data_manifest.json` in this directory.
  The tokenizer and the model never saw held-out files or packages.

| package | version | licence (metadata) | split | files | tokens | dropped files |
|---|---|---|---|---|---|---|
{rows}
"""


_RECIPE_NAMES = {"distill": "distillation weight", "distill_other": "relative KL weight of other exits",
                 "draft_exits": "draft exits"}


def _recipe_changes_md(st: dict) -> str:
    """A stage's changes to the distillation recipe (train-default --resume --distill/--draft-exits)."""
    changes = st.get("recipe_changes") or {}

    def show(v):
        return ", ".join(str(x) for x in v) if isinstance(v, list) else str(v)

    return "".join(f"; {_RECIPE_NAMES.get(k, k)} changed from {show(was)} to {show(now)}"
                   for k, (was, now) in changes.items())


def _training_md(t: dict) -> str:
    """What the model was trained with, in brief: the figures a user weighs, not the run's history
    (training_summary.json beside the model keeps every stage; models/training/RESUME.md how to go on)."""
    changes = "".join(_recipe_changes_md(st) for st in t.get("stages") or [])
    changed = f" ({changes.removeprefix('; ')})" if changes else ""
    exits = ", ".join(str(e) for e in t["draft_exits"])
    return f"""* **{t['tokens_seen'] / 1e6:.1f}M tokens** (~{t['tokens_seen'] / t['training_stream_tokens']:.2f} epochs) in
  {t['steps']:,} steps of {t['batch_size']} sequences of {t['seq_len']} tokens, {t['train_seconds'] / 3600:.1f} hours on
  {(t.get('stages') or [{}])[-1].get('threads', 2)} CPU threads ({t['precision']}, torch {t['torch']}); AdamW, peak LR {t['lr']}, one cosine
  to {t['min_lr_ratio']} x peak.
* **LayerSkip** (Elhoushi et al., 2024): layer dropout rising with depth to {t['layer_dropout_max']}, an early-exit loss
  through the shared final norm and LM head, and self-distillation of the exits toward the last layer, weighted
  to the exits the engine drafts from ({exits}){changed}.
* **FIM** on {t['fim_rate']:.0%} of samples ({t['spm_rate']:.0%} of them SPM); every middle ends at a line or block
  boundary and is closed with `<|endoftext|>`.
* Rebuild: `completiond train-default --run-dir DIR` (a directory outside the checkout), then
  `--export`; the recipe is in `models/training/train_default.py`, every stage in `training_summary.json`.{_context_stage_md(t)}"""


def _context_stage_md(t: dict) -> str:
    """The repository-context stage (`completiond train-context`), when the model had one."""
    c = t.get("context_stage")
    if not c:
        return ""
    shares = ", ".join(f"{k} {v:.0%}" for k, v in c["shares"].items())
    return f"""
* **Repository context** (a later stage, `{c['recipe']}`): {c['tokens'] / 1e6:.1f}M more tokens in {c['steps']:,} steps
  ({c['seconds'] / 3600:.1f} hours, peak LR {c['lr']}) on prompts the daemon itself builds for training packages: chunks its
  retrieval picks from the rest of the package in front of the file, then the missing middle (samples: {shares})."""


def write_card(model_dir: Path, r: dict) -> None:
    t = r["training"]
    data = r["data"]
    L = t["layers"]
    mdc = r.get("measured_draft_cost")
    measured = {d["exit_layer"]: d["cost"] for d in mdc["by_exit"]} if mdc else {}
    rows = "\n".join(
        f"| {l + 1}{' (full)' if l == L - 1 else ''} | {r['heldout_loss'][l]:.3f} | "
        f"{_fmt(r.get('heldout_packages_loss'), l)} | {r['alpha'][l]:.3f} | "
        f"{draft_cost(t, l + 1, r.get('draft_vocab_size', 0)):.2f} | "
        f"{f'{measured[l + 1]:.2f}' if l + 1 in measured else ('1.00' if l == L - 1 and measured else 'not measured')} | "
        f"{r['accepted_per_round'][l] + 1:.2f} |"
        for l in range(L))
    heads = {d.get("draft_vocab", 0) for d in mdc["by_exit"]} if mdc else set()
    head_md = (f"{heads.pop() or t['vocab']}-id draft head, " if len(heads) == 1 else "")
    measured_md = (f" Measured draft cost: one greedy draft token at that exit (the engine's own step, {head_md}{mdc['step']}) "
                   f"÷ one plain greedy step, medians of {mdc['repeats']} (`completiond bench --json`, "
                   f"`draft_cost_by_exit`; {mdc['when']})." if mdc else "")
    nl = r["next_line"]
    fb = r["fim_bodies"]
    curves = "\n![loss curves](loss_curves.png)\n" if (model_dir / "loss_curves.png").is_file() else ""
    card = f"""# completiond-py-mini

The bundled default model of completiond: a small Python code model ({t['parameters'] / 1e6:.1f}M parameters) trained
by this project from scratch on {"the CPython standard library and permissively licensed third-party packages" if r.get("data_manifest") else "the CPython standard library"},
with fill-in-the-middle and the LayerSkip recipe, so that its own early layers draft for it. It exists so that
completiond works offline out of the box and so that tests and benchmarks have a real trained model; **it is not a
strong code model** (see Limits). A plain `LlamaForCausalLM`: `AutoModelForCausalLM.from_pretrained(dir)` loads it,
no custom code. Every figure here comes from `models/training/model_card.py` (`eval_results.json` has them all, with examples).

## Data

{_data_md(data, t, r.get('data_manifest'))}
## Model

`LlamaForCausalLM`: {t['layers']} layers, hidden {t['hidden']}, {t['heads']} attention heads of
{t['hidden'] // t['heads']} ({t['kv_heads']} KV heads), MLP {t['intermediate']} (SwiGLU), RMSNorm, RoPE (theta 10000),
tied embeddings; trained at {t['seq_len']} tokens of context (`completiond.json`: `train_context`). Weights:
bfloat16 safetensors{cpu_weights_md(model_dir)}. Tokenizer: byte-level BPE, {t['vocab']} ids, lossless round trip; special tokens
`<|endoftext|>` (0, eos), `<|file_sep|>` (1), `<|fim_prefix|>` (2), `<|fim_suffix|>` (3), `<|fim_middle|>` (4),
`<|fim_pad|>` (5); no BOS.

FIM layouts (prefix, suffix and middle tokenized separately; in SPM nothing separates PREFIX and MIDDLE):

```
PSM: <|fim_prefix|>PREFIX<|fim_suffix|>SUFFIX<|fim_middle|>MIDDLE<|endoftext|>
SPM: <|fim_prefix|><|fim_suffix|>SUFFIX<|fim_middle|>PREFIX MIDDLE<|endoftext|>
```

## Training

{_training_md(t)}
{curves}
## Held-out results

Exit layer l: the hidden state after l layers through the final norm and LM head. Loss: cross-entropy (nats) on
{r['heldout_windows']} windows of {t['seq_len']} tokens (uniform: {r['uniform_loss']:.2f}). Alpha: share of positions along the full
model's greedy continuation of {r['alpha_prompts']} held-out prompts ({r['alpha_positions']} positions) where the exit's argmax
agrees; tokens / round: greedy self-speculation with K=4, simulated exactly.{measured_md}

| exit layer | held-out loss (stdlib) | held-out loss (packages) | alpha (greedy agreement) | draft cost (FLOPs, {r.get('draft_vocab_size') or t['vocab']}-id draft head) | draft cost (measured) | tokens / round (K=4) |
|---|---|---|---|---|---|---|
{rows}

Next line ({r['next_line_positions']} held-out cursors at a line end, greedy, compared with the real next line;
baseline: the previous line's indentation and first token):

| predictor | exact match | char similarity |
|---|---|---|
| model, left to right | {nl['left_to_right']['exact_match']:.1%} | {nl['left_to_right']['char_similarity']:.3f} |
| model, FIM (SPM, rest of file as suffix) | {nl['fim_spm']['exact_match']:.1%} | {nl['fim_spm']['char_similarity']:.3f} |
| baseline | {nl['baseline']['exact_match']:.1%} | {nl['baseline']['char_similarity']:.3f} |

FIM function bodies ({r['fim_functions']} held-out functions of at most 8 lines, body removed, greedy): the middle ends with
`<|endoftext|>` in {fb['spm']['stops_at_eot']:.1%} (SPM) / {fb['psm']['stops_at_eot']:.1%} (PSM) of them; exact bodies
{fb['spm']['exact_match']:.1%} / {fb['psm']['exact_match']:.1%}, char similarity {fb['spm']['char_similarity']:.3f} / {fb['psm']['char_similarity']:.3f}.

{drafts_md(model_dir)}## Limits

{t['train_seconds'] / 3600:.1f} hours on two CPU cores give a model that knows common Python idioms and the APIs of its
training packages, but repeats itself and invents names: about {nl['left_to_right']['exact_match']:.0%} of next lines come out exactly right.
Python only, {t['seq_len']} tokens of context. Use a real code model for real work (`completiond pull --list`);
completiond loads Llama-family models the same way.
"""
    (model_dir / "MODEL_CARD.md").write_text(card)


def drafts_md(model_dir: Path) -> str:
    """The drafts trained on these weights (exit adapter, Medusa heads), from their files' own records."""
    import json as _json

    from safetensors import SafetensorError, safe_open

    rows = []
    for name, what in (("exit_adapter.safetensors", "exit adapter"), ("medusa_heads.safetensors", "Medusa heads")):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = dict(f.metadata() or {})
            t = _json.loads(meta.get("training", "{}"))
        except (OSError, SafetensorError, ValueError):
            continue
        if what == "exit adapter":
            b, a = t.get("before", {}).get("agreement", {}), t.get("after", {}).get("agreement", {})
            detail = (f"at layer {meta.get('exit_layer')}; held-out greedy agreement with the last layer "
                      f"{a.get('adapter', 0):.3f} (plain exit {meta.get('exit_layer')}: {b.get('exit', 0):.3f}, "
                      f"exit {int(meta.get('exit_layer', 0)) + 1}: {b.get('exit_next', 0):.3f})")
        else:
            agree = t.get("after", {}).get("agreement", [])
            detail = (f"({meta.get('num_heads')}); agreement 2..{len(agree) + 1} tokens ahead: "
                      + " / ".join(f"{x:.2f}" for x in agree))
        rows.append(f"| `{name}` | {what} {detail} | {t.get('steps', 0)} steps, {t.get('tokens', 0):,} tokens, "
                    f"{t.get('minutes', 0):.0f} CPU minutes |")
    if not rows:
        return ""
    return ("## Trained drafts\n\nTrained on these weights with the model frozen (`completiond train-adapter`, "
            "`completiond train-medusa`) and keyed to them: a retrained model does not use them. Whether one pays is "
            "`completiond calibrate`'s call per machine (completiond.json records the shipped choice).\n\n"
            "| file | what | training |\n|---|---|---|\n" + "\n".join(rows) + "\n\n")


def _record(model_dir: Path) -> dict:
    """The model's completiond.json ({} where it has none)."""
    f = model_dir / "completiond.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def cpu_weights_md(model_dir: Path) -> str:
    """The CPU step's format for weights = "auto" where the record names one (set by hand after `bench --quality`)."""
    fmt = _record(model_dir).get("cpu_weights")
    if not fmt:
        return ""
    return (f"; on the CPU the engine computes with {fmt} panels of them (`completiond.json`: `cpu_weights`; "
            "`completiond bench --quality` puts the formats' held-out loss side by side)")


def draft_vocab_size(model_dir: Path) -> int:
    """Ids the engine's draft head scores by default (the model's completiond.json), 0 for all."""
    spec = _record(model_dir).get("speculation") or {}
    return len(spec.get("draft_vocab") or [])


def heldout_packages_loss(model, data_dir: Path, model_dir: Path, seq_len: int, count: int):
    """(per-exit loss on the held-out packages' stream, the data manifest), or (None, manifest or None)
    when the prepared data is not here or was tokenised with another tokenizer."""
    import torch.nn.functional as F

    from .data_prep import DataError, TokenData
    from .train_default import stream_windows

    mf = model_dir / "data_manifest.json"
    manifest = json.loads(mf.read_text()) if mf.is_file() else None
    try:
        data = TokenData(data_dir)
        data.check_tokenizer(model_dir)
    except (DataError, FileNotFoundError) as e:
        print(f"held-out packages loss not measured: {e}", flush=True)
        return None, manifest
    stream = data.streams["heldout_packages"]
    if len(stream) <= seq_len + 1:
        return None, manifest or data.manifest
    x, y = stream_windows(stream, seq_len, count)
    sums = None
    for i in range(x.shape[0]):
        lg = exit_logits_all(model, x[i:i + 1])
        v = [F.cross_entropy(l.float(), y[i]).item() for l in lg]
        sums = v if sums is None else [a + b for a, b in zip(sums, v)]
    if sums is None:
        raise ValueError("no held-out windows")
    return [v / x.shape[0] for v in sums], manifest or data.manifest


def measured_draft_cost(bench_json: Path) -> dict:
    """The draft costs a `completiond bench --json` run measured per exit layer (draft_cost_by_exit)."""
    try:
        b = json.loads(Path(bench_json).read_text())
        by_exit = [{"exit_layer": int(d["exit_layer"]), "cost": float(d["cost"]), "draft_vocab": int(d.get("draft_vocab", 0)),
                    # bench runs from before the count was recorded timed 20 repeats (draft_cost_by_exit's default)
                    "repeats": int(d.get("repeats", 20))}
                   for d in b["draft_cost_by_exit"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"model_card: {bench_json} is not a `completiond bench --json` output with "
                         f"draft_cost_by_exit: {exc}") from None
    step = (b.get("native_step") or {}).get("used")
    return {"by_exit": by_exit, "repeats": min((d["repeats"] for d in by_exit), default=0), "step": "native" if step else "PyTorch",
            "when": f"{b.get('date', 'date not recorded')}, {b.get('cpu') or b.get('device', '')}".strip(", ")}


def main(argv=None) -> int:
    import sys

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from completiond.models import corpus, default_model_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=default_model_dir())
    p.add_argument("--quick", action="store_true", help="fewer samples (smoke test)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", type=Path, default=Path("runs/data"),
                   help="prepared data (train-default --prepare) for the held-out packages loss")
    p.add_argument("--train-log", type=Path, default=None,
                   help="the run's train_log.jsonl: redraw loss_curves.png from it (the log stays in the run directory)")
    p.add_argument("--bench", type=Path, default=None,
                   help="a `completiond bench --json` output of this model: its draft_cost_by_exit becomes the card's "
                        "measured draft cost")
    p.add_argument("--from-results", action="store_true",
                   help="rewrite the card from the model's eval_results.json (no evaluation; with --bench: add its costs)")
    a = p.parse_args(argv)
    if a.from_results:
        res = json.loads((a.model / "eval_results.json").read_text())
        if a.bench:
            res["measured_draft_cost"] = measured_draft_cost(a.bench)
        (a.model / "eval_results.json").write_text(json.dumps(res, indent=2) + "\n")
        write_card(a.model, res)
        print(f"wrote {a.model / 'MODEL_CARD.md'} from {a.model / 'eval_results.json'}", flush=True)
        return 0
    torch.set_num_threads(a.threads)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    t0 = time.time()
    d = a.model
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    summary = json.loads((d / "training_summary.json").read_text())
    files = corpus.heldout_files()
    q = a.quick
    L = model.config.num_hidden_layers
    seq_len = summary["seq_len"]
    n_windows = 8 if q else 48
    print("held-out loss ...", flush=True)
    hl = heldout_loss(model, tok, files, seq_len, n_windows)
    print([round(v, 3) for v in hl], flush=True)
    hp, manifest = heldout_packages_loss(model, a.data, d, seq_len, n_windows)
    if hp:
        print("held-out packages:", [round(v, 3) for v in hp], flush=True)
    print("acceptance ...", flush=True)
    alpha, per_round, n_pos = acceptance(model, tok, files, 6 if q else 40, 256, 32 if q else 64)
    print([round(v, 3) for v in alpha], [round(v, 2) for v in per_round], flush=True)
    print("next line ...", flush=True)
    nl, n_nl, nl_examples = next_line(model, tok, files, 20 if q else 200)
    print(nl, flush=True)
    print("fim bodies ...", flush=True)
    fb, n_fb, fim_example = fim_bodies(model, tok, files, 6 if q else 40)
    print(fb, flush=True)
    smp = samples(model, tok, files)
    summ = corpus.describe()
    res = {
        "model": str(d), "training": summary,
        "data": {**summ, "python": sys.version.split()[0]},
        "uniform_loss": float(torch.log(torch.tensor(float(len(tok))))),
        "heldout_windows": n_windows, "heldout_loss": hl, "heldout_packages_loss": hp,
        "draft_vocab_size": draft_vocab_size(d),
        "data_manifest": manifest,
        "alpha": alpha, "accepted_per_round": per_round, "K": 4, "alpha_positions": n_pos,
        "alpha_prompts": 6 if q else 40,
        "next_line": nl, "next_line_positions": n_nl, "next_line_examples": nl_examples,
        "fim_bodies": fb, "fim_functions": n_fb, "fim_example": fim_example,
        "samples": smp, "eval_seconds": time.time() - t0,
    }
    if a.bench:
        res["measured_draft_cost"] = measured_draft_cost(a.bench)
    if a.train_log is not None:
        plot(a.train_log, d / "loss_curves.png", L)
    (d / "eval_results.json").write_text(json.dumps(res, indent=2) + "\n")
    write_card(d, res)
    print(f"wrote {d / 'MODEL_CARD.md'} in {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
