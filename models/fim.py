"""Fill-in-the-middle prompt templates, one per model family.

A template turns token ids of the prefix, the suffix and an optional context
block into the prompt ids the model was trained on, and names the token ids
that end a middle. It works on ids (not strings with special tokens in them)
so that text in the document that happens to spell a special token can never
be read as one, and so the prompt builder can tokenize the prefix in stable
pieces.

Layouts (S = suffix ids, P = prefix ids; `▁` is SentencePiece's space):

    completiond     SPM  <|fim_prefix|><|fim_suffix|>S<|fim_middle|>P       ends <|endoftext|>
                    PSM  <|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>
    qwen2.5-coder   PSM  <|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>       ends <|endoftext|>
    starcoder       SPM  <fim_prefix><fim_suffix>S<fim_middle>P             ends <|endoftext|>
                    PSM  <fim_prefix>P<fim_suffix>S<fim_middle>
    deepseek-coder  PSM  <｜fim▁begin｜>P<｜fim▁hole｜>S<｜fim▁end｜>        ends EOS
    codellama       SPM  <s>▁<PRE>▁<SUF>S▁<MID>P                            ends ▁<EOT>
                    PSM  <s>▁<PRE>P▁<SUF>S▁<MID>
    codestral       SPM  <s>[SUFFIX]S[PREFIX]P                              ends </s>
    none                 P (plain left-to-right continuation, no suffix)

CodeLlama and Codestral encode the prefix with SentencePiece's leading space
("<PRE> {pre}") and the suffix without it; `encode(..., first=True)` gives the
former. Families with a file separator token take the workspace context as
files in the repository-level format they were trained on (see
`context_ids`); the others have no such format, so the prompt builder puts
the context as plain text at the start of the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

TEMPLATE_NAMES = ("completiond", "qwen2.5-coder", "starcoder", "deepseek-coder", "codellama", "codestral", "none")

class FimError(ValueError):
    """The tokenizer lacks what the requested template needs."""


@dataclass(frozen=True)
class _Family:
    name: str
    prefix: str | None
    suffix: str | None
    middle: str | None
    spm: bool          # the model saw suffix-first prompts in training
    psm: bool
    ends: tuple[str, ...]          # tokens that end a middle, besides the tokenizer's EOS
    file_sep: str | None = None
    repo_name: str | None = None
    bos: bool = False
    prefix_leading_space: bool = False
    # "paths": <file_sep>path\ncontent per file (Qwen, StarCoder2 repository format);
    # "separators": content<file_sep> per file, as the bundled model's training stream joins files.
    context_style: str = "paths"


_FAMILIES: dict[str, _Family] = {
    "completiond": _Family("completiond", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", spm=True, psm=True,
                           ends=("<|endoftext|>", "<|file_sep|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
                                 "<|fim_pad|>"),
                           file_sep="<|file_sep|>", context_style="separators"),
    "qwen2.5-coder": _Family("qwen2.5-coder", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", spm=False, psm=True,
                             ends=("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|fim_prefix|>",
                                   "<|fim_suffix|>", "<|fim_middle|>", "<|im_end|>"),
                             file_sep="<|file_sep|>", repo_name="<|repo_name|>"),
    "starcoder": _Family("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", spm=True, psm=True,
                         ends=("<|endoftext|>", "<file_sep>", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>"),
                         file_sep="<file_sep>", repo_name="<repo_name>"),
    "deepseek-coder": _Family("deepseek-coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", spm=False, psm=True,
                              ends=("<｜end▁of▁sentence｜>", "<|EOT|>", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
                              bos=True),
    "codellama": _Family("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", spm=True, psm=True,
                         ends=("▁<EOT>", "</s>"), bos=True, prefix_leading_space=True),
    "codestral": _Family("codestral", "[PREFIX]", "[SUFFIX]", None, spm=True, psm=False,
                         ends=("</s>", "[PREFIX]", "[SUFFIX]", "[MIDDLE]"), bos=True, prefix_leading_space=True),
    "none": _Family("none", None, None, None, spm=False, psm=True, ends=()),
}


def _vocab(tokenizer: Any) -> dict[str, int]:
    vocab = dict(tokenizer.get_vocab())
    # Added tokens are in get_vocab for fast tokenizers, but be explicit: a
    # special token that only lives in added_tokens_decoder must still count.
    for idx, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        vocab.setdefault(str(tok), int(idx))
    return vocab


def detect(tokenizer: Any, default: str | None = None) -> str:
    """Name of the template that fits this tokenizer (one of TEMPLATE_NAMES).

    default: the family the model's own metadata names (the bundled model's
    completiond.json); it beats vocabulary sniffing, since the bundled
    vocabulary looks like Qwen's.
    """
    if default in _FAMILIES:
        return default
    vocab = _vocab(tokenizer)
    if "<|fim_prefix|>" in vocab and "<|fim_middle|>" in vocab:
        # The bundled vocabulary has <|fim_pad|> too; only Qwen has the
        # repository-level <|repo_name|> token (and chat tokens).
        if "<|repo_name|>" in vocab or "<|im_start|>" in vocab:
            return "qwen2.5-coder"
        return "completiond"
    if "<fim_prefix>" in vocab and "<fim_middle>" in vocab:
        return "starcoder"
    if "<｜fim▁begin｜>" in vocab:
        return "deepseek-coder"
    if "▁<PRE>" in vocab and "▁<MID>" in vocab:
        return "codellama"
    if "[SUFFIX]" in vocab and "[PREFIX]" in vocab:
        return "codestral"
    return "none"


# The parts of a FIM layout: the prefix and suffix (document text) and the family's three markers.
PREFIX, SUFFIX, PREFIX_TOKEN, SUFFIX_TOKEN, MIDDLE_TOKEN = "prefix", "suffix", "<prefix>", "<suffix>", "<middle>"


def fim_order(name: str, spm: bool) -> tuple[str, ...]:
    """The order of a family's FIM layout after its context block: the one place the layouts are written,
    for token ids (FimTemplate.build) and text (a team server's prompt) alike."""
    if name == "none":
        return (PREFIX,)
    if name == "codestral":
        return (SUFFIX_TOKEN, SUFFIX, PREFIX_TOKEN, PREFIX)
    if not spm or name in ("deepseek-coder", "qwen2.5-coder"):
        return (PREFIX_TOKEN, PREFIX, SUFFIX_TOKEN, SUFFIX, MIDDLE_TOKEN)
    return (PREFIX_TOKEN, SUFFIX_TOKEN, SUFFIX, MIDDLE_TOKEN, PREFIX)


@dataclass
class FimTemplate:
    """A family's FIM layout bound to one tokenizer. Build with `make_template`."""

    name: str
    tokenizer: Any
    spm: bool
    stop_ids: frozenset[int]
    prefix_id: int | None = None
    suffix_id: int | None = None
    middle_id: int | None = None
    bos_id: int | None = None
    file_sep_id: int | None = None
    repo_name_id: int | None = None
    prefix_leading_space: bool = False
    context_style: str = "paths"
    # Where tokenizing in pieces reproduces whole-string tokenization: cutting
    # just before a newline (GPT-2-style BPE merges "\n" with the next line's
    # indentation) or just after it (pre-tokenizers that glue newlines to
    # the preceding punctuation). See `newline_split`.
    split_before_newline: bool = False
    _dummy_prefix: bool = field(default=False, repr=False)
    _sentinel_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def supports_suffix(self) -> bool:
        return self.suffix_id is not None

    @property
    def supports_file_context(self) -> bool:
        return self.file_sep_id is not None

    # -- text -> ids -------------------------------------------------------
    def encode(self, text: str, first: bool = False) -> list[int]:
        """Token ids of plain text; special-token spellings stay plain text.

        SentencePiece tokenizers prepend a space to every encoded string. That
        space is wanted only where the family was trained with it (first=True
        on the first piece of a CodeLlama/Codestral prefix); everywhere else,
        and for every later piece of a prefix tokenized in parts, it is removed
        so the pieces concatenate to the text.
        """
        if not text:
            return []
        ids = self._raw_encode(text)
        if not self._dummy_prefix or (first and self.prefix_leading_space):
            return ids
        ids = self._raw_encode("\n" + text)
        n = len(self._sentinel_ids)
        if ids[:n] == self._sentinel_ids:
            return ids[n:]
        return self._raw_encode(text)

    def _raw_encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    # -- layout --------------------------------------------------------------
    def build(self, prefix_ids: Sequence[int], suffix_ids: Sequence[int] = (),
              context_ids: Sequence[int] = ()) -> list[int]:
        """Prompt ids: context block, then the family's FIM layout.

        The model's output is the middle; generation ends at one of stop_ids.
        """
        out: list[int] = []
        if self.bos_id is not None:
            out.append(self.bos_id)
        out.extend(context_ids)
        parts = {PREFIX: list(prefix_ids), SUFFIX: list(suffix_ids), PREFIX_TOKEN: [self.prefix_id],
                 SUFFIX_TOKEN: [self.suffix_id], MIDDLE_TOKEN: [self.middle_id]}
        for part in fim_order(self.name, self.spm):
            out.extend(parts[part])  # type: ignore[arg-type]  # a family's markers exist where its order names them
        return out

    def render(self, prefix: str, suffix: str = "", context_ids: Sequence[int] = ()) -> list[int]:
        """Convenience: build from strings (the prompt builder tokenizes in pieces instead)."""
        return self.build(self.encode(prefix, first=True), self.encode(suffix), context_ids)

    def context_ids(self, files: Iterable[tuple[str, str]], current_path: str | None = None,
                    repo_name: str | None = None) -> list[int]:
        """Repository-level context in the family's format, or [] if it has none.

        "paths" style: each file becomes `<file_sep>path\\ncontent\\n`, then the
        current file's `<file_sep>path\\n` header, so the FIM prompt reads as
        the next file of the repository. "separators" style (the bundled
        model, trained on files joined by the separator without paths):
        `content\\n<file_sep>` per file.
        """
        if self.file_sep_id is None:
            return []
        files = list(files)
        if not files:
            return []
        out: list[int] = []
        if self.context_style == "separators":
            for _path, text in files:
                if text and not text.endswith("\n"):
                    text += "\n"
                out += self.encode(text) + [self.file_sep_id]
            return out
        if self.repo_name_id is not None and repo_name:
            out += [self.repo_name_id] + self.encode(repo_name + "\n")
        for path, text in files:
            if text and not text.endswith("\n"):
                text += "\n"
            out += [self.file_sep_id] + self.encode(f"{path}\n{text}")
        if current_path:
            out += [self.file_sep_id] + self.encode(current_path + "\n")
        return out

    def is_stop(self, token_id: int) -> bool:
        return token_id in self.stop_ids


def make_template(tokenizer: Any, name: str | None = "auto", default: str | None = None,
                  order: str = "auto") -> FimTemplate:
    """The template for `tokenizer`.

    name: a TEMPLATE_NAMES entry (the fimTemplate setting) or "auto"/None to
    detect (`default`: the family the model's metadata names, else the vocabulary).
    order: "auto" picks SPM where the family supports it (typing at the
    cursor then only appends prompt tokens), "spm" or "psm" force one.
    Raises FimError if the tokenizer lacks the family's special tokens or
    the order is unsupported.
    """
    if not name or name == "auto":
        name = detect(tokenizer, default)
    fam = _FAMILIES.get(name)
    if fam is None:
        raise FimError(f"unknown FIM template {name!r}; expected one of {', '.join(TEMPLATE_NAMES)} or auto")
    if order not in ("auto", "spm", "psm"):
        raise FimError(f"FIM order must be auto, spm or psm, got {order!r}")
    if order == "spm" and not fam.spm:
        raise FimError(f"FIM template {name} has no suffix-first (SPM) layout")
    if order == "psm" and not fam.psm:
        raise FimError(f"FIM template {name} has no prefix-first (PSM) layout")
    spm = fam.spm if order == "auto" else order == "spm"

    vocab = _vocab(tokenizer)

    def need(tok: str | None) -> int | None:
        if tok is None:
            return None
        if tok not in vocab:
            raise FimError(f"FIM template {name} needs the special token {tok!r}, which this tokenizer lacks "
                           f"(set fimTemplate to auto or to the model's family)")
        return vocab[tok]

    prefix_id, suffix_id, middle_id = need(fam.prefix), need(fam.suffix), need(fam.middle)
    stops = {vocab[t] for t in fam.ends if t in vocab}
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        stops.add(int(eos))
    bos_id = None
    if fam.bos:
        bos_id = getattr(tokenizer, "bos_token_id", None)
    tpl = FimTemplate(
        name=name, tokenizer=tokenizer, spm=spm, stop_ids=frozenset(stops),
        prefix_id=prefix_id, suffix_id=suffix_id, middle_id=middle_id, bos_id=bos_id,
        file_sep_id=vocab.get(fam.file_sep) if fam.file_sep else None,
        repo_name_id=vocab.get(fam.repo_name) if fam.repo_name else None,
        prefix_leading_space=fam.prefix_leading_space, context_style=fam.context_style,
    )
    tpl._dummy_prefix = _adds_dummy_prefix(tpl)
    if tpl._dummy_prefix:
        tpl._sentinel_ids = tpl._raw_encode("\n")
    tpl.split_before_newline = newline_split(tpl) == "before"
    return tpl


_PROBE = "import os\n\n\nclass A(B):\n    def f(self, x):\n        if x:\n            return [x]\n\n    y = {1: 2}  \n\tz = 3\n"


def newline_split(tpl: FimTemplate) -> str:
    """'before' or 'after': which side of a newline piecewise tokenization should cut.

    Decided on a probe snippet: the side whose piecewise ids equal the
    whole-string ids on more lines wins ('before' on a tie).
    """
    whole = tpl.encode(_PROBE)
    lines = _PROBE.split("\n")
    scores = {}
    for side in ("before", "after"):
        if side == "before":
            pieces = [lines[0]] + ["\n" + ln for ln in lines[1:]]
        else:
            pieces = [ln + "\n" for ln in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
        ids: list[int] = []
        for piece in pieces:
            ids += tpl.encode(piece)
        same = 0
        for a, b in zip(ids, whole):
            if a != b:
                break
            same += 1
        scores[side] = (ids == whole, same)
    return "before" if scores["before"] >= scores["after"] else "after"


def _adds_dummy_prefix(tpl: FimTemplate) -> bool:
    """Whether encoding prepends SentencePiece's space ('a' -> '▁a')."""
    ids = tpl._raw_encode("a")
    if not ids:
        return False
    first = tpl.tokenizer.convert_ids_to_tokens(ids[0])
    return isinstance(first, str) and first.startswith("▁")



@dataclass(frozen=True)
class TextLayout:
    """A family's FIM layout as the text spellings of its special tokens, for servers that tokenize
    prompts themselves (a team backend): there is no tokenizer here to turn them into ids."""

    name: str
    prefix: str | None
    suffix: str | None
    middle: str | None
    spm: bool
    psm: bool
    ends: tuple[str, ...]
    file_sep: str | None
    repo_name: str | None
    context_style: str
    prefix_leading_space: bool


def text_layout(name: str) -> TextLayout:
    """The layout of template `name` (one of TEMPLATE_NAMES); FimError for an unknown name."""
    fam = _FAMILIES.get(name)
    if fam is None:
        raise FimError(f"unknown FIM template {name!r}; expected one of {', '.join(TEMPLATE_NAMES)}")
    return TextLayout(fam.name, fam.prefix, fam.suffix, fam.middle, fam.spm, fam.psm, fam.ends, fam.file_sep,
                      fam.repo_name, fam.context_style, fam.prefix_leading_space)
