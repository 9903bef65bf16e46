"""The privacy gate: what a file's text may be used for, decided in one place.

Every path whose text could enter a prompt goes through `classify`: the document being completed
(service.py, for the local engine and a remote backend alike) and every file offered as context for
another one (the workspace's context block, and any index built over the workspace). It answers

  DENIED            a secret-bearing file (the built-in deny-list, by name or folder): no completion
                    at all, not even from the local model, and never context;
  LOCAL_ONLY        hidden, vendored, .gitignore'd, outside the editor's workspace folders, reached
                    through a symlink that leaves them, or matched by contextExclude: the local model
                    may complete inside it, but its text never goes to a remote backend and never
                    becomes context for another file;
  LOCAL_AND_REMOTE  an ordinary file of the workspace: anything goes.

with a reason users can read. The rules are by path only (names, folders, ignore rules), never by
content; imports nothing but the standard library, so both the completion layer and the workspace
can call it.
"""

from __future__ import annotations

import enum
import fnmatch
import functools
import os
from dataclasses import dataclass
from typing import Callable, Iterable

# Never context, whoever asks and whatever the settings say (contextExclude can only add to these).
# Matched case-insensitively against every path component below the workspace folder.
SECRET_NAMES: tuple[str, ...] = (
    ".env",
    ".env.*",
    "*.env",
    ".envrc",
    "*.pem",
    "*.key",
    "*.p12",
    "*.pfx",
    "*.jks",
    "*.keystore",
    "*.kdbx",
    "*.gpg",
    "*.asc",
    "id_rsa*",
    "id_dsa*",
    "id_ecdsa*",
    "id_ed25519*",
    "*credential*",
    "*secret*",
    ".netrc",
    "_netrc",
    ".npmrc",
    ".pypirc",
    ".pgpass",
    ".git-credentials",
    ".htpasswd",
    ".vault-token",
    "*.tfvars",
    "*.tfstate",
    "*.tfstate.*",
)
# Folders of credentials (SSH, GnuPG, cloud and container CLIs), matched anywhere in the absolute path,
# so opening one of them (or a file inside) as a workspace still keeps its files out.
SECRET_DIRS = frozenset(
    {".ssh", ".gnupg", ".aws", ".azure", ".kube", ".docker", ".password-store", ".terraform.d", ".oci", ".gcloud"}
)
CONFIG_SECRET_DIRS = frozenset({"gh", "gcloud", "hub", "op", "doctl", "rclone", "sops", "gcloud-sdk"})  # ~/.config/*
# Vendored and tool folders: never scanned, and their open documents stay local like hidden ones.
ALWAYS_SKIPPED_DIRS = frozenset(
    {".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", "venv", ".mypy_cache", ".pytest_cache", ".tox"}
)


class Admission(enum.Enum):
    LOCAL_AND_REMOTE = "local_and_remote"
    LOCAL_ONLY = "local_only"
    DENIED = "denied"


@dataclass(frozen=True)
class Verdict:
    admission: Admission
    reason: str = ""  # why it is restricted, naming the file and the rule ("" for LOCAL_AND_REMOTE)

    @property
    def local_ok(self) -> bool:
        """The local model may complete in it."""
        return self.admission is not Admission.DENIED

    @property
    def remote_ok(self) -> bool:
        """Its text may go to a remote backend, and be context for other files."""
        return self.admission is Admission.LOCAL_AND_REMOTE


ALLOWED = Verdict(Admission.LOCAL_AND_REMOTE)

IgnoredFn = Callable[[str, str], bool]  # (workspace folder, absolute path inside it) -> .gitignore'd?


