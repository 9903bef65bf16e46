"""Stop rules that run inside the generation loop, and suggestion post-processing.

The engine calls `stop(tokens)` after every verified round; a `StopRules`
instance decodes the tokens (exactly, through the per-token byte table),
finds where the suggestion must end, and answers how many tokens to keep, so
no rounds are spent past a stop.

Token/character contract: a cut can fall inside a token (`"):\\n    "` holds
the end of one line and the start of the next). `__call__` then keeps that
token too (n = tokens overlapping the kept text), so the engine's
token list is a prefix-consistent continuation; `suggestion(tokens)`
applies the exact character cut and the post-processing. Callers must show
`suggestion(gen.tokens)`, never a plain decode.

Rules (in text after the healed characters, see healing.py):
* stop tokens of the template (EOS, FIM end, file separators);
* single-line (mid-line, or multiline=never, or auto on a line that is not
  a block opener and not empty): end at the first newline;
* multi-line (multiline=always, or auto after a block opener `:` `{` `(`
  `[` `=>` or on an empty line): end before a line that dedents out of the
  cursor's block, before top-level code that follows a blank line, after the
  line that closes the bracket opened on the cursor line, at maxLines, and
  before a line that repeats the next non-blank line of the document;
* always: end before a closing bracket that has no opener (in the cursor
  line's prefix or the suggestion), closes the wrong kind of bracket, or
  closes one that the text right of the cursor already closes (`foo(|)`);
  end after the first unit of an in-line repetition loop (`path.path.path`,
  or three copies of a longer unit such as ` with {self.type!r}`);
  end where the suggestion starts re-typing the text right of the cursor;
* multi-line also: end before the first line that starts a cycle (a block of
  lines written again right after itself, or a line's third copy).
Every in-loop rule looks only at evidence already in the stream, so a cut
found early is the cut of any longer stream (stopping early changes nothing).
Post-processing: never insert whitespace the buffer already ends with
(indentation always; inside a line unless healing regenerated it), strip
trailing whitespace, drop an unfinished last line (token limit) and a block
opener left without its body from multi-line suggestions, trim the end of the
suggestion that repeats the text right of the cursor (brackets and quotes by
balance, other text when the overlap is telling), show nothing for an operand
put in front of the one right of the cursor (`str(name)` before `"-".join`),
and turn whitespace-only suggestions into "" (show nothing).
Documents of a language with a tree-sitter grammar (`StopRules.attach_document`,
remote.py's `document_site`): the bracket rules also count the brackets earlier
lines of the statement left open (a continuation line may close them) and the
closers later lines owe them, and the final text passes syntax.check (the longest
part that adds no syntax error to the region around the cursor; the syntaxCheck
setting).

Where they live: stops_text.py (the in-loop rules on text, TextRules), stops_post.py (post-processing),
and here StopRules, which puts tokens around them (its public names are re-exported here).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from completiond.completion.healing import TokenBytes
from completiond.completion.languages import spec_of
from completiond.completion.stops_post import (  # noqa: F401  (re-exported: the rules' public names)
    collides_with_suffix,
    postprocess,
    trim_suffix_overlap,
)
from completiond.completion.stops_text import (  # noqa: F401  (re-exported)
    BLOCK_OPENER_ENDINGS,
    CLOSERS,
    MULTILINE_MODES,
    OPENERS,
    Cut,
    TextRules,
    bracket_scan,
    find_line_cycle,
    find_loop,
    indent_width,
    open_stack,
    outside_strings,
    wants_multiline,
)
from completiond.completion.syntax import Site, Verdict, site_at


def document_site(
    text: str, offset: int, language: str | None = None, path: str | None = None, tree=None
) -> Site | None:
    """Where the cursor sits in the document (syntax.site_at); None for a language without a grammar here
    (the cursor line is then all the rules know). tree: the document's own tree (documents.Document)."""
    return site_at(text, offset, spec_of(language, path), tree)


