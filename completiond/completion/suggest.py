"""The local engine as a Completer: document + cursor -> prompt -> engine -> suggestions.

`LocalCompleter.complete` asks the model's PromptBuilder (completion/prompt.py: the planner's
cache-friendly suffix-first FIM prompts as token ids, token healing, bracket-aware stop rules) for the
prompt, runs `engine.generate` once per alternative, and turns the tokens into what the editor shows.
There is one prompt pipeline: test fakes carry a real tokenizer and implement the engine's API.

All offsets are Python string (code point) offsets into the document text.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from completiond.completion.completer import (
    Backend,
    Completion,
    OnRound,
    PromptError,
    Suggestion,
    withheld,
)
from completiond.completion.warmup import Warmup, tag_cache
from completiond.config import Config
from completiond.errors import CompletionError

__all__ = [
    "LocalCompleter",
    "LocalEngine",
    "OutOfMemory",
    "PromptError",
    "Suggestion",
    "builder_for",
    "prompt_warnings",
    "sampling_params",
    "suggest_alternatives",
]

log = logging.getLogger(__name__)


class OutOfMemory(CompletionError):
    """The device ran out of memory during one request (its KV cache has been freed)."""


def _is_oom(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom is not None and isinstance(exc, oom):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()  # MPS, older builds


def sampling_params(cfg: Config):
    from completiond.engine.engine import SamplingParams

    return SamplingParams(
        max_tokens=cfg.max_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        seed=cfg.seed,
        speculative=cfg.speculation,
        exit_layer=cfg.exit_layer or None,
        draft_k=cfg.draft_tokens or None,
        draft_threshold=cfg.draft_threshold or None,
    )


# Builders are per engine and prompt settings; rebuilding one re-derives token tables, so keep a few.
_BUILDERS: OrderedDict = OrderedDict()
_BUILDERS_LOCK = threading.Lock()  # an in-process restart briefly has two worker threads
_PROMPT_KEYS = (
    "fim_template",
    "multiline",
    "max_lines",
    "prefix_tokens",
    "suffix_tokens",
    "context_tokens",
    "workspace_context",
    "max_tokens",
    "token_healing",
)


def _key(engine, cfg: Config) -> tuple:
    return (id(engine), getattr(engine, "model_id", "")) + tuple(getattr(cfg, k) for k in _PROMPT_KEYS)


def builder_for(engine, cfg: Config):
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


def prompt_warnings(engine, cfg: Config) -> list[str]:
    """Settings problems the builder worked around for this engine and settings (e.g. a fimTemplate
    the model lacks), for the user to see. Empty when no builder was made."""
    with _BUILDERS_LOCK:
        builder = _BUILDERS.get(_key(engine, cfg))
    return list(getattr(builder, "warnings", []) or [])


def suggest_alternatives(
    engine,
    text: str,
    offset: int,
    cfg: Config,
    *,
    cancel: Any,
    on_round: OnRound | None = None,
    path: str | None = None,
    language: str | None = None,
    context: Sequence[tuple[str, str]] = (),
    count: int | None = None,
    tree: Any = None,
) -> tuple[list[Suggestion], Any]:
    """Up to `count` (default: `cfg.alternatives`) different suggestions, best first; with the Generation of
    the first one (None if skipped).

    Each alternative is one more generation on the same prompt (its KV is reused from the cache). Sampling
    (temperature > 0) gives alternative i the seed `seed + i`; greedy decoding is deterministic, so
    alternative i is the greedy continuation of the best first token that none of the earlier ones began
    with: the model's own next-best branches, in its order. Empty and repeated texts are dropped and
    another attempt made in their place (at most twice as many generations as alternatives wanted).
    """
    if not 0 <= offset <= len(text):
        raise PromptError(f"cursor offset {offset} outside a document of {len(text)} characters")
    builder = builder_for(engine, cfg)
    params = sampling_params(cfg)
    found: list[Suggestion] = []
    first: Any = None
    banned: list[int] = []  # first tokens of the attempts so far (greedy)
    site: Any = None  # the region around the cursor, parsed once for every attempt
    wanted = max(1, count if count is not None else cfg.alternatives)
    for i in range(2 * wanted - 1):
        if len(found) == wanted:
            break
        # A fresh prompt each time: its stop rules follow one generation's tokens.
        prompt = builder.build(text, offset, context=context, path=path, language=language)
        if prompt.skip_reason is not None:
            return [], None
        if prompt.stop is not None:
            # The statement's open brackets for the stop rules, and the syntax check (every language with a
            # grammar; tree: the document's own, kept across edits, when the caller has one).
            site = prompt.stop.attach_document(
                text, offset, language, path, getattr(cfg, "syntax_check", True), tree, site=site
            )
        constraint = prompt.constraint
        run_params = params
        if i and params.temperature > 0:
            run_params = dataclasses.replace(params, seed=(params.seed + i) % 2**31)
        elif i:
            constraint = _first_token_not(engine, constraint, banned)
            if constraint is None:
                break  # every first token the prompt allows has had its turn
        gen = engine.generate(
            prompt.ids, run_params, cancel=cancel, on_round=on_round, stop=prompt.stop, constraint=constraint
        )
        first = first if first is not None else gen
        if gen.finish_reason == "cancelled":
            return ([] if i == 0 else found), first
        # Greedy: the next attempt starts with another token; one that ended at once began with the end.
        banned.extend(gen.tokens[:1] or sorted(getattr(engine, "eos_token_ids", ())))
        insert = prompt.suggestion(gen.tokens, gen.finish_reason)
        if not insert and not found and prompt.stop is not None:
            _note_withheld(first, prompt.stop.syntax, path, offset)
        if not insert or not insert.strip() or any(insert == s.text for s in found):
            continue
        # The stop rules already dropped text repeating the rest of the line, so the
        # suggestion is a pure insertion at the cursor.
        stats = gen.stats.to_dict()
        if prompt.stop is not None and prompt.stop.syntax is not None:
            stats.update(prompt.stop.syntax.stats())
        found.append(
            Suggestion(
                text=insert,
                start=offset,
                end=offset,
                multiline="\n" in insert,
                finish_reason=gen.finish_reason,
                stats=stats,
            )
        )
    return found, first


def _note_withheld(gen: Any, verdict: Any, path: str | None, offset: int) -> None:
    """Keep on the generation, and say in the debug log, why its text is not shown."""
    reason = withheld(verdict)
    if reason is not None and gen is not None:
        gen.withheld, gen.withheld_stats = reason, verdict.stats()
        log.debug("suggestion withheld at %s offset %d: %s", path or "(no path)", offset, reason)


def _first_token_not(engine, constraint, banned: list[int]):
    """`constraint` with the first generated token also kept out of `banned`; None when nothing is left."""
    import torch

    allowed = torch.ones(engine.vocab_size, dtype=torch.bool, device=engine.device)
    allowed[torch.tensor(banned, dtype=torch.long, device=engine.device)] = False
    base = constraint([]) if constraint is not None else None
    first = allowed if base is None else base.to(allowed.device) & allowed
    if not bool(first.any()):
        return None

    def combined(tokens):
        if not tokens:
            return first
        return constraint(tokens) if constraint is not None else None

    return combined


class LocalEngine(Protocol):
    """What LocalCompleter uses of the engine (engine/engine.py's Engine; docs/ENGINE_API.md)."""

    tokenizer: Any
    model_id: str
    name: str
    device: Any
    max_context: int
    vocab_size: int  # the LM head's rows (alternatives ban first tokens over it)
    eos_token_ids: Any
    calibration: Any  # its speculation record (None: none to calibrate)
    model: Any  # the torch module (None: nothing to calibrate)
    cache: Any  # the prefix KV cache

    def generate(self, prompt_ids: Sequence[int], params: Any, **kw: Any) -> Any: ...

    def draft_in_use(self) -> str | None: ...

    def decode_step_in_use(self) -> str | None: ...

    def tokenizer_in_use(self) -> str | None: ...


class LocalCompleter:
    """The engine in this daemon as the service's Completer. on_round: called after every decode round
    (tools and tests watch rounds with it)."""

    backend = Backend.LOCAL

    def __init__(self, engine: LocalEngine, on_round: OnRound | None = None):
        self.engine = engine
        self.on_round = on_round
        self.model_id: str = engine.model_id
        self.name: str = engine.name or engine.model_id
        self.device: str = str(engine.device)

    def complete(
        self,
        text: str,
        offset: int,
        cfg: Config,
        *,
        cancel: Any,
        path: str | None = None,
        language: str | None = None,
        context: Sequence[tuple[str, str]] = (),
        tree: Any = None,
    ) -> Completion:
        rounds = 0
        after_cancel = 0  # rounds finished after the request was cancelled: the engine's reaction time

        def on_round(tokens: list[int]) -> None:
            nonlocal rounds, after_cancel
            rounds += 1
            if cancel is not None and cancel.cancelled:
                after_cancel += 1
            if self.on_round is not None:
                self.on_round(tokens)

        tag_cache(self.engine, path)
        try:
            found, gen = suggest_alternatives(
                self.engine,
                text,
                offset,
                cfg,
                cancel=cancel,
                on_round=on_round,
                path=path,
                language=language,
                context=context,
                tree=tree,
            )
        except Exception as exc:
            if not _is_oom(exc):
                raise
            # Fail this request only: drop every cached sequence (the failed one was released into the
            # cache on the way out) and hand the memory back, so the next request can run.
            self.free_memory()
            log.error("out of memory during a completion; KV cache cleared: %s", exc)
            raise OutOfMemory(
                f"out of memory on {self.device}; the KV cache was cleared, "
                "try again (or lower cacheMegabytes / prefixTokens)"
            ) from None
        if gen is None:  # nothing to complete here (e.g. a minified line): no engine work
            return Completion()
        stats = gen.stats.to_dict()
        stats.setdefault("rounds", rounds)
        stats["rounds_after_cancel"] = after_cancel
        done = Completion(found, gen.finish_reason, stats, prompt_warnings(self.engine, cfg), gen)
        if not found and getattr(gen, "withheld", None):
            done.withheld = gen.withheld
            stats.update(gen.withheld_stats)
        return done

    def budgets(self, cfg: Config) -> tuple[int, int, int] | None:
        try:
            return builder_for(self.engine, cfg).budgets(True)
        except PromptError:
            return None  # complete() reports it

    def token_counter(self) -> Callable[[str], int] | None:
        tokenizer = self.engine.tokenizer
        return lambda s: len(tokenizer.encode(s, add_special_tokens=False))

    def describe(self) -> dict[str, str | None]:
        engine = self.engine
        return {
            "draft": engine.draft_in_use(),
            "decode_step": engine.decode_step_in_use(),
            "tokenizer": engine.tokenizer_in_use(),
        }

    def free_memory(self) -> None:
        """Empty the engine's prefix KV cache and return freed GPU memory (worker thread)."""
        self.engine.cache.clear()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def warmup(
        self,
        text: str,
        offset: int | None,
        cfg: Config,
        *,
        path: str | None = None,
        language: str | None = None,
        context: Sequence[tuple[str, str]] = (),
    ) -> Any:
        if not hasattr(self.engine, "warm"):  # an engine without a prefix cache to warm
            return None
        try:
            builder = builder_for(self.engine, cfg)
        except PromptError:
            return None
        return Warmup(self.engine, builder, text, offset, context, path, language)

    def cache_stats(self) -> dict[str, Any] | None:
        cache = getattr(self.engine, "cache", None)
        return cache.stats() if cache is not None and hasattr(cache, "stats") else None

    def background_calibration(self, min_params: int | None, on_done: Callable[[str], None]) -> Any:
        """A model that has neither a user record nor shipped defaults is calibrated on the engine thread
        whenever no request waits (a request preempts it within one round); None otherwise."""
        engine = self.engine
        cal, model = engine.calibration, engine.model
        if cal is None or cal.source != "heuristic" or model is None:  # None: nothing to calibrate
            return None
        from completiond.engine.autocalibrate import (
            BACKGROUND_MIN_PARAMS,
            BackgroundCalibration,
        )

        minimum = BACKGROUND_MIN_PARAMS if min_params is None else min_params
        try:
            params = sum(p.numel() for p in model.parameters())
        except (AttributeError, TypeError):
            return None
        if params < minimum:
            return None
        return BackgroundCalibration(engine, on_done=on_done)
