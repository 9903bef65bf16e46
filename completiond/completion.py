"""Document + cursor -> prompt -> engine -> suggestion.

One function, `suggest()`, is the boundary the daemon (and `completiond
complete`) call. Inside it, a plan object supplies the three replaceable steps
around one `engine.generate` call:

    plan.ids            what the model sees (prompt ids)
    plan.stop           when generation ends (engine stop callback)
    plan.suggestion()   what the editor shows (post-processed text)

The default plan comes from completiond.prompt.Planner (cache-friendly
suffix-first FIM prompts, token healing, bracket-aware stop rules). A small
self-contained pipeline (`build_prompt` / `make_stop` / `postprocess` here)
remains for engines without a real tokenizer (test fakes) and as a reference.

All offsets are Python string (code point) offsets into the document text.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from completiond.documents import line_starts

# (prefix, suffix, middle) special tokens of the FIM templates we recognise, in
# the order auto-detection tries them.
FIM_TOKENS: dict[str, tuple[str, str, str]] = {
    "completiond": ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    "qwen2.5-coder": ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    "starcoder": ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    "deepseek-coder": ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    "codestral": ("[PREFIX]", "[SUFFIX]", "[MIDDLE]"),
}

# Clip the prefix only at multiples of this many lines, so that as the user
# types the prompt's first tokens stay the same and the KV cache keeps hitting.
CLIP_LINES = 32
BLOCK_OPENERS = (":", "{", "[", "(", "=>", "->", "then", "do")


@dataclass
class PromptPlan:
    ids: list[int]
    offset: int                  # cursor
    line_before: str             # current line, up to the cursor
    line_rest: str               # current line, after the cursor
    multiline: bool
    indent: int                  # column below which a multi-line suggestion's block ends
    fim: str | None              # template name, or None for plain left-to-right
    prefix_start: int            # where the clipped prefix begins in the document
    special_ids: frozenset[int] = field(default_factory=frozenset)


@dataclass
class Suggestion:
    text: str                    # insert text (includes any rest-of-line it overwrites)
    start: int                   # replaced range [start, end) in the document
    end: int
    multiline: bool
    finish_reason: str
    stats: dict[str, Any]


class PromptError(ValueError):
    pass


def _encode(tokenizer, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer.encode(text, add_special_tokens=False))


def _bos(tokenizer) -> list[int]:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    probe = tokenizer.encode("a", add_special_tokens=True)
    return [bos] if probe and probe[0] == bos else []


def detect_fim(tokenizer, template: str) -> tuple[str, tuple[int, int, int]] | None:
    if template == "none":
        return None
    vocab = tokenizer.get_vocab()
    names = list(FIM_TOKENS) if template == "auto" else [template]
    for name in names:
        toks = FIM_TOKENS.get(name)
        if toks and all(t in vocab for t in toks):
            return name, tuple(vocab[t] for t in toks)  # type: ignore[return-value]
    return None


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def wants_multiline(line_before: str, line_rest: str, mode: str) -> bool:
    if mode == "always":
        return True
    if mode == "never" or line_rest.strip():
        return False
    stripped = line_before.rstrip()
    return not stripped.strip() or stripped.endswith(BLOCK_OPENERS)


def _clip_prefix(tokenizer, prefix: str, budget: int) -> tuple[int, list[int]]:
    """Start offset and ids of the longest line-block-aligned tail of `prefix` within `budget` tokens."""
    starts = line_starts(prefix)
    blocks = starts[::CLIP_LINES]
    # Cheap first guess: no token is shorter than one character.
    first = 0
    while first + 1 < len(blocks) and len(prefix) - blocks[first] > budget * 16:
        first += 1
    for start in blocks[first:]:
        ids = _encode(tokenizer, prefix[start:])
        if len(ids) <= budget:
            return start, ids
    # The last block alone is too long (one huge line): keep its tail.
    ids = _encode(tokenizer, prefix[blocks[-1]:])
    return len(prefix), ids[-budget:] if budget > 0 else []


def build_prompt(tokenizer, text: str, offset: int, cfg: Any, max_context: int) -> PromptPlan:
    if not 0 <= offset <= len(text):
        raise PromptError(f"cursor offset {offset} outside a document of {len(text)} characters")
    line_start = text.rfind("\n", 0, offset) + 1
    line_end = len(text)
    for eol in ("\n", "\r"):
        i = text.find(eol, offset)
        if i != -1:
            line_end = min(line_end, i)
    line_before, line_rest = text[line_start:offset], text[offset:line_end]
    multiline = wants_multiline(line_before, line_rest, cfg.multiline)
    if line_before.strip():
        indent = _indent(line_before) + (1 if line_before.rstrip().endswith(BLOCK_OPENERS) else 0)
    else:
        indent = len(line_before)

    fim = detect_fim(tokenizer, cfg.fim_template)
    bos = _bos(tokenizer)
    room = max_context - cfg.max_tokens - len(bos) - 4
    if room < 16:
        raise PromptError(f"maxTokens {cfg.max_tokens} leaves no room for a prompt in a {max_context}-token context")
    suffix_budget = min(cfg.suffix_tokens, room // 4) if fim else 0
    prefix_budget = min(cfg.prefix_tokens, room - suffix_budget)
    prefix_start, prefix_ids = _clip_prefix(tokenizer, text[:offset], prefix_budget)
    if fim:
        name, (p, s, m) = fim
        suffix_ids = _encode(tokenizer, text[offset:offset + suffix_budget * 16])[:suffix_budget]
        ids = bos + [p] + prefix_ids + [s] + suffix_ids + [m]
    else:
        name = None
        ids = bos + prefix_ids
    special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
    return PromptPlan(ids=ids, offset=offset, line_before=line_before, line_rest=line_rest, multiline=multiline,
                      indent=indent, fim=name, prefix_start=prefix_start, special_ids=special)


def _cut_text(plan: PromptPlan, text: str, max_lines: int) -> tuple[str, bool]:
    """The part of generated `text` to keep, and whether it is complete (generation can stop)."""
    if not plan.multiline:
        for eol in ("\n", "\r"):
            i = text.find(eol)
            if i != -1:
                text = text[:i]
                return text, True
        return text, False
    lines = text.split("\n")
    kept = [lines[0]]
    for i, line in enumerate(lines[1:], start=1):
        complete = i < len(lines) - 1
        if line.strip() and _indent(line) < plan.indent and (complete or len(line) > _indent(line)):
            return "\n".join(kept), True
        if len(kept) >= max_lines:
            return "\n".join(kept), True
        kept.append(line)
    if len(kept) >= 3 and not kept[-1].strip() and not kept[-2].strip():
        return "\n".join(kept).rstrip(), True
    return "\n".join(kept), False


def _useful_tokens(tokenizer, tokens: list[int], special: frozenset[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in special:
            return tokens[:i]
    return tokens


def make_stop(tokenizer, plan: PromptPlan, cfg: Any) -> Callable[[list[int]], int | None]:
    def stop(tokens: list[int]) -> int | None:
        useful = _useful_tokens(tokenizer, tokens, plan.special_ids)
        text = tokenizer.decode(useful)
        kept, complete = _cut_text(plan, text, cfg.max_lines)
        if len(useful) < len(tokens) and not complete:
            return len(useful)
        if not complete:
            return None
        # Keep the fewest tokens whose text covers what we keep (one token may span the cut).
        for n in range(len(useful) + 1):
            if len(tokenizer.decode(useful[:n])) >= len(kept) + 1:
                return n
        return len(useful)
    return stop


def postprocess(plan: PromptPlan, generated: str, max_lines: int) -> tuple[str, int] | None:
    """(insert text, end of the replaced range) or None when there is nothing worth showing."""
    # A token sequence cut inside a multi-byte character decodes to U+FFFD: never show that.
    text, _ = _cut_text(plan, generated.rstrip("\ufffd"), max_lines)
    text = "\n".join(line.rstrip() for line in text.split("\n")).rstrip()
    if not text.strip():
        return None
    end = plan.offset
    rest = plan.line_rest.rstrip()
    if rest and "\n" not in text:
        # The model often re-types what follows the cursor (a closing bracket): let the
        # suggestion overwrite that part of the line instead of doubling it, when the
        # brackets of the resulting line balance better that way.
        best = _imbalance(plan.line_before + text + plan.line_rest)
        for k in range(len(rest), 0, -1):
            if text.endswith(rest[:k]):
                score = _imbalance(plan.line_before + text + plan.line_rest[k:])
                if score < best or (k == len(rest) and score == best and not _only_closers(rest)):
                    end, best = plan.offset + (len(plan.line_rest) if k == len(rest) else k), score
                break
        if plan.line_rest.startswith(text) and end - plan.offset >= len(text):
            return None  # the line would not change
    return text, end


def _imbalance(line: str) -> int:
    return sum(abs(line.count(o) - line.count(c)) for o, c in ("()", "[]", "{}"))


def _only_closers(text: str) -> bool:
    return all(c in ")]}" or c.isspace() for c in text)


def sampling_params(cfg: Any):
    from completiond.engine import SamplingParams

    return SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          seed=cfg.seed, speculative=cfg.speculation, exit_layer=cfg.exit_layer or None,
                          draft_k=cfg.draft_tokens or None, draft_threshold=cfg.draft_threshold or None)


# Planners are per engine and prompt settings; rebuilding one re-derives token tables, so keep a few.
_PLANNERS: OrderedDict = OrderedDict()
_PLANNERS_LOCK = threading.Lock()  # an in-process restart briefly has two worker threads
_PLANNER_KEYS = ("fim_template", "multiline", "max_lines", "prefix_tokens", "suffix_tokens", "context_tokens",
                 "workspace_context", "max_tokens")


def planner_for(engine, cfg: Any):
    """The completiond.prompt.Planner for this engine and these settings (worker thread only)."""
    from completiond.prompt import Planner

    key = (id(engine), getattr(engine, "model_id", "")) + tuple(getattr(cfg, k) for k in _PLANNER_KEYS)
    with _PLANNERS_LOCK:
        planner = _PLANNERS.get(key)
        if planner is not None:
            _PLANNERS.move_to_end(key)
            return planner
    model_dir = cfg.model if cfg.model and Path(cfg.model).is_dir() else None
    if not cfg.model:
        from models import default_model_dir

        model_dir = default_model_dir()
    try:
        planner = Planner.for_engine(engine, cfg, model_dir=model_dir)
    except ValueError as exc:  # FimError and friends: a setting that does not fit this model
        raise PromptError(str(exc)) from None
    with _PLANNERS_LOCK:
        _PLANNERS[key] = planner
        while len(_PLANNERS) > 4:
            _PLANNERS.popitem(last=False)
    return planner


def plan_warnings(engine, cfg: Any) -> list[str]:
    """Settings problems the planner worked around for this engine and settings (e.g. a fimTemplate
    the model lacks), for the user to see. Empty when no planner was built."""
    key = (id(engine), getattr(engine, "model_id", "")) + tuple(getattr(cfg, k) for k in _PLANNER_KEYS)
    with _PLANNERS_LOCK:
        planner = _PLANNERS.get(key)
    return list(getattr(planner, "warnings", []) or [])


def suggest(engine, text: str, offset: int, cfg: Any, *, cancel: Any,
            on_round: Callable[[list[int]], None] | None = None, path: str | None = None,
            language: str | None = None, context: Sequence[tuple[str, str]] = (),
            simple: bool = False) -> tuple[Suggestion | None, Any]:
    """Run one completion. Returns (suggestion or None, the engine's Generation or None if skipped).

    simple=True uses this module's self-contained pipeline instead of the Planner.
    Raises PromptError / the engine's EngineError for input it cannot serve.
    """
    if simple:
        return _suggest_simple(engine, text, offset, cfg, cancel=cancel, on_round=on_round)
    if not 0 <= offset <= len(text):
        raise PromptError(f"cursor offset {offset} outside a document of {len(text)} characters")
    plan = planner_for(engine, cfg).plan(text, offset, context=context, path=path, language=language)
    if plan.skip_reason is not None:
        return None, None
    gen = engine.generate(plan.ids, sampling_params(cfg), cancel=cancel, on_round=on_round, stop=plan.stop,
                          constraint=plan.constraint)
    if gen.finish_reason == "cancelled":
        return None, gen
    insert = plan.suggestion(gen.tokens)
    if not insert or not insert.strip():
        return None, gen
    # The plan's post-processing already dropped text repeating the rest of the line, so the
    # suggestion is a pure insertion at the cursor.
    return Suggestion(text=insert, start=offset, end=offset, multiline="\n" in insert,
                      finish_reason=gen.finish_reason, stats=gen.stats.to_dict()), gen


def _suggest_simple(engine, text: str, offset: int, cfg: Any, *, cancel: Any,
                    on_round: Callable[[list[int]], None] | None = None) -> tuple[Suggestion | None, Any]:
    tok = engine.tokenizer
    plan = build_prompt(tok, text, offset, cfg, engine.max_context)
    gen = engine.generate(plan.ids, sampling_params(cfg), cancel=cancel, on_round=on_round,
                          stop=make_stop(tok, plan, cfg))
    stats = gen.stats.to_dict() if hasattr(gen.stats, "to_dict") else dict(gen.stats)
    if gen.finish_reason == "cancelled":
        return None, gen
    useful = _useful_tokens(tok, list(gen.tokens), plan.special_ids | frozenset(engine.eos_token_ids))
    out = postprocess(plan, tok.decode(useful), cfg.max_lines)
    if out is None:
        return None, gen
    insert, end = out
    return Suggestion(text=insert, start=offset, end=end, multiline="\n" in insert,
                      finish_reason=gen.finish_reason, stats=stats), gen


__all__ = ["PromptPlan", "Suggestion", "PromptError", "build_prompt", "make_stop", "postprocess", "suggest",
           "sampling_params", "detect_fim", "wants_multiline", "planner_for", "plan_warnings"]