class StopRules:
    """Engine stop callback for one request, plus the final suggestion.

    healed: text token healing removed from the prompt; the model first
    regenerates it and the rules only look at what follows.
    """

    def __init__(
        self,
        token_bytes: TokenBytes,
        line_prefix: str,
        line_suffix: str = "",
        following: str = "",
        multiline: str = "auto",
        max_lines: int = 8,
        stop_ids: Iterable[int] = (),
        healed: str = "",
    ):
        self.table = token_bytes
        self.rules = TextRules(line_prefix, line_suffix, following, multiline, max_lines)
        self.stop_ids = frozenset(stop_ids)
        self.healed = healed
        self.healed_bytes = healed.encode("utf-8")
        self.rules.whitespace_healed = healed.endswith((" ", "\t"))
        self.reason: str | None = None
        self._ends: list[int] = []  # cumulative byte end of each processed token
        self._data = bytearray()

    @classmethod
    def for_prompt(
        cls, prompt, template, multiline: str = "auto", max_lines: int = 8, token_bytes: TokenBytes | None = None
    ) -> "StopRules":
        """Rules for a completiond.completion.prompt.Prompt and its models.fim template."""
        table = token_bytes or TokenBytes.for_tokenizer(template.tokenizer)
        healed = prompt.healing.removed if prompt.healing is not None else ""
        return cls(
            table,
            prompt.line_prefix,
            prompt.line_suffix,
            prompt.following,
            multiline,
            max_lines,
            template.stop_ids,
            healed,
        )

    @property
    def multiline(self) -> bool:
        return self.rules.multiline

    @property
    def syntax(self) -> Verdict | None:
        """The syntax check's verdict on the last suggestion (None: no grammar, or not checked)."""
        return self.rules.syntax

    def attach_document(
        self,
        text: str,
        offset: int,
        language: str | None = None,
        path: str | None = None,
        check_syntax: bool = True,
        tree=None,
        site: Site | None = None,
    ) -> Site | None:
        """Let the rules see the document around the cursor; call it before generation starts.

        Every language with a grammar (others keep the cursor-line rules): brackets that earlier lines of
        the statement left open, closers the lines below owe them, and the syntax check of the
        final suggestion (check_syntax: the syntaxCheck setting). tree: the document's own, when kept.
        site: one an earlier call returned for the same text and offset (the alternatives of one request
        share it: its region is parsed once). Returns the site used (None: no grammar).
        """
        if site is None:
            site = document_site(text, offset, language, path, tree)
        old = self.rules
        if site is None or text[text.rfind("\n", 0, offset) + 1 : offset] != old.line_prefix:
            return site
        self.rules = TextRules(
            old.line_prefix, old.line_suffix, old.following, old.multiline_mode, old.max_lines, site, check_syntax
        )
        self.rules.whitespace_healed = old.whitespace_healed
        return site

    def _sync(self, tokens: Sequence[int]) -> None:
        if len(tokens) < len(self._ends):
            self._ends.clear()
            self._data.clear()
        for t in tokens[len(self._ends) :]:
            self._data += self.table[t] or b""
            self._ends.append(len(self._data))

    def _stop_index(self, tokens: Sequence[int]) -> int | None:
        for i, t in enumerate(tokens):
            if t in self.stop_ids:
                return i
        return None

    def _text(self, n_tokens: int) -> tuple[str, int] | None:
        """Suggestion text of the first n tokens and its byte offset in the stream, or None while healing."""
        end = self._ends[n_tokens - 1] if n_tokens else 0
        data = bytes(self._data[:end])
        h = len(self.healed_bytes)
        if len(data) < h or not data.startswith(self.healed_bytes):
            return None
        return data[h:].decode("utf-8", errors="surrogateescape"), h

    def _tokens_for(self, char_pos: int, s: str, base: int) -> int:
        """Tokens to keep so that the first char_pos characters of s are covered."""
        cut_byte = base + len(s[:char_pos].encode("utf-8", errors="surrogateescape"))
        if cut_byte <= 0:
            return 0
        n = 0
        for i, _end in enumerate(self._ends):
            start = self._ends[i - 1] if i else 0
            if start >= cut_byte:
                break
            n = i + 1
        return n

    def __call__(self, tokens: Sequence[int]) -> int | None:
        """None to go on, or how many tokens to keep (see the module doc)."""
        self._sync(tokens)
        limit = len(tokens)
        stop_at = self._stop_index(tokens)
        if stop_at is not None:
            limit = stop_at
            self.reason = "stop token"
        got = self._text(limit)
        if got is None:
            return stop_at
        s, base = got
        cut = self.rules.find_cut(s, final=stop_at is not None)
        if cut is None:
            return stop_at
        self.reason = cut.reason
        return min(limit, self._tokens_for(cut.pos, s, base))

    def suggestion(self, tokens: Sequence[int], finish_reason: str | None = None) -> str:
        """The text to show after the cursor for the generated tokens ('' = nothing).

        finish_reason: the engine's; "length" drops an unfinished last line of a multi-line suggestion.
        """
        self._sync(tokens)
        limit = len(tokens)
        stop_at = self._stop_index(tokens)
        if stop_at is not None:
            limit = stop_at
        got = self._text(limit)
        if got is None:
            return ""
        s, _ = got
        s = s.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="ignore")
        truncated = finish_reason == "length" and stop_at is None
        return postprocess(s, self.rules, truncated)
