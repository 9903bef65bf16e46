"""The local engine's prompts: a prompt plan (completion/plan.py) rendered as token ids.

`TokenEncoder` is the plan's encoder for one model: it tokenizes pieces (cached, so the planner's
measure and the rendering tokenize each piece once), heals the cursor piece, and lays the ids out
in the model's FIM template (models/fim.py). `PromptBuilder` plans and renders one prompt:

    builder = PromptBuilder.for_engine(engine, cfg)
    prompt = builder.build(text, offset, context=ws.context(...), path=rel_path, language="python")

Built for the prefix KV cache. With a suffix-first (SPM) template the prompt is
`context | FIM start | suffix | FIM middle | prefix chunks | cursor line` (the bundled model's
context sits at the start of the prefix instead: `FIM start | suffix | FIM middle | context |
prefix chunks | cursor line`), so typing at the cursor changes only the last few ids and everything
before them is served from the cache (the planner's window rules keep that true).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from completiond.completion.healing import Healing, TokenHealer
from completiond.completion.plan import CHARS_PER_TOKEN, Planner, PromptOptions, PromptPlan, skip_reason
from completiond.completion.stops import StopRules
from completiond.config import Config
from completiond.engine.model_info import ModelInfo
from completiond.models.fim import FimError, FimTemplate, make_template

__all__ = ["CHARS_PER_TOKEN", "Prompt", "PromptBuilder", "PromptOptions", "TokenEncoder", "skip_reason"]


# The suffix's share of a request's wait: on a CPU it is at most what the engine's planning rate (model_facts) gets
# through in this time, and never fewer tokens than SUFFIX_MIN_TOKENS. In a prefix-first layout every keystroke
# prefills the cursor line and the whole suffix again (they follow the cursor), so this bounds what typing costs
# beyond a step: at 0.25 s a keystroke at the 0.5B shape on 2 cores took about 0.6 s (issue 45, 2026-12-06).
SUFFIX_PREFILL_S = 0.1
SUFFIX_MIN_TOKENS = 32


@dataclass
class Prompt:
    """Everything one request needs around `engine.generate`: the ids, the healing constraint and
    the stop rules. Made by `PromptBuilder.build`. If skip_reason is set, ids is empty: show nothing.

        gen = engine.generate(prompt.ids, params, stop=prompt.stop, constraint=prompt.constraint)
        text = prompt.suggestion(gen.tokens, gen.finish_reason)
    """

    ids: list[int]
    skip_reason: str | None = None
    prefix_ids: list[int] = field(default_factory=list)
    suffix_ids: list[int] = field(default_factory=list)
    context_ids: list[int] = field(default_factory=list)  # the context block, wherever the layout puts it
    healing: Healing | None = None
    line_prefix: str = ""  # cursor line up to the cursor
    line_suffix: str = ""  # cursor line after the cursor
    following: str = ""  # text after the cursor line (bounded), for the stop rules' duplicate checks
    prefix_start: int = 0  # document offset where the prefix window starts (may be the newline before its first line)
    prefix_line: int = 0  # absolute number of the first line in the prefix window
    suffix_end: int = 0  # document offset where the suffix window ends
    cursor_line_tokens: int = 0
    stop: StopRules | None = None  # when generation ends, and what of it the editor shows

    @property
    def skipped(self) -> bool:
        return self.skip_reason is not None

    @property
    def constraint(self):
        return self.healing.constraint if self.healing is not None else None

    def suggestion(self, tokens: Sequence[int], finish_reason: str | None = None) -> str:
        """Text to show after the cursor ('' = show nothing); pass the Generation's finish_reason."""
        return self.stop.suggestion(tokens, finish_reason) if self.stop is not None else ""


