"""A team's completion server as a Completer: document + cursor -> text prompt -> server -> suggestion.

The prompt is planned as the local engine's is (completion/plan.py) and rendered as text
(completion/text_prompt.py). What the user sees goes through the same text stop rules as a local
completion (completion/stops.py: single/multi-line policy, block ends, bracket balance, repeated next
line, suffix trimming), applied to the stream as it arrives: the first cut closes the stream, so the
server stops generating too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from completiond.backends.team_server import TeamRequest, TeamServer
from completiond.completion.completer import (
    Backend,
    Completion,
    PromptError,
    Suggestion,
    withheld,
)
from completiond.completion.plan import Planner, PromptOptions, skip_reason
from completiond.completion.stops import TextRules, document_site, postprocess
from completiond.completion.text_prompt import TextEncoder, template_for
from completiond.config import Config
from completiond.models.fim import FimError

__all__ = ["TeamCompleter", "template_for"]


class TeamCompleter:
    """A team server (backends/team_server.py) as the service's Completer: one suggestion at a time, no
    token healing, no calibration."""

    def __init__(self, server: TeamServer):
        self.server = server
        self.backend = Backend(server.api)
        self.model_id = server.model_id
        self.name = server.model_id
        self.device = "remote"

    def _encoder(self, cfg: Config) -> tuple[TextEncoder, list[str]]:
        name, warnings = template_for(cfg)
        try:
            return TextEncoder.for_template(name, self.backend is Backend.LLAMACPP_INFILL), warnings
        except FimError as exc:
            raise PromptError(str(exc)) from None

    def budgets(self, cfg: Config) -> tuple[int, int, int] | None:
        try:
            return Planner(self._encoder(cfg)[0], PromptOptions.from_config(cfg)).budgets(True)
        except PromptError:
            return None  # complete() reports it

    def token_counter(self) -> Callable[[str], int] | None:
        return None  # the server tokenizes: the workspace counts characters

    def describe(self) -> dict[str, str | None]:
        return {"draft": None, "decode_step": None, "tokenizer": None}

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
        return None  # the server keeps its own cache

    def cache_stats(self) -> dict[str, Any] | None:
        return None

    def background_calibration(self, min_params: int | None, on_done: Callable[[str], None]) -> Any:
        return None  # nothing of ours to calibrate

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
        """One completion from the server. Raises PromptError for settings no prompt can be built for,
        TeamServerError when the server fails."""
        options = PromptOptions.from_config(cfg)
        if skip_reason(text, offset, options) is not None:
            return Completion()
        encoder, warnings = self._encoder(cfg)
        if cfg.alternatives > 1:
            warnings.append("alternatives: a remote backend gives one suggestion at a time")

        plan = Planner(encoder, options).plan(text, offset, context, path, language, heal=False)
        rules = TextRules(
            plan.line_prefix,
            plan.line_suffix,
            plan.following,
            cfg.multiline,
            cfg.max_lines,
            document_site(text, offset, language, path, tree),
            getattr(cfg, "syntax_check", True),
        )
        prompt = encoder.lay_out(plan, text, language)
        req = TeamRequest(
            max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed
        )
        if encoder.infill:
            req.input_prefix, req.input_suffix, req.input_extra = prompt.prefix, prompt.suffix, prompt.files
        else:
            req.prompt = prompt.prompt
        req.stop = encoder.stop
        if not rules.multiline:
            req.stop.append("\n")  # the stop rules would cut there anyway: the server need not go on

        gen = self.server.complete(req, cancel=cancel, on_text=lambda s: rules.find_cut(s) is not None)
        gen.stats["token_healing"] = False
        stats = dict(gen.stats)
        if stats.get("generated_tokens") and stats.get("total_ms"):
            stats["tokens_per_s"] = round(stats["generated_tokens"] / (stats["total_ms"] / 1000), 1)
            stats["decode_ms"] = stats["total_ms"]
        done = Completion([], gen.finish_reason, stats, warnings, gen)
        if gen.finish_reason == "cancelled":
            return done
        insert = postprocess(gen.text, rules, truncated=gen.finish_reason == "length")
        if rules.syntax is not None:
            gen.stats.update(rules.syntax.stats())
            done.stats.update(rules.syntax.stats())
        if not insert or not insert.strip():
            done.withheld = withheld(rules.syntax)
        if insert and insert.strip():
            done.suggestions.append(
                Suggestion(
                    text=insert,
                    start=offset,
                    end=offset,
                    multiline="\n" in insert,
                    finish_reason=gen.finish_reason,
                    stats=dict(gen.stats),
                )
            )
        return done
