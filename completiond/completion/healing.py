"""Token healing at the cursor, and the per-tokenizer token byte table it needs.

When the cursor sits inside what would be one token (`self.ap|`), the prompt
ends with a token the model rarely saw there (`ap`), and it continues badly
(`self.ap ply()` or garbage). Healing backs the last prefix token off the
prompt and constrains the first generated tokens so the output starts with
the removed text (`ap` -> `append`). The constraint is a hard mask over the
vocabulary; the engine applies the same mask to draft and verifier, so
speculative decoding stays exact for the constrained distribution.

Flow for the caller (token ids and strings only):

    healer = TokenHealer.for_tokenizer(tokenizer, vocab_size=model_vocab)
    prefix_ids, healing = healer.heal(prefix_ids)            # healing may be None
    gen = engine.generate(..., constraint=healing.constraint if healing else None)
    text = healing.output_text(gen.tokens) if healing else table.text(gen.tokens)

`output_text` removes the healed text from the front, so the suggestion is
what goes after the cursor.
"""

from __future__ import annotations

import bisect
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch


def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level mapping: printable char -> byte value.

    Byte-level BPE vocabularies spell each byte as one printable character:
    bytes that are already printable Latin-1 keep their character, the rest
    are shifted to code points from 256 up, in byte order.
    """
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    kept = set(keep)
    mapping = {chr(b): b for b in keep}
    shift = 0
    for b in range(256):
        if b not in kept:
            mapping[chr(256 + shift)] = b
            shift += 1
    return mapping


_BYTE_LEVEL = _byte_level_alphabet()


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """Types of the fast tokenizer's decoder (and its sub-decoders)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        spec = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return set()
    kinds: set[str] = set()
    stack = [spec]
    while stack:
        d = stack.pop()
        if isinstance(d, dict):
            if "type" in d:
                kinds.add(str(d["type"]))
            stack.extend(d.get("decoders") or [])
    return kinds


class TokenBytes:
    """The bytes every token id stands for; None for special tokens.

    Built once per tokenizer (a 150k vocabulary takes well under a second)
    and shared by healing and the stop rules, which need exact byte offsets
    per token to map a cut in the text back to a token count.
    """

    _cache: dict[int, tuple[Any, "TokenBytes"]] = {}
    _lock = threading.Lock()

    def __init__(self, tokenizer: Any, vocab_size: int | None = None):
        n = len(tokenizer)
        self.vocab_size = max(n, vocab_size or 0)
        pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        for idx, tok in added.items():
            if getattr(tok, "special", False):
                special.add(int(idx))
        kinds = _decoder_kinds(tokenizer)
        byte_level = "ByteLevel" in kinds
        metaspace = (
            "Metaspace" in kinds
            or "ByteFallback" in kinds
            or (not byte_level and any(isinstance(p, str) and p.startswith("▁") for p in pieces[: min(n, 4096)]))
        )
        table: list[bytes | None] = [None] * self.vocab_size
        for i, piece in enumerate(pieces):
            if i in special or piece is None:
                continue
            if int(i) in added:
                table[i] = str(added[i]).encode("utf-8")
            elif byte_level:
                table[i] = self._from_byte_level(piece, tokenizer, i)
            elif metaspace:
                table[i] = self._from_sentencepiece(piece)
            else:
                table[i] = tokenizer.decode([i]).encode("utf-8")
        self.table = table

    @staticmethod
    def _from_byte_level(piece: str, tokenizer: Any, i: int) -> bytes:
        try:
            return bytes(_BYTE_LEVEL[c] for c in piece)
        except KeyError:
            # A piece outside the byte alphabet (rare hand-added entries): trust the decoder.
            return tokenizer.decode([i]).encode("utf-8")

    @staticmethod
    def _from_sentencepiece(piece: str) -> bytes:
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("▁", " ").encode("utf-8")

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int | None = None) -> "TokenBytes":
        key = id(tokenizer)
        with cls._lock:
            hit = cls._cache.get(key)
            if hit is not None and hit[0] is tokenizer and hit[1].vocab_size >= (vocab_size or 0):
                return hit[1]
        table = cls(tokenizer, vocab_size)
        with cls._lock:
            # Holding the tokenizer in the value keeps id() from being reused.
            cls._cache[key] = (tokenizer, table)
        return table

    def __getitem__(self, token_id: int) -> bytes | None:
        if 0 <= token_id < len(self.table):
            return self.table[token_id]
        return None

    def join(self, ids: Iterable[int]) -> bytes:
        return b"".join(self[i] or b"" for i in ids)

    def text(self, ids: Iterable[int]) -> str:
        return self.join(ids).decode("utf-8", errors="replace")