class TokenEncoder:
    """The plan's encoder for one model's FIM template: units are token ids. Keeps a small cache of
    tokenized pieces (the same pieces come back on every keystroke). Not thread-safe."""

    def __init__(self, template: FimTemplate, healer: TokenHealer | None = None, piece_cache_entries: int = 4096):
        self.template = template
        self.healer = healer
        self.name = template.name
        self.split_before_newline = bool(getattr(template, "split_before_newline", False))
        self.supports_suffix = template.supports_suffix
        self.supports_file_context = template.supports_file_context
        self.context_style = template.context_style
        self.prefix_leading_space = template.prefix_leading_space
        self._pieces: OrderedDict[tuple[bool, str], tuple[int, ...]] = OrderedDict()
        self._max_pieces = piece_cache_entries
        self._last_cursor: tuple[tuple[str, bool, bool], tuple[list[int], Healing | None]] | None = None
        self.tokenized_chars = 0  # characters actually sent to the tokenizer (tests check the bound)

    def encode(self, text: str, first: bool = False) -> list[int]:
        key = (first, text)
        hit = self._pieces.get(key)
        if hit is not None:
            self._pieces.move_to_end(key)
            return list(hit)
        self.tokenized_chars += len(text)
        ids = tuple(self.template.encode(text, first=first))
        self._pieces[key] = ids
        if len(self._pieces) > self._max_pieces:
            self._pieces.popitem(last=False)
        return list(ids)

    def healed(self, text: str, first: bool, heal: bool) -> tuple[list[int], Healing | None]:
        """The cursor piece's ids and its healing (the planner measures it, the rendering uses it)."""
        key = (text, first, heal)
        if self._last_cursor is not None and self._last_cursor[0] == key:
            ids, healing = self._last_cursor[1]
            return list(ids), healing
        ids = self.encode(text, first=first) if text else []
        healing = None
        if heal and self.healer is not None and ids:
            ids, healing = self.healer.heal(ids)
        self._last_cursor = (key, (list(ids), healing))
        return ids, healing

    def cursor(self, text: str, first: bool, heal: bool) -> list[int]:
        return self.healed(text, first, heal)[0]

    def files(self, files: Sequence[tuple[str, str]], current_path: str | None) -> list[int]:
        return self.template.context_ids(files, current_path=current_path)

    def decoded_chars(self, units: Sequence[Any]) -> int:
        return len(self.template.tokenizer.decode(list(units)))

    def lay_out(
        self, plan: PromptPlan, text: str
    ) -> tuple[list[int], list[int], list[int], list[int], Healing | None, int]:
        """(prompt ids, prefix ids, suffix ids, context block ids, healing, cursor line tokens) of a plan."""
        head_ids: list[int] = []
        for k, (b, e) in enumerate(plan.head):
            head_ids += self.encode(text[b:e], first=plan.first_leading_space and k == 0)
        cursor_ids, healing = self.healed(text[plan.cursor_start : plan.cursor], plan.cursor_first, plan.heal)
        if plan.cursor_keep is not None and len(cursor_ids) > plan.cursor_keep:
            cursor_ids = cursor_ids[-plan.cursor_keep :]
        file_ids = self._file_ids(plan)
        block_ids = file_ids
        if plan.context_text:
            block_ids = self.encode(plan.context_text, first=True)
            head_ids = block_ids + head_ids
        prefix_ids = head_ids + cursor_ids
        suffix_ids: list[int] = []
        for b, e in plan.suffix:
            suffix_ids += self.encode(text[b:e])
        if plan.suffix_keep is not None:
            suffix_ids = suffix_ids[: plan.suffix_keep]
        ids = self.template.build(prefix_ids, suffix_ids, file_ids)
        return ids, prefix_ids, suffix_ids, list(block_ids), healing, len(cursor_ids)

    def _file_ids(self, plan: PromptPlan) -> list[int]:
        return self.files(plan.context_files, plan.context_path) if plan.context_files else []


