"""Document + cursor -> text prompt -> a team's completion server -> suggestion.

The remote twin of suggest.py. The prompt is planned as the local engine's is (completion/plan.py) and
rendered as text (completion/text_prompt.py). What the user sees goes through the same text stop rules
as a local completion (completion/stops.py: single/multi-line policy, block ends, bracket balance,
repeated next line, suffix trimming), applied to the stream as it arrives: the first cut closes the
stream, so the server stops generating too.
"""

from __future__ import annotations

from typing import Any, Sequence

from completiond.backends.remote import RemoteBackend, RemoteGeneration, RemoteRequest
from completiond.completion.plan import Planner, PromptOptions, skip_reason
from completiond.completion.stops import TextRules, document_site, postprocess
from completiond.completion.suggest import PromptError, Suggestion
from completiond.completion.text_prompt import TextEncoder, template_for
from completiond.models.fim import FimError

__all__ = ["suggest_remote", "template_for"]


def suggest_remote(backend: RemoteBackend, text: str, offset: int, cfg: Any, *, cancel: Any,
                   path: str | None = None, language: str | None = None,
                   context: Sequence[tuple[str, str]] = ()) -> tuple[list[Suggestion], RemoteGeneration | None,
                                                                     list[str]]:
    """One remote completion: (suggestions, the generation or None if skipped, warnings for the user).

    Raises PromptError for settings no prompt can be built for, RemoteError when the server fails."""
    if not 0 <= offset <= len(text):
        raise PromptError(f"cursor offset {offset} outside a document of {len(text)} characters")
    options = PromptOptions.from_config(cfg)
    if skip_reason(text, offset, options) is not None:
        return [], None, []
    name, warnings = template_for(cfg)
    infill = cfg.backend == "llamacpp-infill"
    try:
        encoder = TextEncoder.for_template(name, infill)
    except FimError as exc:
        raise PromptError(str(exc)) from None
    if cfg.alternatives > 1:
        warnings.append("alternatives: a remote backend gives one suggestion at a time")

    plan = Planner(encoder, options).plan(text, offset, context, path, language, heal=False)
    rules = TextRules(plan.line_prefix, plan.line_suffix, plan.following, cfg.multiline, cfg.max_lines,
                      document_site(text, offset, language, path), getattr(cfg, "syntax_check", True))
    prompt = encoder.render(plan, text, language)
    req = RemoteRequest(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                        seed=cfg.seed)
    if infill:
        req.input_prefix, req.input_suffix, req.input_extra = prompt.prefix, prompt.suffix, prompt.files
    else:
        req.prompt = prompt.prompt
    req.stop = encoder.stop
    if not rules.multiline:
        req.stop.append("\n")  # the stop rules would cut there anyway: the server need not go on

    gen = backend.complete(req, cancel=cancel, on_text=lambda s: rules.find_cut(s) is not None)
    gen.stats["token_healing"] = False
    if gen.finish_reason == "cancelled":
        return [], gen, warnings
    insert = postprocess(gen.text, rules, truncated=gen.finish_reason == "length")
    if rules.syntax is not None:
        gen.stats.update(rules.syntax.stats())
    if not insert or not insert.strip():
        return [], gen, warnings
    return [Suggestion(text=insert, start=offset, end=offset, multiline="\n" in insert,
                       finish_reason=gen.finish_reason, stats=dict(gen.stats))], gen, warnings


