"""Document + cursor -> prompt -> engine -> suggestion: the one boundary the service
(and `completiond complete`) call.

`suggest()` asks the model's PromptBuilder (completion/prompt.py: cache-friendly
suffix-first FIM prompts, token healing, bracket-aware stop rules) for the
prompt, runs one `engine.generate`, and turns the tokens into what the editor
shows. There is one prompt pipeline: test fakes carry a real tokenizer.

All offsets are Python string (code point) offsets into the document text.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from completiond.errors import CompletionError


@dataclass
class Suggestion:
    text: str                    # insert text at the cursor
    start: int                   # replaced range [start, end) in the document
    end: int
    multiline: bool
    finish_reason: str
    stats: dict[str, Any]


class PromptError(CompletionError, ValueError):
    """Settings or a request that no prompt can be built for."""


def sampling_params(cfg: Any):
    from completiond.engine.engine import SamplingParams

    return SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          seed=cfg.seed, speculative=cfg.speculation, exit_layer=cfg.exit_layer or None,
                          draft_k=cfg.draft_tokens or None, draft_threshold=cfg.draft_threshold or None)


# Builders are per engine and prompt settings; rebuilding one re-derives token tables, so keep a few.
_BUILDERS: OrderedDict = OrderedDict()
_BUILDERS_LOCK = threading.Lock()  # an in-process restart briefly has two worker threads
_PROMPT_KEYS = ("fim_template", "multiline", "max_lines", "prefix_tokens", "suffix_tokens", "context_tokens",
                "workspace_context", "max_tokens", "token_healing")


def _key(engine, cfg: Any) -> tuple:
    return (id(engine), getattr(engine, "model_id", "")) + tuple(getattr(cfg, k) for k in _PROMPT_KEYS)


def builder_for(engine, cfg: Any):
    """The PromptBuilder for this engine and these settings (worker thread only)."""
    from completiond.completion.prompt import PromptBuilder

    key = _key(engine, cfg)
    with _BUILDERS_LOCK:
        builder = _BUILDERS.get(key)
        if builder is not None:
            _BUILDERS.move_to_end(key)
            return builder
    try:
        builder = PromptBuilder.for_engine(engine, cfg)
    except ValueError as exc:  # FimError and friends: a setting that does not fit this model
        raise PromptError(str(exc)) from None
    with _BUILDERS_LOCK:
        _BUILDERS[key] = builder
        while len(_BUILDERS) > 4:
            _BUILDERS.popitem(last=False)
    return builder


def prompt_warnings(engine, cfg: Any) -> list[str]:
    """Settings problems the builder worked around for this engine and settings (e.g. a fimTemplate
    the model lacks), for the user to see. Empty when no builder was made."""
    with _BUILDERS_LOCK:
        builder = _BUILDERS.get(_key(engine, cfg))
    return list(getattr(builder, "warnings", []) or [])


def suggest(engine, text: str, offset: int, cfg: Any, *, cancel: Any,
            on_round: Callable[[list[int]], None] | None = None, path: str | None = None,
            language: str | None = None, context: Sequence[tuple[str, str]] = ()) -> tuple[Suggestion | None, Any]:
    """Run one completion. Returns (suggestion or None, the engine's Generation or None if skipped).

    Raises PromptError / the engine's EngineError for input it cannot serve.
    """
    if not 0 <= offset <= len(text):
        raise PromptError(f"cursor offset {offset} outside a document of {len(text)} characters")
    prompt = builder_for(engine, cfg).build(text, offset, context=context, path=path, language=language)
    if prompt.skip_reason is not None:
        return None, None
    gen = engine.generate(prompt.ids, sampling_params(cfg), cancel=cancel, on_round=on_round, stop=prompt.stop,
                          constraint=prompt.constraint)
    if gen.finish_reason == "cancelled":
        return None, gen
    insert = prompt.suggestion(gen.tokens)
    if not insert or not insert.strip():
        return None, gen
    # The stop rules already dropped text repeating the rest of the line, so the
    # suggestion is a pure insertion at the cursor.
    return Suggestion(text=insert, start=offset, end=offset, multiline="\n" in insert,
                      finish_reason=gen.finish_reason, stats=gen.stats.to_dict()), gen
