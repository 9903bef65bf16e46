"""Document + cursor -> text prompt -> a team's completion server -> suggestion.

The remote twin of suggest.py. The server tokenizes, so the prompt is text: the FIM layout of our
templates (models/fim.py) written with the text spellings of the family's special tokens, which
OpenAI-compatible servers parse as those tokens (llama.cpp's `/infill` instead gets the prefix, suffix
and context files and lays them out with the model's own FIM tokens). What the user sees goes through
the same text stop rules as a local completion (completion/stops.py: single/multi-line policy, block
ends, bracket balance, repeated next line, suffix trimming), applied to the stream as it arrives: the
first cut closes the stream, so the server stops generating too.

Without a tokenizer there is no token healing, and the token budgets (prefixTokens, suffixTokens,
contextTokens) are counted as CHARS_PER_TOKEN characters per token: code averages 3-4.

What leaves the machine is exactly what this module puts in the request: the prefix and suffix windows
of the current document, the current file's name (not its directory), and the context snippets the
workspace picked (completion/workspace.py: only the editor's open documents and files under its
workspace folders, never hidden, ignored or secret-looking files).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from completiond.backends.remote import RemoteBackend, RemoteGeneration, RemoteRequest
from completiond.completion.prompt import PromptOptions, skip_reason
from completiond.completion.stops import TextRules, document_site, postprocess
from completiond.completion.suggest import PromptError, Suggestion
from completiond.completion.workspace import comment_for
from completiond.models.fim import FimError, TextLayout, text_layout

CHARS_PER_TOKEN = 4
CHUNK_LINES = 16      # the prefix window starts on a multiple of this line number (stable across keystrokes)
FOLLOWING_CHARS = 4000
ZERO_WIDTH = "\u200b"

# The served model's name says its family when fimTemplate is auto (there is no tokenizer to look at).
_NAME_HINTS = (("completiond", "completiond"), ("qwen", "qwen2.5-coder"), ("starcoder", "starcoder"),
               ("deepseek", "deepseek-coder"), ("codellama", "codellama"), ("code-llama", "codellama"),
               ("codestral", "codestral"))


def template_for(cfg: Any) -> tuple[str, list[str]]:
    """(template name, warnings) for a remote backend's settings."""
    name = cfg.fim_template
    if name != "auto":
        return name, []
    model = (cfg.endpoint_model or "").lower()
    for hint, template in _NAME_HINTS:
        if hint in model:
            return template, []
    if cfg.backend == "llamacpp-infill":
        return "none", []  # the server lays out FIM itself; only the stop strings would come from a template
    return "none", [f"fimTemplate: auto cannot tell the FIM template of the served model "
                    f"({cfg.endpoint_model or 'endpointModel is unset'}); suggestions continue the text before the "
                    "cursor only. Set completiond.fimTemplate to the model's family (e.g. qwen2.5-coder)"]


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
    try:
        layout = text_layout(name)
    except FimError as exc:
        raise PromptError(str(exc)) from None
    if cfg.alternatives > 1:
        warnings.append("alternatives: a remote backend gives one suggestion at a time")

    ls = text.rfind("\n", 0, offset) + 1
    le = text.find("\n", offset)
    le = len(text) if le < 0 else le
    line_prefix, line_suffix = text[ls:offset], text[offset:le]
    following = text[le + 1:min(len(text), le + 1 + FOLLOWING_CHARS)] if le < len(text) else ""
    rules = TextRules(line_prefix, line_suffix, following, cfg.multiline, cfg.max_lines,
                      document_site(text, offset, language, path), getattr(cfg, "syntax_check", True))

    context_chars = sum(len(p) + len(t) for p, t in context)
    prefix_chars = max(CHARS_PER_TOKEN * 16, cfg.prefix_tokens * CHARS_PER_TOKEN - context_chars)
    prefix = text[prefix_start(text, offset, prefix_chars):offset]
    suffix = ""
    if layout.suffix is not None or cfg.backend == "llamacpp-infill":
        suffix = text[offset:suffix_end(text, offset, cfg.suffix_tokens * CHARS_PER_TOKEN)]
    current = os.path.basename(path) if path else None

    req = RemoteRequest(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                        seed=cfg.seed)
    spellings = _spellings(layout)
    if cfg.backend == "llamacpp-infill":
        req.input_prefix, req.input_suffix = prefix, suffix
        req.input_extra = [(p, t) for p, t in context]
    else:
        req.prompt = render(layout, _neutral(prefix, spellings), _neutral(suffix, spellings),
                            [(p, _neutral(t, spellings)) for p, t in context], current, language)
    req.stop = [s.replace("▁", " ") for s in layout.ends][:8]
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