@dataclass
class Healing:
    """One healed prompt: what was removed and how to constrain/undo it."""

    removed: str
    removed_bytes: bytes
    n_tokens: int
    healer: "TokenHealer" = field(repr=False)

    def constraint(self, tokens: Sequence[int]) -> torch.Tensor | None:
        """Engine callback: mask of allowed ids at the next position, or None once healed."""
        table = self.healer.bytes
        target = self.removed_bytes
        got = b""
        for t in tokens:
            got += table[t] or b""
            if len(got) >= len(target):
                return None
        if not target.startswith(got):
            # Cannot happen under the mask; if a caller fed tokens from
            # elsewhere, leave generation free rather than mask everything out.
            return None
        return self.healer.mask(target[len(got) :])

    def output_text(self, tokens: Sequence[int]) -> str:
        """Generated text with the healed part removed ('' if it never got produced)."""
        data = self.healer.bytes.join(tokens)
        if data.startswith(self.removed_bytes):
            return data[len(self.removed_bytes) :].decode("utf-8", errors="replace")
        if self.removed_bytes.startswith(data):
            return ""  # stopped before the healed text was complete
        return ""

    def strip(self, text: str) -> str:
        """Same as output_text, for callers that already decoded the text."""
        return text[len(self.removed) :] if text.startswith(self.removed) else ""


