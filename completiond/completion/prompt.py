"""Prompt builder: document text + cursor offset (+ context files) -> prompt ids.

Built for the prefix KV cache. With a suffix-first (SPM) template the prompt
is `context | FIM start | suffix | FIM middle | prefix chunks | cursor line`
(the bundled model's context sits at the start of the prefix instead:
`FIM start | suffix | FIM middle | context | prefix chunks | cursor line`),
so typing at the cursor changes only the last few ids and everything before
them is served from the cache. To keep that true:

* the prefix is tokenized in pieces that never change while the user types
  on a line: whole chunks of `chunk_lines` lines aligned to absolute line
  numbers (multiples of chunk_lines), the lines of the cursor's chunk above
  the cursor line, and the cursor line up to the cursor, each tokenized
  separately. Appending a character re-tokenizes only the cursor line.
* the prefix window starts on a chunk boundary and is chosen with slack for
  the cursor line (`reserve`), so it does not slide on every keystroke; when
  the budget runs out it jumps by a whole chunk.
* only a bounded character window around the cursor is ever tokenized, so
  a huge document costs no more than a small one.

Offsets are Python string indices (code points); converting editor
positions (UTF-16 in LSP) is the caller's job.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from completiond.completion.healing import Healing, TokenHealer
from completiond.completion.stops import StopRules
from completiond.completion.workspace import comment_for
from completiond.engine.model_info import ModelInfo
from completiond.models.fim import FimError, FimTemplate, make_template

# Upper bound on characters per token used to size the text windows before
# tokenizing: code averages 3-4, indentation runs a bit more. Too large only
# costs tokenizer time; too small would starve the budget.
CHARS_PER_TOKEN = 6


@dataclass(frozen=True)
class PromptOptions:
    prefix_tokens: int = 1024
    suffix_tokens: int = 256
    context_tokens: int = 256
    # Most of a capped prompt (max_prompt_tokens) the context block may take: what is left goes to
    # the suffix (a quarter) and the prefix. 0.4 measured best for retrieval with the bundled model
    # (512-token training context; eval --context on toolz, tenacity, structlog: 0.25, 0.3, 0.4, 0.55).
    context_share: float = 0.4
    chunk_lines: int = 16          # the prefix window starts on a multiple of this line number
    max_prompt_tokens: int | None = None   # model context minus generation room; None = no extra cap
    max_document_chars: int = 8 * 1024 * 1024
    max_line_chars: int = 2000     # longer lines mean minified/generated text: no suggestion there
    heal: bool = True
    multiline: str = "auto"        # the stop rules' multi-line policy (the multiline setting)
    max_lines: int = 8

    @classmethod
    def from_config(cls, cfg: Any, max_context: int | None = None, **overrides) -> "PromptOptions":
        """Options from a completiond Config (prefixTokens, suffixTokens, workspaceContext, contextTokens)."""
        max_prompt = None
        if max_context:
            max_prompt = max(16, max_context - int(getattr(cfg, "max_tokens", 64)))
        kw = dict(
            prefix_tokens=int(cfg.prefix_tokens),
            suffix_tokens=int(cfg.suffix_tokens),
            context_tokens=int(cfg.context_tokens) if getattr(cfg, "workspace_context", True) else 0,
            max_prompt_tokens=max_prompt,
            heal=bool(getattr(cfg, "token_healing", True)),
            multiline=str(getattr(cfg, "multiline", "auto")),
            max_lines=int(getattr(cfg, "max_lines", 8)),
        )
        kw.update(overrides)
        return cls(**kw)


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
    context_ids: list[int] = field(default_factory=list)   # the context block, wherever the layout puts it
    healing: Healing | None = None
    line_prefix: str = ""      # cursor line up to the cursor
    line_suffix: str = ""      # cursor line after the cursor
    following: str = ""        # text after the cursor line (bounded), for the stop rules' duplicate checks
    prefix_start: int = 0      # document offset where the prefix window starts (may be the newline before its first line)
    prefix_line: int = 0       # absolute number of the first line in the prefix window
    suffix_end: int = 0        # document offset where the suffix window ends
    cursor_line_tokens: int = 0
    stop: StopRules | None = None   # when generation ends, and what of it the editor shows

    @property
    def skipped(self) -> bool:
        return self.skip_reason is not None

    @property
    def constraint(self):
        return self.healing.constraint if self.healing is not None else None

    def suggestion(self, tokens: Sequence[int], finish_reason: str | None = None) -> str:
        """Text to show after the cursor ('' = show nothing); pass the Generation's finish_reason."""
        return self.stop.suggestion(tokens, finish_reason) if self.stop is not None else ""