def render(layout: TextLayout, prefix: str, suffix: str, context: Sequence[tuple[str, str]] = (),
           current_path: str | None = None, language: str | None = None) -> str:
    """The prompt text in `layout`: context block, then the family's FIM layout (suffix first where the
    family was trained on it, as the local engine does, so typing only appends to the prompt and the
    server's prefix cache keeps serving it)."""
    pre, suf, mid = (_text(t) for t in (layout.prefix, layout.suffix, layout.middle))
    pre = pre.lstrip() if pre is not None else None  # CodeLlama's "▁<PRE>" opens the prompt: no space before it
    head = _context(layout, context, current_path, language)
    if layout.file_sep is None:
        prefix, head = head + prefix, ""  # no repository format: the snippets lead the prefix as comments
    if layout.prefix_leading_space:
        prefix = " " + prefix
    if layout.name == "none" or pre is None:
        return head + prefix
    if layout.name == "codestral":
        return f"{head}{suf}{suffix}{pre}{prefix}"
    if layout.spm:
        return f"{head}{pre}{suf}{suffix}{mid}{prefix}"
    return f"{head}{pre}{prefix}{suf}{suffix}{mid}"


def _context(layout: TextLayout, files: Sequence[tuple[str, str]], current_path: str | None,
             language: str | None) -> str:
    if not files:
        return ""
    if layout.file_sep is not None and layout.context_style == "separators":
        return "".join((t if t.endswith("\n") else t + "\n") + layout.file_sep for _, t in files)
    if layout.file_sep is not None:
        block = "".join(f"{layout.file_sep}{p}\n{t if t.endswith(chr(10)) else t + chr(10)}" for p, t in files)
        return block + (f"{layout.file_sep}{current_path}\n" if current_path else "")
    comment = comment_for(language)
    if not comment:
        return ""
    return "".join(f"{comment} {p}\n{t if t.endswith(chr(10)) else t + chr(10)}" for p, t in files)


def _text(spelling: str | None) -> str | None:
    """SentencePiece's `▁` is a space in text (CodeLlama's ` <SUF>`); a leading one before the first
    marker would be a stray space at the start of the prompt."""
    return None if spelling is None else spelling.replace("▁", " ")


def _spellings(layout: TextLayout) -> list[str]:
    out = [s for s in (layout.prefix, layout.suffix, layout.middle, layout.file_sep, layout.repo_name) if s]
    out += list(layout.ends)
    return sorted({s.replace("▁", " ").strip() for s in out if s.strip("▁ ")}, key=len, reverse=True)


def _neutral(text: str, spellings: list[str]) -> str:
    """Document text with special-token spellings broken by a zero-width space: the server would
    otherwise read `<|fim_middle|>` in a file as the token itself and derail the prompt."""
    for s in spellings:
        if s in text:
            text = text.replace(s, s[0] + ZERO_WIDTH + s[1:])
    return text


def prefix_start(text: str, cursor: int, budget_chars: int) -> int:
    """Where the prefix window starts: the first line, at a multiple of CHUNK_LINES, whose text to the
    cursor fits in budget_chars. It moves by whole chunks, not on every keystroke, so the server's
    prefix cache keeps matching; the cursor line is always kept (clipped if it alone is too long)."""
    ls = text.rfind("\n", 0, cursor) + 1
    floor = cursor - budget_chars
    if floor <= 0:
        return 0
    if floor >= ls:
        return floor  # the cursor line alone is over the budget: keep its end
    line = text.count("\n", 0, floor) + 1              # first line starting after the floor
    first = pos = text.find("\n", floor) + 1
    while line % CHUNK_LINES and pos < ls:
        pos = text.find("\n", pos) + 1
        line += 1
    # No chunk start fits before the cursor line: take the whole lines that fit (the window then moves
    # line by line, a small budget's price).
    return pos if pos < ls else min(first, ls)


def suffix_end(text: str, cursor: int, budget_chars: int) -> int:
    """Where the suffix window ends: at a line end within budget_chars (or the budget, when the rest of
    the cursor line alone is longer)."""
    if budget_chars <= 0:
        return cursor
    hi = cursor + budget_chars
    if hi >= len(text):
        return len(text)
    nl = text.rfind("\n", cursor, hi)
    return nl + 1 if nl >= 0 else hi