def classify(
    path: str | os.PathLike | None,
    roots: Iterable[str],
    *,
    exclude: Iterable[str] = (),
    ignored: IgnoredFn | None = None,
) -> Verdict:
    """What the text of `path` may be used for, given the requesting editor's workspace folders `roots`
    (absolute), the contextExclude patterns `exclude` and the folders' ignore rules `ignored`.

    `path` None is a buffer that is no file (an untitled document): nothing on disk to protect, it
    goes where the user's typing goes. The order of the checks: the deny-list (on the path and on the
    file a symlink leads to), then contextExclude, the folder, hidden or vendored components, and the
    ignore rules."""
    if path is None:
        return ALLOWED
    path = os.path.abspath(os.fspath(path))
    real = os.path.realpath(path)
    roots = [os.path.abspath(r) for r in roots]
    root = _deepest(path, roots)
    shown = os.path.relpath(path, root) if root else path
    for candidate, base in ((path, root), (real, _deepest(real, [_real_root(r) for r in roots]))):
        found = secret_match(candidate, base)
        if found is not None:
            return Verdict(
                Admission.DENIED,
                f"{shown} matches the deny-list of secret files ({found}): "
                "no completions in it, and it is never context",
            )
    exclude = tuple(p for p in exclude if p.strip())
    if exclude:
        found = secret_match(path, root, exclude, builtin=False)
        if found is not None:
            return Verdict(Admission.LOCAL_ONLY, f"{shown} matches contextExclude ({found})")
    if root is None:
        return Verdict(Admission.LOCAL_ONLY, f"{path} is outside the workspace folders")
    if not _inside(real, _real_root(root)):
        return Verdict(Admission.LOCAL_ONLY, f"{shown} leads to {real}, outside its workspace folder")
    parts = os.path.relpath(path, root).split(os.sep)
    hidden = next((p for p in parts if p.startswith(".") or p in ALWAYS_SKIPPED_DIRS), None)
    if hidden is not None:
        what = "a hidden file" if hidden == parts[-1] else f"in the hidden or vendored folder {hidden}/"
        return Verdict(Admission.LOCAL_ONLY, f"{shown} is {what}")
    if ignored is not None and ignored(root, path):
        return Verdict(Admission.LOCAL_ONLY, f"{shown} is ignored by .gitignore")
    return ALLOWED


def secret_match(path: str, root: str | None = None, extra: Iterable[str] = (), builtin: bool = True) -> str | None:
    """The deny-list entry (built-in, or from `extra`) that keeps `path` out of every prompt, or None."""
    found = _builtin_secret(path, root) if builtin else None
    return found if found is not None else _pattern_match(path, root, tuple(extra))


@functools.lru_cache(maxsize=4096)  # checked on every keystroke of an open document
def _builtin_secret(path: str, root: str | None) -> str | None:
    parts = path.split(os.sep)
    for i, part in enumerate(parts[:-1]):
        if part in SECRET_DIRS:
            return f"{part}/"
        if part == ".config" and i + 1 < len(parts) - 1 and parts[i + 1] in CONFIG_SECRET_DIRS:
            return f".config/{parts[i + 1]}/"
    return _pattern_match(path, root, SECRET_NAMES)


def _pattern_match(path: str, root: str | None, patterns: tuple[str, ...]) -> str | None:
    if not patterns:
        return None
    rel = os.path.relpath(path, root) if root and _inside(path, root) else os.path.basename(path)
    rel_posix = rel.replace(os.sep, "/").lower()
    names = rel_posix.split("/")
    for pattern in patterns:
        p = pattern.strip().lower()
        if not p:
            continue
        if "/" in p.strip("/"):
            if fnmatch.fnmatchcase(rel_posix, p.strip("/")):
                return pattern
        elif any(fnmatch.fnmatchcase(name, p.strip("/")) for name in names):
            return pattern
    return None


@functools.lru_cache(maxsize=256)  # a workspace folder's real path: asked on every request, changes ~never
def _real_root(root: str) -> str:
    return os.path.realpath(root)


def _deepest(path: str, roots: Iterable[str]) -> str | None:
    best = None
    for root in roots:
        if _inside(path, root) and (best is None or len(root) > len(best)):
            best = root
    return best


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
