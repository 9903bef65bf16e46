"""A prompt plan (completion/plan.py) rendered as text, for a team's completion server.

The server tokenizes, so the prompt is text: the FIM layout of our templates (models/fim.py
`fim_order`) written with the text spellings of the family's special tokens, which OpenAI-compatible
servers parse as those tokens (llama.cpp's `/infill` instead gets the prefix, suffix and context files
and lays them out with the model's own FIM tokens). The windows are the planner's, the same rules as
the local engine's; without a tokenizer their budgets (prefixTokens, suffixTokens, contextTokens) are
counted as one token per CHARS_PER_TOKEN characters: code averages 3-4.

What leaves the machine is exactly what `TextEncoder.lay_out` puts in the prompt: the prefix and suffix
windows of the current document, the current file's name (not its directory), and the context snippets
the workspace picked (completion/workspace/: only the editor's open documents and files under its
workspace folders, never hidden, ignored or secret-looking files).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from completiond.completion.languages import comment_for
from completiond.completion.plan import PromptPlan
from completiond.config import Config
from completiond.models.fim import (
    MIDDLE_TOKEN,
    PREFIX,
    PREFIX_TOKEN,
    SUFFIX,
    SUFFIX_TOKEN,
    TextLayout,
    fim_order,
    text_layout,
)

CHARS_PER_TOKEN = 4
ZERO_WIDTH = "\u200b"

# The served model's name says its family when fimTemplate is auto (there is no tokenizer to look at).
_NAME_HINTS = (
    ("completiond", "completiond"),
    ("qwen", "qwen2.5-coder"),
    ("starcoder", "starcoder"),
    ("deepseek", "deepseek-coder"),
    ("codellama", "codellama"),
    ("code-llama", "codellama"),
    ("codestral", "codestral"),
)


def template_for(cfg: Config) -> tuple[str, list[str]]:
    """(template name, warnings) for a team server's settings."""
    name = cfg.fim_template
    if name != "auto":
        return name, []
    model = (cfg.endpoint_model or "").lower()
    for hint, template in _NAME_HINTS:
        if hint in model:
            return template, []
    if cfg.backend == "llamacpp-infill":
        return "none", []  # the server lays out FIM itself; only the stop strings would come from a template
    return "none", [
        f"fimTemplate: auto cannot tell the FIM template of the served model "
        f"({cfg.endpoint_model or 'endpointModel is unset'}); suggestions continue the text before the "
        "cursor only. Set completiond.fimTemplate to the model's family (e.g. qwen2.5-coder)"
    ]


@dataclass
class TextPrompt:
    """A rendered plan: the whole prompt in the family's layout (OpenAI-compatible servers), and its
    windows and files as they are (llama.cpp's /infill lays them out itself)."""

    prompt: str
    prefix: str
    suffix: str
    files: list[tuple[str, str]] = field(default_factory=list)


class TextEncoder:
    """The plan's encoder for a team server: a unit is CHARS_PER_TOKEN characters of text.

    infill: the server lays out FIM itself (llama.cpp's /infill): it always takes a suffix and the
    context files, whatever the template."""

    split_before_newline = False

    def __init__(self, layout: TextLayout, infill: bool = False):
        self.layout = layout
        self.infill = infill
        self.name = layout.name
        self.supports_suffix = infill or layout.suffix is not None
        self.supports_file_context = infill or layout.file_sep is not None
        self.context_style = "paths" if infill else layout.context_style
        self.prefix_leading_space = layout.prefix_leading_space and not infill
        self._spellings = _spellings(layout)

    @classmethod
    def for_template(cls, name: str, infill: bool = False) -> "TextEncoder":
        """FimError for an unknown template name."""
        return cls(text_layout(name), infill)

    def encode(self, text: str, first: bool = False) -> list[str]:
        return [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]

    def cursor(self, text: str, first: bool, heal: bool) -> list[str]:
        return self.encode(text)  # no tokenizer, no token healing

    def files(self, files: Sequence[tuple[str, str]], current_path: str | None) -> list[str]:
        if self.infill:  # sent as they are, beside the prompt
            return self.encode("".join(f"{p}\n{t}" for p, t in files))
        return self.encode(_context(self.layout, files, _name(current_path), None))

    def decoded_chars(self, units: Sequence[Any]) -> int:
        return sum(len(u) for u in units)

    def lay_out(self, plan: PromptPlan, text: str, language: str | None = None) -> TextPrompt:
        cursor = self.encode(text[plan.cursor_start : plan.cursor])
        if plan.cursor_keep is not None and len(cursor) > plan.cursor_keep:
            cursor = cursor[-plan.cursor_keep :]
        prefix = "".join(text[b:e] for b, e in plan.head) + "".join(cursor)
        suffix = "".join(text[b:e] for b, e in plan.suffix)
        if plan.suffix_keep is not None:
            suffix = "".join(self.encode(suffix)[: plan.suffix_keep])
        if self.infill:
            return TextPrompt("", plan.context_text + prefix, suffix, list(plan.context_files))
        neutral = self._neutral
        files = [(p, neutral(t)) for p, t in plan.context_files]
        prompt = render(
            self.layout, neutral(plan.context_text + prefix), neutral(suffix), files, _name(plan.context_path), language
        )
        return TextPrompt(prompt, prefix, suffix, list(plan.context_files))

    @property
    def stop(self) -> list[str]:
        """The family's end markers as text, for the server's stop list (at most 8: OpenAI's limit is 4,
        most servers take more)."""
        return [s.replace("▁", " ") for s in self.layout.ends][:8]

    def _neutral(self, text: str) -> str:
        """Document text with special-token spellings broken by a zero-width space: the server would
        otherwise read `<|fim_middle|>` in a file as the token itself and derail the prompt."""
        for s in self._spellings:
            if s in text:
                text = text.replace(s, s[0] + ZERO_WIDTH + s[1:])
        return text


def render(
    layout: TextLayout,
    prefix: str,
    suffix: str,
    context: Sequence[tuple[str, str]] = (),
    current_path: str | None = None,
    language: str | None = None,
) -> str:
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
    parts = {PREFIX: prefix, SUFFIX: suffix, PREFIX_TOKEN: pre, SUFFIX_TOKEN: suf, MIDDLE_TOKEN: mid}
    return head + "".join(parts[p] or "" for p in fim_order(layout.name, layout.spm))


def _name(path: str | None) -> str | None:
    """The current file as the server sees it: its name, never its directory."""
    return os.path.basename(path) if path else None


def _context(
    layout: TextLayout, files: Sequence[tuple[str, str]], current_path: str | None, language: str | None
) -> str:
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