class PromptBuilder:
    """Builds prompts for one model's FIM template; keeps a small cache of tokenized pieces.

        builder = PromptBuilder.for_engine(engine, cfg)
        prompt = builder.build(text, offset, context=ws.context(...), path=rel_path, language="python")

    One builder per loaded model and prompt settings (`for_engine` is cheap after the first
    time: the token tables are cached per tokenizer). Not thread-safe: use it from the
    daemon's worker thread (like the engine).
    """

    def __init__(
        self,
        template: FimTemplate,
        options: PromptOptions | None = None,
        healer: TokenHealer | None = None,
        piece_cache_entries: int = 4096,
    ):
        self.template = template
        self.healer = healer
        self.encoder = TokenEncoder(template, healer, piece_cache_entries)
        self.planner = Planner(self.encoder, options)
        self.warnings: list[str] = []  # settings problems worked around (shown to the user)

    @property
    def options(self) -> PromptOptions:
        return self.planner.options

    @property
    def tokenized_chars(self) -> int:
        """Characters actually sent to the tokenizer (tests check the bound)."""
        return self.encoder.tokenized_chars

    @classmethod
    def for_model(
        cls,
        tokenizer: Any,
        cfg: Config | None = None,
        *,
        max_context: int | None = None,
        vocab_size: int | None = None,
        device: Any = "cpu",
        info: ModelInfo | None = None,
        options: PromptOptions | None = None,
    ) -> "PromptBuilder":
        """Template, healer and options for one model and these settings (a Config)."""

        cfg = cfg if cfg is not None else Config()
        info = info or ModelInfo()
        warnings = []
        try:
            template = make_template(tokenizer, cfg.fim_template, default=info.fim_template)
        except FimError as exc:
            # A fimTemplate setting that does not fit the loaded model is a
            # settings problem: report it and use what the model says.
            warnings.append(f"fimTemplate: {exc}; using auto-detection")
            template = make_template(tokenizer, "auto", default=info.fim_template)
        healer = TokenHealer.for_tokenizer(tokenizer, vocab_size, device=device)
        if info.train_context:
            # Positions past the training length work mechanically but degrade
            # quality: keep prompt + generation within what the model saw.
            max_context = min(max_context or info.train_context, info.train_context)
        builder = cls(template, options or PromptOptions.from_config(cfg, max_context), healer)
        builder.warnings = warnings
        return builder

    @classmethod
    def for_engine(cls, engine: Any, cfg: Config | None = None, **kw) -> "PromptBuilder":
        # The healing mask must match the model's logits, which can be wider than the tokenizer.
        vocab = getattr(engine, "vocab_size", None)
        rate = getattr(engine, "prefill_tokens_per_s", None)
        if rate and cfg is not None and "options" not in kw and int(cfg.suffix_tokens) > SUFFIX_MIN_TOKENS:
            # Sized for the device: after every jump the suffix is prefilled anew, so on a CPU it is at most
            # what prefills in SUFFIX_PREFILL_S at the engine's planning rate, which no clock moves (the 0.5B
            # shape: 79-176 tokens by kernel and weights; the bundled model: all).
            cap = max(SUFFIX_MIN_TOKENS, int(rate * SUFFIX_PREFILL_S))
            if cap < int(cfg.suffix_tokens):
                info = getattr(engine, "info", None)
                train = getattr(info, "train_context", None)
                max_context = min(engine.max_context, train) if train else engine.max_context
                kw["options"] = PromptOptions.from_config(cfg, max_context, suffix_tokens=cap)
        return cls.for_model(
            engine.tokenizer,
            cfg,
            max_context=engine.max_context,
            vocab_size=vocab,
            device=getattr(engine, "device", "cpu"),
            info=getattr(engine, "info", None),
            **kw,
        )

    @property
    def context_tokens(self) -> int:
        """Token budget the context block really gets (ask the workspace for this much)."""
        return self.budgets(True)[2]

    def budgets(self, with_context: bool = True) -> tuple[int, int, int]:
        """(prefix, suffix, context) token budgets after fitting them into max_prompt_tokens."""
        return self.planner.budgets(with_context)

    def build(
        self,
        text: str,
        cursor: int,
        context: Sequence[tuple[str, str]] = (),
        path: str | None = None,
        language: str | None = None,
        heal: bool | None = None,
    ) -> Prompt:
        """Prompt ids for a completion at `cursor` in `text` (Planner.plan says what goes where)."""
        plan = self.planner.plan(text, cursor, context, path, language, heal)
        if plan.skip_reason is not None:
            return Prompt(ids=[], skip_reason=plan.skip_reason)
        ids, prefix_ids, suffix_ids, block_ids, healing, cursor_tokens = self.encoder.lay_out(plan, text)
        prompt = Prompt(
            ids=ids,
            prefix_ids=prefix_ids,
            suffix_ids=suffix_ids,
            context_ids=block_ids,
            healing=healing,
            line_prefix=plan.line_prefix,
            line_suffix=plan.line_suffix,
            following=plan.following,
            prefix_start=plan.prefix_start,
            prefix_line=plan.prefix_line,
            suffix_end=plan.suffix_end,
            cursor_line_tokens=cursor_tokens,
        )
        opt = self.options
        prompt.stop = StopRules.for_prompt(
            prompt,
            self.template,
            opt.multiline,
            opt.max_lines,
            token_bytes=self.healer.bytes if self.healer is not None else None,
        )
        return prompt
