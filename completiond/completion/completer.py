"""What completes: the local engine or a team's completion server, behind one protocol.

`Backend` is the closed set of places a completion can come from (the `backend` setting). Each has one
`Completer`: `LocalCompleter` (completion/suggest.py: the engine, token ids in and out) and
`TeamCompleter` (completion/team.py: a team server, text in and out). Both plan their prompts with the
same Planner (completion/plan.py) and end in the same text stop rules (completion/stops.py). The
service holds one Completer and never asks which kind it is; `suggest` is the one entry point.

All offsets are Python string (code point) offsets into the document text.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from completiond.config import Config
from completiond.errors import CompletionError


class Backend(enum.Enum):
    """Where completions come from (the `backend` setting)."""

    LOCAL = "local"  # the engine in this daemon
    OPENAI = "openai"  # an OpenAI-compatible /v1/completions server
    LLAMACPP_INFILL = "llamacpp-infill"  # llama.cpp's /infill

    @classmethod
    def of(cls, name: str) -> Backend:
        try:
            return cls(name)
        except ValueError:
            raise PromptError(f"unknown backend {name!r}; expected one of {', '.join(b.value for b in cls)}") from None


@dataclass
class Suggestion:
    text: str  # insert text at the cursor
    start: int  # replaced range [start, end) in the document
    end: int
    multiline: bool
    finish_reason: str
    stats: dict[str, Any]


class PromptError(CompletionError, ValueError):
    """Settings or a request that no prompt can be built for."""


@dataclass
class Completion:
    """One request's answer: up to `alternatives` different suggestions, best first.

    finish_reason None: nothing was attempted here (e.g. a minified line), nothing generated."""

    suggestions: list[Suggestion] = field(default_factory=list)
    finish_reason: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # settings problems worked around, for the user
    generation: Any = None  # the first generation as the completer made it (tokens, for tools and tests)
    withheld: str | None = None  # why the model's suggestion is not shown (the syntax check dropped it)

    @property
    def suggestion(self) -> Suggestion | None:
        return self.suggestions[0] if self.suggestions else None

    @property
    def skipped(self) -> bool:
        return self.finish_reason is None


OnRound = Callable[[list[int]], None]


def withheld(verdict: Any) -> str | None:
    """Why a suggestion the model made is not shown, from the syntax check's verdict (syntax.Verdict); None
    when it was not withheld (shown, cut, or not checked)."""
    if verdict is None or getattr(verdict, "outcome", None) != "dropped":
        return None
    return f"syntax check: {verdict.reason or 'adds a syntax error'}"


class Completer(Protocol):
    """The one interface the service completes through."""

    backend: Backend
    model_id: str  # identity of what answers (a model hash, or the endpoint and its model)
    name: str  # what users read
    device: str

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
        """One completion on the worker thread. Raises PromptError (or another CompletionError) for a
        request it cannot serve. tree: the document's syntax tree when the caller keeps one (syntax.py)."""
        ...

    def budgets(self, cfg: Config) -> tuple[int, int, int] | None:
        """The prompt's (prefix, suffix, context) budgets for these settings; None: no prompt can be built."""
        ...

    def token_counter(self) -> Callable[[str], int] | None:
        """How the workspace should count the context block's size (None: characters)."""
        ...

    def describe(self) -> dict[str, str | None]:
        """What it runs with: draft, decode_step, tokenizer (None where it has none)."""
        ...

    def background_calibration(self, min_params: int | None, on_done: Callable[[str], None]) -> Any:
        """A calibration job to run between requests (engine/autocalibrate.py), or None."""
        ...

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
        """A background warm-up of the prompts the document's next requests start with (completion/warmup.py:
        step(cancel) -> more to do), or None where nothing can be warmed. offset None: a file just opened."""
        ...

    def cache_stats(self) -> dict[str, Any] | None:
        """What the prefix KV cache holds (bytes, budget, sequences), or None where there is none."""
        ...


def suggest(
    completer: Completer,
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
    """One completion at `offset` in `text`, from whatever completes (the one pipeline's entry point)."""
    if not 0 <= offset <= len(text):
        raise PromptError(f"cursor offset {offset} outside a document of {len(text)} characters")
    return completer.complete(
        text, offset, cfg, cancel=cancel, path=path, language=language, context=context, tree=tree
    )
