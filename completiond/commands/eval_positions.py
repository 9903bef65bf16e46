"""Cursor positions for `completiond eval`: deterministic, the document cut the way it looks while the user
types there (eol: the rest of the line removed; infix: the middle of a line removed, its closing run kept;
midword: the cursor inside an identifier)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from completiond.completion.languages import language_of

CLOSING_RUN = set(")]}:;,'\"")


@dataclass
class Position:
    path: str  # relative to DIR
    text: str  # the document as the user sees it
    offset: int  # cursor
    target: str  # what the file really has at the cursor (one line at most)
    kind: str  # eol | infix | midword


# -- positions -------------------------------------------------------------


def source_files(root: Path, exts: Iterable[str] | None = None) -> list[Path]:
    wanted = {e if e.startswith(".") else "." + e for e in exts} if exts else None
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in ("node_modules", "__pycache__"))
        for name in sorted(filenames):
            ext = os.path.splitext(name)[1].lower()
            if (wanted is not None and ext in wanted) or (wanted is None and language_of(name) is not None):
                out.append(Path(dirpath) / name)
    return sorted(out)


def _read(path: Path, max_bytes: int = 1 << 20) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) > max_bytes or b"\x00" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _is_word(c: str) -> bool:
    return c.isalnum() or c == "_"


def pick_positions(
    root: Path,
    count: int,
    seed: int = 0,
    per_file: int = 4,
    exts: Iterable[str] | None = None,
    midword_only: bool = False,
    files: list[Path] | None = None,
) -> list[Position]:
    """Deterministic cursor positions: same directory contents and seed give the same list.

    files: sample from these (under root) instead of every source file in root.
    """
    files = sorted(files) if files is not None else source_files(root, exts)
    order = list(files)
    random.Random(seed).shuffle(order)
    out: list[Position] = []
    for path in order:
        if len(out) >= count:
            break
        text = _read(path)
        if not text:
            continue
        rel = path.relative_to(root).as_posix()
        rng = random.Random(f"{seed}:{rel}")
        starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
        lines = []
        for s in starts:
            e = text.find("\n", s)
            e = len(text) if e < 0 else e
            body = text[s:e]
            if 2 <= len(body.strip()) <= 200:
                lines.append((s, e))
        rng.shuffle(lines)
        taken = 0
        for s, e in lines:
            if taken >= per_file or len(out) >= count:
                break
            pos = _position_in_line(rel, text, s, e, rng, midword_only)
            if pos is not None:
                out.append(pos)
                taken += 1
    return out


def _position_in_line(rel: str, text: str, s: int, e: int, rng: random.Random, midword_only: bool) -> Position | None:
    line = text[s:e]
    indent = len(line) - len(line.lstrip(" \t"))
    body_end = len(line.rstrip())
    if midword_only:
        cols = [c for c in range(indent + 1, body_end) if _is_word(line[c - 1]) and _is_word(line[c])]
        if not cols:
            return None
        c = rng.choice(cols)
        return Position(rel, text[: s + c] + text[e:], s + c, line[c:body_end], "midword")
    run = body_end
    while run > indent and line[run - 1] in CLOSING_RUN:
        run -= 1
    if run < body_end and run - indent >= 3 and rng.random() < 0.4:
        c = rng.randrange(indent, run)
        # Keep the closing run right of the cursor, remove the middle.
        return Position(rel, text[: s + c] + text[s + run :], s + c, line[c:run], "infix")
    c = rng.randrange(indent, body_end)
    return Position(rel, text[: s + c] + text[e:], s + c, line[c:body_end], "eol")