def skip_reason(text: str, cursor: int, options: PromptOptions) -> str | None:
    """Why no completion should be attempted here, or None."""
    if not 0 <= cursor <= len(text):
        return f"cursor offset {cursor} outside the document (length {len(text)})"
    if len(text) > options.max_document_chars:
        return f"document too large ({len(text)} characters > {options.max_document_chars})"
    lo = max(0, cursor - options.prefix_tokens * CHARS_PER_TOKEN)
    hi = min(len(text), cursor + options.suffix_tokens * CHARS_PER_TOKEN)
    if "\x00" in text[lo:hi]:
        return "binary content near the cursor (NUL characters)"
    ls = text.rfind("\n", 0, cursor) + 1
    le = text.find("\n", cursor)
    le = len(text) if le < 0 else le
    if le - ls > options.max_line_chars:
        return f"cursor line is {le - ls} characters long (minified or generated code?)"
    return None


class PromptBuilder:
    """Builds prompts for one model's FIM template; keeps a small cache of tokenized pieces.

        builder = PromptBuilder.for_engine(engine, cfg)
        prompt = builder.build(text, offset, context=ws.context(...), path=rel_path, language="python")

    One builder per loaded model and prompt settings (`for_engine` is cheap after the first
    time: the token tables are cached per tokenizer). Not thread-safe: use it from the
    daemon's worker thread (like the engine).
    """

    def __init__(self, template: FimTemplate, options: PromptOptions | None = None,
                 healer: TokenHealer | None = None, piece_cache_entries: int = 4096):
        self.template = template
        self.options = options or PromptOptions()
        self.healer = healer
        self._pieces: OrderedDict[tuple[bool, str], tuple[int, ...]] = OrderedDict()
        self._max_pieces = piece_cache_entries
        self.tokenized_chars = 0   # characters actually sent to the tokenizer (tests check the bound)
        self._contexts: OrderedDict[tuple, tuple[int, ...]] = OrderedDict()
        self._shift = 1 if getattr(template, "split_before_newline", False) else 0
        self.warnings: list[str] = []   # settings problems worked around (shown to the user)

    @classmethod
    def for_model(cls, tokenizer: Any, cfg: Any = None, *, max_context: int | None = None,
                  vocab_size: int | None = None, device: Any = "cpu", info: ModelInfo | None = None,
                  options: PromptOptions | None = None) -> "PromptBuilder":
        """Template, healer and options for one model and these settings (a Config)."""
        from completiond.config import Config

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
    def for_engine(cls, engine: Any, cfg: Any = None, **kw) -> "PromptBuilder":
        # The healing mask must match the model's logits, which can be wider than the tokenizer.
        vocab = getattr(engine, "vocab_size", None)
        return cls.for_model(engine.tokenizer, cfg, max_context=engine.max_context, vocab_size=vocab,
                             device=getattr(engine, "device", "cpu"), info=getattr(engine, "info", None), **kw)

    @property
    def context_tokens(self) -> int:
        """Token budget the context block really gets (ask the workspace for this much)."""
        return self.budgets(True)[2]

    # -- pieces ----------------------------------------------------------
    def _encode(self, text: str, first: bool = False) -> list[int]:
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

    # -- public ----------------------------------------------------------
    def build(self, text: str, cursor: int, context: Sequence[tuple[str, str]] = (), path: str | None = None,
              language: str | None = None, heal: bool | None = None) -> Prompt:
        """Prompt ids for a completion at `cursor` in `text`.

        context: (path, text) snippets, already chosen and ordered by the
        workspace (stable order keeps their KV cached). Families with a file
        separator get them in their repository format, in front of the FIM
        layout; the bundled model ("separators" style) gets the code as plain
        text at the start of the prefix, which is what its FIM training showed
        it; families without a separator get it there too, each file under a
        path line in `language`'s comment syntax, or not at all if it has none.
        heal: override PromptOptions.heal for this request.
        """
        opt = self.options
        reason = skip_reason(text, cursor, opt)
        if reason is not None:
            return Prompt(ids=[], skip_reason=reason)
        tpl = self.template
        ls = text.rfind("\n", 0, cursor) + 1
        le = text.find("\n", cursor)
        le = len(text) if le < 0 else le
        line_prefix, line_suffix = text[ls:cursor], text[cursor:le]

        prefix_budget, suffix_budget, context_budget = self.budgets(bool(context))

        # Context first: its token count is known before the prefix is cut.
        context_ids: list[int] = []
        context_text = ""
        if context and context_budget > 0:
            if tpl.supports_file_context and tpl.context_style == "separators":
                # The bundled model's FIM samples never had anything before <|fim_prefix|>: there it
                # barely reads a block (an oracle block holding the true next line lifted exact match
                # half as much as the same text at the start of the prefix; see docs/PERFORMANCE.md).
                # So its block is plain code at the start of the prefix, where FIM training put the
                # code above the cursor.
                context_text = self._text_context(list(context), None, context_budget)
            elif tpl.supports_file_context:
                context_ids = self._file_context(list(context), path, context_budget)
            elif (comment := comment_for(language)):
                context_text = self._text_context(list(context), comment, context_budget)

        # The cursor line's piece starts at the newline before it when the
        # tokenizer merges a newline with the next line's indentation.
        shift = self._shift
        cstart = ls - shift if ls > 0 else 0
        cursor_text = text[cstart:cursor]
        use_heal = opt.heal if heal is None else heal
        cursor_ids, healing = self._cursor_piece(cursor_text, first=False, heal=use_heal)
        if len(cursor_ids) > prefix_budget:
            cursor_ids = cursor_ids[-prefix_budget:]
        pieces = self._head(text, ls, prefix_budget, len(cursor_ids))
        prefix_start = pieces[0][0] if pieces else cstart
        prefix_line = text.count("\n", 0, prefix_start) + (1 if shift and prefix_start > 0 else 0)
        if tpl.prefix_leading_space and not context_text:
            # Only the first piece of the prefix carries the family's leading space.
            if pieces:
                b0, e0, _ = pieces[0]
                pieces[0] = (b0, e0, self._encode(text[b0:e0], first=True))
            elif cursor_text:
                cursor_ids, healing = self._cursor_piece(cursor_text, first=True, heal=use_heal)
        head_ids = [i for _, _, ids in pieces for i in ids]
        block_ids = context_ids
        if context_text:
            block_ids = self._encode(context_text, first=True)
            head_ids = block_ids + head_ids
        prefix_ids = head_ids + cursor_ids

        suffix_ids, suffix_end = self._suffix(text, cursor, le, suffix_budget)
        following_end = min(len(text), le + 1 + 4000)
        following = text[le + 1:following_end] if le < len(text) else ""

        ids = tpl.build(prefix_ids, suffix_ids, context_ids)
        prompt = Prompt(ids=ids, prefix_ids=prefix_ids, suffix_ids=suffix_ids, context_ids=list(block_ids),
                        healing=healing, line_prefix=line_prefix, line_suffix=line_suffix, following=following,
                        prefix_start=prefix_start, prefix_line=prefix_line, suffix_end=suffix_end,
                        cursor_line_tokens=len(cursor_ids))
        prompt.stop = StopRules.for_prompt(prompt, tpl, opt.multiline, opt.max_lines,
                                           token_bytes=self.healer.bytes if self.healer is not None else None)
        return prompt

    def budgets(self, with_context: bool = True) -> tuple[int, int, int]:
        """(prefix, suffix, context) token budgets after fitting them into max_prompt_tokens.

        Pass the context budget to Workspace.context so the block it returns fits.
        """
        opt = self.options
        prefix_budget, suffix_budget = opt.prefix_tokens, opt.suffix_tokens
        context_budget = opt.context_tokens if with_context else 0
        if not self.template.supports_suffix:
            suffix_budget = 0
        if opt.max_prompt_tokens is not None:
            room = opt.max_prompt_tokens - 8  # FIM special tokens and BOS
            context_budget = min(context_budget, max(0, int(room * opt.context_share)))
            suffix_budget = min(suffix_budget, max(0, (room - context_budget) // 4))
            prefix_budget = min(prefix_budget, max(1, room - context_budget - suffix_budget))
        return prefix_budget, suffix_budget, context_budget

    def _cursor_piece(self, piece: str, first: bool, heal: bool) -> tuple[list[int], Healing | None]:
        ids = self._encode(piece, first=first) if piece else []
        if heal and self.healer is not None and ids:
            return self.healer.heal(ids)
        return ids, None

    # -- prefix ----------------------------------------------------------
    def _piece(self, text: str, b: int, e: int) -> list[int]:
        """Ids of the lines starting at line starts b..e, cut on the tokenizer's side of the newline."""
        sh = self._shift
        return self._encode(text[max(0, b - sh):e - sh])

    def _head(self, text: str, ls: int, budget: int, cursor_tokens: int) -> list[tuple[int, int, list[int]]]:
        """Pieces (begin, end, ids) of whole lines before the cursor line, oldest first.

        begin/end are document offsets of the piece text. Walks back chunk by
        chunk (chunks aligned to absolute line numbers) while they fit in the
        budget minus a reserve for the cursor line. The reserve does not
        depend on the cursor line until that line outgrows it, so typing
        does not move the window start.
        """
        if ls == 0:
            return []
        opt = self.options
        sh = self._shift
        n = max(1, opt.chunk_lines)
        reserve = max(budget // 8, cursor_tokens)
        head_budget = max(0, budget - reserve)
        char_floor = max(0, ls - budget * CHARS_PER_TOKEN)
        cur_line = text.count("\n", 0, ls)          # absolute line number of the cursor line
        first_line = (cur_line // n) * n
        if first_line == cur_line:
            first_line -= n
        pieces: list[tuple[int, int, list[int]]] = []
        used = 0
        end = ls          # line start where the next (older) piece ends
        while end > 0:
            begin = _line_start(text, end, cur_line - first_line)
            if begin < char_floor or any(len(seg) > opt.max_line_chars for seg in text[begin:end].split("\n")):
                break
            ids = self._piece(text, begin, end)
            if used + len(ids) > head_budget:
                if not pieces:
                    tail = self._tail_lines(text, begin, end, head_budget)
                    if tail is not None:
                        pieces.append(tail)
                break
            pieces.append((max(0, begin - sh), end - sh, ids))
            used += len(ids)
            end = begin
            cur_line, first_line = first_line, first_line - n
        pieces.reverse()
        return pieces

    def _tail_lines(self, text: str, begin: int, end: int, budget: int) -> tuple[int, int, list[int]] | None:
        """Trailing whole lines of the lines begin..end that fit in budget (not chunk-aligned)."""
        sh = self._shift
        starts = [begin] + [i + 1 for i in range(begin, end - 1) if text[i] == "\n"]
        total = 0
        best = None
        for k in range(len(starts) - 1, -1, -1):
            b = starts[k]
            e = starts[k + 1] if k + 1 < len(starts) else end
            total += len(self._piece(text, b, e))
            if total > budget:
                break
            best = b
        if best is None:
            return None
        return max(0, best - sh), end - sh, self._piece(text, best, end)

    # -- suffix ----------------------------------------------------------
    def _suffix(self, text: str, cursor: int, le: int, budget: int) -> tuple[list[int], int]:
        """Ids of the text after the cursor, cut at a line end within budget."""
        if budget <= 0 or cursor >= len(text):
            return [], cursor
        sh = self._shift
        hi = min(len(text), cursor + budget * CHARS_PER_TOKEN)
        # Cut points: every line end in the window, on the tokenizer's side of the newline.
        cuts: list[int] = []
        p = le
        while 0 <= p < hi:
            cuts.append(p + 1 - sh)
            p = text.find("\n", p + 1, hi)
        if hi == len(text) and (not cuts or cuts[-1] < len(text)):
            cuts.append(len(text))
        cuts = [c for c in cuts if c > cursor]
        if not cuts:
            # The cursor line is longer than the window: keep what fits of it.
            ids = self._encode(text[cursor:hi])[:budget]
            return ids, cursor + len(self.template.tokenizer.decode(ids)) if ids else cursor
        # The rest of the cursor line is its own piece: it is all that changes
        # when the user edits to the right of the cursor.
        ids = self._encode(text[cursor:cuts[0]])
        if len(ids) > budget:
            return ids[:budget], cuts[0]
        end = cuts[0]
        n = max(1, self.options.chunk_lines)
        i = 0
        while i + 1 < len(cuts):
            j = min(i + n, len(cuts) - 1)
            pids = self._encode(text[cuts[i]:cuts[j]])
            if len(ids) + len(pids) > budget:
                # Take the leading lines of this chunk that still fit.
                for k in range(i, j):
                    lids = self._encode(text[cuts[k]:cuts[k + 1]])
                    if len(ids) + len(lids) > budget:
                        break
                    ids += lids
                    end = cuts[k + 1]
                break
            ids += pids
            end = cuts[j]
            i = j
        return ids, end

    # -- context ---------------------------------------------------------
    def _file_context(self, files: list[tuple[str, str]], path: str | None, budget: int) -> list[int]:
        # The same block comes back on every keystroke: remember the last few.
        key = (tuple(files), path, budget)
        hit = self._contexts.get(key)
        if hit is not None:
            return list(hit)
        tpl = self.template
        ids: list[int] = []
        while files:
            ids = tpl.context_ids(files, current_path=path)
            if len(ids) <= budget:
                break
            files = _shorten_last(files)
            ids = []
        self._contexts[key] = tuple(ids)
        if len(self._contexts) > 8:
            self._contexts.popitem(last=False)
        return ids

    def _text_context(self, files: list[tuple[str, str]], comment: str | None, budget: int) -> str:
        """The files as plain text, each under a path line in `comment` syntax (none without one),
        fitted into the budget as `_file_context` does: the last file shortened by lines, dropped
        when nothing of it fits."""
        while files:
            block = "".join((f"{comment} {p}\n" if comment else "") + (t if t.endswith("\n") else t + "\n")
                            for p, t in files)
            if len(self._encode(block, first=True)) <= budget:   # cached: the same block comes back every keystroke
                return block
            files = _shorten_last(files)
        return ""


def _shorten_last(files: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The context files with the last one cut to two thirds of its lines, or dropped when it has one line."""
    last_path, last_text = files[-1]
    lines = last_text.splitlines(keepends=True)
    if len(lines) > 1:
        return files[:-1] + [(last_path, "".join(lines[: max(1, len(lines) * 2 // 3)]))]
    return files[:-1]


def _line_start(text: str, end: int, lines: int) -> int:
    """Offset of the line `lines` lines above the line starting at `end` (end is a line start)."""
    pos = end
    for _ in range(max(1, lines)):
        if pos <= 0:
            return 0
        nl = text.rfind("\n", 0, pos - 1)
        pos = nl + 1
        if nl < 0:
            return 0
    return pos