class TokenHealer:
    """Backs partial tokens off a prompt and builds the matching masks.

    max_tokens: how many trailing tokens may be backed off; max_chars bounds
    the removed text, since every removed character is one the model must
    re-derive under a constraint.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        max_tokens: int = 1,
        max_chars: int = 24,
        device: str | torch.device = "cpu",
    ):
        self.tokenizer = tokenizer
        self.bytes = TokenBytes.for_tokenizer(tokenizer, vocab_size)
        self.vocab_size = vocab_size or self.bytes.vocab_size
        self.max_tokens = max_tokens
        self.max_chars = max_chars
        self.device = torch.device(device)
        entries = sorted((b, i) for i, b in enumerate(self.bytes.table) if b)
        self._keys = [b for b, _ in entries]
        self._ids = [i for _, i in entries]
        self._by_bytes: dict[bytes, list[int]] = {}
        for b, i in entries:
            self._by_bytes.setdefault(b, []).append(i)
        self._masks: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()

    _instances: dict[tuple, "TokenHealer"] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int | None = None, **kwargs) -> "TokenHealer":
        """Shared healer per (tokenizer, vocab size, options): its masks are cached across requests."""
        key = (id(tokenizer), vocab_size, tuple(sorted((k, str(v)) for k, v in kwargs.items())))
        inst = cls._instances.get(key)
        if inst is None or inst.tokenizer is not tokenizer:
            inst = cls(tokenizer, vocab_size, **kwargs)
            cls._instances[key] = inst
        return inst

    def heal(self, prefix_ids: Sequence[int]) -> tuple[list[int], Healing | None]:
        """(prefix ids without the partial token(s), Healing) or (ids, None) when nothing to heal.

        A token with a newline is not backed off as a partial word: the cursor
        then sits at a line start, where there is no partial word to heal.
        Trailing spaces or tabs are the exception (see _heal_whitespace).
        """
        ids = list(prefix_ids)
        ws = self._heal_whitespace(ids)
        if ws is not None:
            return ws
        removed = b""
        n = 0
        while n < self.max_tokens and len(ids) > n:
            b = self.bytes[ids[-1 - n]]
            if not b or b"\n" in b or len(b) + len(removed) > self.max_chars * 4:
                break
            candidate = b + removed
            try:
                text = candidate.decode("utf-8")
            except UnicodeDecodeError:
                # Backing off half of a multi-byte character would leave the
                # prompt ending mid-character; try one more token or stop.
                removed, n = candidate, n + 1
                continue
            if len(text) > self.max_chars:
                break
            removed, n = candidate, n + 1
        while n and not _valid_utf8(removed):
            removed = removed[len(self.bytes[ids[-n]] or b"") :]
            n -= 1
        if n == 0 or not removed:
            return ids, None
        return ids[:-n], Healing(removed.decode("utf-8"), removed, n, self)

    def _heal_whitespace(self, ids: list[int]) -> tuple[list[int], Healing] | None:
        """Back a prompt ending in spaces or tabs up to the token boundary before that whitespace.

        Byte-level BPE glues a space to the word after it (` t`), and merges
        a newline with the indentation after it (newline + 12 spaces is one
        token). A prompt cut after indentation or after `x = ` therefore
        ends with a whitespace token the model rarely saw followed by a word,
        and its likeliest next token brings a space of its own: accepting it
        leaves 13 spaces where 12 were. Removing every trailing token that
        holds part of the whitespace run (the newline before indentation
        included) and constraining the output to reproduce the removed text
        lets the model choose the tokenization it was trained on. The stop
        rules read the text after the healed part, and the line prefix from
        the document, so backing off the newline does not move the line start.
        """
        if not ids:
            return None
        last = self.bytes[ids[-1]]
        if not last or not last.endswith((b" ", b"\t")):
            return None
        removed = b""
        n = 0
        while n < len(ids) and n < WHITESPACE_MAX_TOKENS:
            b = self.bytes[ids[-1 - n]]
            if not b or b.endswith(b"\n"):
                break  # a special token, or a line end: the boundary right after it is before the run
            if n and b[-1:] not in (b" ", b"\t"):
                break  # it ends where the run starts (` =` before ` `): the boundary is after it
            removed, n = b + removed, n + 1
            if b.strip(b" \t"):
                break  # it holds the run's start (a newline merged with indentation, or a word)
        if n == 0 or len(removed) > WHITESPACE_MAX_BYTES or not _valid_utf8(removed):
            return None
        return ids[:-n], Healing(removed.decode("utf-8"), removed, n, self)

    def allowed_ids(self, remaining: bytes) -> list[int]:
        """Ids whose bytes are a prefix of `remaining` or start with all of it."""
        out: list[int] = []
        for k in range(1, len(remaining)):
            out.extend(self._by_bytes.get(remaining[:k], ()))
        lo = bisect.bisect_left(self._keys, remaining)
        for j in range(lo, len(self._keys)):
            if not self._keys[j].startswith(remaining):
                break
            out.append(self._ids[j])
        return out

    def mask(self, remaining: bytes) -> torch.Tensor:
        """Bool mask [vocab_size] of allowed ids (cached; do not modify)."""
        with self._lock:
            m = self._masks.get(remaining)
            if m is None:
                m = torch.zeros(self.vocab_size, dtype=torch.bool)
                ids = self.allowed_ids(remaining)
                if ids:
                    m[torch.tensor(ids, dtype=torch.long)] = True
                m = m.to(self.device)
                if len(self._masks) > 4096:
                    self._masks.clear()
                self._masks[remaining] = m
            return m


# Bounds on whitespace healing: indentation is rarely deeper than a few dozen columns, and each
# removed byte is one the model re-derives under the mask.
WHITESPACE_MAX_TOKENS = 8
WHITESPACE_MAX_BYTES = 128


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


ConstraintFn = Callable[[Sequence[int]], "torch.Tensor | None"]
