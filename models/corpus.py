"""The training corpus of the bundled model: the CPython standard library sources.

Files are the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` of the
running interpreter, excluding ``site-packages`` (third-party code) and
anything that is not valid UTF-8. Order is deterministic (sorted POSIX relative
paths). The held-out split is by file: a file is held out when the SHA-1 of its
relative path, read as an integer, is 0 mod 20 (about 5%). Training (tokenizer
and model) never sees held-out files; benchmarks and ``completiond eval`` use
only held-out files.

Reusable API::

    stdlib_root() -> Path
    is_heldout(relpath) -> bool
    all_files() -> list[CorpusFile]
    training_files() / heldout_files() -> list[CorpusFile]
    read_text(f) -> str
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELDOUT_MODULUS = 20  # 1 in 20 files (~5%) held out

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class CorpusFile:
    relpath: str  # POSIX path relative to the stdlib root, e.g. "json/decoder.py"
    path: Path  # absolute path

    def read_text(self) -> str:
        return read_text(self)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def is_heldout(relpath: str) -> bool:
    """True when the file at this stdlib-relative POSIX path is in the held-out split."""
    digest = hashlib.sha1(relpath.replace("\\", "/").encode("utf-8")).hexdigest()
    return int(digest, 16) % HELDOUT_MODULUS == 0


def read_text(f: CorpusFile | Path) -> str:
    """The file's text, exactly its bytes decoded as UTF-8 (no newline translation)."""
    path = f.path if isinstance(f, CorpusFile) else Path(f)
    return path.read_bytes().decode("utf-8")


def _is_utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return False
    return True


@functools.lru_cache(maxsize=4)
def _scan(root: str) -> tuple[CorpusFile, ...]:
    base = Path(root)
    out = []
    for path in base.rglob("*.py"):
        rel = path.relative_to(base)
        if any(part in _EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if not path.is_file() or path.is_symlink():
            continue
        if not _is_utf8(path):
            continue
        out.append(CorpusFile(rel.as_posix(), path))
    out.sort(key=lambda f: f.relpath)
    return tuple(out)


def all_files(root: Path | None = None) -> list[CorpusFile]:
    """Every usable stdlib .py file, sorted by relative path."""
    return list(_scan(str(root or stdlib_root())))


def training_files(root: Path | None = None) -> list[CorpusFile]:
    return [f for f in all_files(root) if not is_heldout(f.relpath)]


def heldout_files(root: Path | None = None) -> list[CorpusFile]:
    return [f for f in all_files(root) if is_heldout(f.relpath)]


def describe(root: Path | None = None) -> dict:
    """Summary numbers for the model card."""
    tr, ho = training_files(root), heldout_files(root)
    return {
        "stdlib_root": str(root or stdlib_root()),
        "training_files": len(tr),
        "training_bytes": sum(f.path.stat().st_size for f in tr),
        "heldout_files": len(ho),
        "heldout_bytes": sum(f.path.stat().st_size for f in ho),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(describe(), indent=2))
