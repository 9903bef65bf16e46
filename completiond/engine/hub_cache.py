"""The Hugging Face cache without the network: what names a hub model (hub ids, revisions, short names),
where the cache is (read from the environment at each call), what a snapshot holds and whether it is
complete, and the checks a model passes before anything of it is fetched or loaded (which files a load
needs, config.json's values, side files as regular files under caps). hub.py's pull uses these to fetch
what the cache lacks; everything here is hub.py's API too (re-exported there).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable

from completiond.config import is_local_model
from completiond.engine.catalog import CATALOG_BY_NAME
from completiond.errors import CompletionError
from completiond.fileio import check_file, read_file, user_cache_dir
from completiond.models.adapters import FAMILIES

DEFAULT_ENDPOINT = "https://huggingface.co"

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
INFO_FILES = ("completiond.json",)
INDEX_FILE = "model.safetensors.index.json"
# Files beside a model's weights that are trained on it here (keyed to its identity), not part of it.
DRAFT_FILES = frozenset({"exit_adapter.safetensors", "medusa_heads.safetensors"})

# Every side file is read as a regular file under a cap (fileio.read_file): a symlink to /dev/zero or a
# FIFO, or a multi-gigabyte "config", fails at once with its name instead of exhausting memory. The caps
# are far above real files (Qwen2.5's tokenizer.json: 7 MB; a 405B model's weight index: 100 kB).
SIDE_FILE_LIMITS: dict[str, int] = {
    "config.json": 1 << 20,
    "generation_config.json": 1 << 20,
    "completiond.json": 1 << 20,
    INDEX_FILE: 16 << 20,
    "tokenizer.json": 64 << 20,
    "tokenizer_config.json": 16 << 20,
    "special_tokens_map.json": 1 << 20,
    "added_tokens.json": 16 << 20,
    "vocab.json": 32 << 20,
    "merges.txt": 32 << 20,
    "tokenizer.model": 32 << 20,
    "chat_template.jinja": 1 << 20,
}
REF_LIMIT = 256  # refs/<revision>: one commit hash

# config.json values the engine accepts, checked before anything is allocated from them: each bound is
# far beyond any released model (Llama 3.1 405B: 126 layers, hidden 16,384, intermediate 53,248, 128 heads;
# Gemma: vocabulary 256,000; Llama 4 Scout: 10M positions) and keeps one value from asking for terabytes.
CONFIG_LIMITS: tuple[tuple[str, int], ...] = (
    ("num_hidden_layers", 1024),
    ("hidden_size", 65_536),
    ("num_attention_heads", 1024),
    ("num_key_value_heads", 1024),
    ("head_dim", 4096),
    ("vocab_size", 1 << 21),
    ("intermediate_size", 1 << 20),
    ("max_position_embeddings", 1 << 24),
)


class HubError(CompletionError):
    """A hub model that cannot be found, fetched or accepted; the message says what to do."""


# --- names ---------------------------------------------------------------------------------

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# A revision is joined into the cache's refs/ path: a branch, tag or commit name of path components that
# each start with a letter, digit or underscore (so never "." or ".."), like refs/pr/1, and nothing else.
_REVISION = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*(?:/[A-Za-z0-9_][A-Za-z0-9_.+-]*)*$")
MAX_REVISION = 128


def valid_revision(revision: str) -> bool:
    return (
        len(revision) <= MAX_REVISION
        and _REVISION.match(revision) is not None
        and ".." not in revision
        and not revision.endswith((".lock", "."))
    )


def parse(model: str) -> tuple[str, str | None]:
    """(hub id, revision or None) of `org/name`, `org/name@revision` or a CATALOG short name."""
    name, _, revision = model.strip().partition("@")
    entry = CATALOG_BY_NAME.get(name.lower())
    repo = entry.repo if entry is not None else name
    if not _HUB_ID.match(repo) or ".." in repo:
        short = ", ".join(CATALOG_BY_NAME)
        raise HubError(
            f"{model!r} is neither a local directory, nor a Hugging Face hub id (org/name, optionally "
            f"@revision), nor a short name ({short}). A local directory must be written as a path: "
            f"starting with './', '../', '/' or '~'."
        )
    if revision and not valid_revision(revision):
        raise HubError(
            f"{model!r}: {revision!r} is not a revision (a branch, tag or commit: letters, digits, "
            f"'_', '-', '.', '+' in '/'-separated parts, no '..', at most {MAX_REVISION} characters)"
        )
    return repo, revision or None


def is_local(model: str | os.PathLike) -> bool:
    """Whether Engine.load reads `model` as a local directory: a Path object, or a string written as a path
    (`./`, `../`, `/`, `~`: config.is_local_model). Any other string is a hub id or a short name, even
    where the current directory (an editor's project) holds a folder of that name."""
    return isinstance(model, os.PathLike) or is_local_model(model)


def display_name(repo: str, revision: str | None, commit: str) -> str:
    """How users see a hub model: its id with the revision, never a bare hash."""
    short = commit[:12]
    if revision and revision not in ("main", commit):
        return f"{repo}@{revision} ({short})"
    return f"{repo}@{short}"


def name_for_path(path: Path) -> str | None:
    """The hub id and revision of a snapshot directory of a hub cache, else None."""
    parts = Path(path).resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        repo = parts[-3][len("models--") :].replace("--", "/", 1)
        return display_name(repo, None, parts[-1])
    return None


# --- the environment, read at each call ----------------------------------------------------


def cache_dir() -> Path:
    """The hub cache, as huggingface_hub finds it (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or user_cache_dir() / "huggingface"
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def repo_folder(repo: str) -> Path:
    return cache_dir() / ("models--" + repo.replace("/", "--"))


# --- the local cache ------------------------------------------------------------------------


def read_json(path: Path, limit: int | None = None):
    """A side file's JSON, read as a regular file under its cap (SIDE_FILE_LIMITS; 1 MiB for others).
    Raises OSError (UnsafeFile for a device, FIFO or oversized file) or ValueError."""
    data = read_file(path, limit if limit is not None else SIDE_FILE_LIMITS.get(Path(path).name, 1 << 20))
    return loads_json(data.decode("utf-8"), Path(path).name)


def loads_json(text: str | bytes, what: str):
    """json.loads, with nesting too deep for the parser (a 5,000,000-deep file raises RecursionError, which
    no caller expects) reported as the ValueError of any other malformed JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{what}: JSON nested too deeply to read") from None


def check_side_files(directory: Path) -> None:
    """That each side file a load reads (config, tokenizer, completiond.json, weight index) is a regular
    file under its cap, and each safetensors file a regular file, before a library opens them. Raises
    HubError naming the file."""
    # The weights are no side files, but a FIFO or device among them would block or never end the load.
    # (Drafts trained on the model, DRAFT_FILES, are checked where they are read, and skipped if unusable.)
    weights = [(p.name, 1 << 50) for p in sorted(Path(directory).glob("*.safetensors")) if p.name not in DRAFT_FILES]
    for name, limit in [*SIDE_FILE_LIMITS.items(), *weights]:
        path = Path(directory) / name
        if os.path.lexists(path):
            try:
                check_file(path, limit)
            except FileNotFoundError:
                raise HubError(f"{path} is a link to {os.path.realpath(path)}, which does not exist") from None
            except OSError as exc:
                raise HubError(str(exc)) from None


def check_sizes(repo: str, config: dict) -> None:
    """Refuse config.json values past CONFIG_LIMITS (or not positive integers) before anything is built from them."""
    for key, limit in CONFIG_LIMITS:
        value = config.get(key)
        if value is None:
            continue  # transformers' default for the family (all small) applies
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise HubError(
                f"refusing {repo}: its config.json has {key} = {value!r}; the engine accepts a whole "
                f"number from 1 to {limit:,}"
            )
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and kv > heads:
        raise HubError(
            f"refusing {repo}: its config.json has num_key_value_heads = {kv} > num_attention_heads = {heads}"
        )


def _ref(folder: Path, revision: str) -> str | None:
    if _COMMIT.match(revision):
        return revision
    if not valid_revision(revision):
        return None
    try:
        commit = read_file(folder / "refs" / revision, REF_LIMIT).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return commit if _COMMIT.match(commit) else None


def missing_files(snapshot: Path) -> list[str]:
    """What a snapshot directory lacks to be loaded (empty: complete). Links into blobs must resolve."""
    missing = [f for f in ("config.json",) if not (snapshot / f).is_file()]
    if not any((snapshot / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        missing.append("tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    index = snapshot / INDEX_FILE
    if index.is_file():
        try:
            shards = sorted(set(read_json(index)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return missing + [f"{INDEX_FILE} (unreadable)"]
        missing += [s for s in shards if not (snapshot / s).is_file()]
    elif not any(p.is_file() for p in snapshot.glob("*.safetensors") if p.name not in DRAFT_FILES):
        missing.append("*.safetensors weights")
    return missing


def cached_snapshot(repo: str, revision: str | None = None) -> Path | None:
    """The complete snapshot of repo at revision (default main) in the local cache, else None. No network."""
    folder = repo_folder(repo)
    commit = _ref(folder, revision or "main")
    if commit is None:
        return None
    snapshot = folder / "snapshots" / commit
    return snapshot if snapshot.is_dir() and not missing_files(snapshot) else None


# --- choosing what to download ----------------------------------------------------------------


def choose_files(repo: str, files: Iterable[str], trust_remote_code: bool = False) -> list[str]:
    """Of a repository's files, the ones a load needs: config, tokenizer, safetensors weights
    (and its Python code only with trust_remote_code). Raises HubError for pickle-only repos."""
    top = [f for f in files if "/" not in f]  # subfolders hold other formats (original/, onnx/, gguf)
    weights = [f for f in top if f.endswith(".safetensors") and f not in DRAFT_FILES]
    if not weights:
        pickles = sorted(f for f in top if f.endswith(PICKLE_SUFFIXES))
        if pickles:
            raise HubError(
                f"refusing to download {repo}: it publishes only pickle weights ({', '.join(pickles[:4])}), which can "
                "run arbitrary code when loaded. Pick a release with *.safetensors weights, or convert it "
                "(transformers' save_pretrained(..., safe_serialization=True)) and set the model to that directory."
            )
        raise HubError(f"{repo} has no *.safetensors weights at the top of the repository; it cannot be loaded")
    if INDEX_FILE in top:
        weights = [INDEX_FILE]  # the shards it names are added once the index is read
    elif "model.safetensors" in weights:
        weights = ["model.safetensors"]  # others beside it (consolidated.safetensors) are other formats
    wanted = set(CONFIG_FILES) | set(TOKENIZER_FILES) | set(INFO_FILES)
    chosen = [f for f in top if f in wanted] + weights
    if trust_remote_code:
        chosen += [f for f in top if f.endswith(".py")]
    if "config.json" not in chosen:
        raise HubError(f"{repo} is not a transformers model: it has no config.json")
    return chosen


def check_config(repo: str, config: dict, trust_remote_code: bool = False) -> None:
    """Refuse, before any weights are fetched, a model that needs its own code or that the engine cannot run."""
    auto_map = config.get("auto_map")
    if auto_map and not trust_remote_code:
        classes = ", ".join(sorted(str(v) for v in auto_map.values())) if isinstance(auto_map, dict) else str(auto_map)
        raise HubError(
            f"refusing {repo}: its config names its own Python code ({classes}), which would run on this machine. "
            "Allow it only for a repository you trust: trustRemoteCode = true in the settings, or "
            "`completiond pull --trust-remote-code`."
        )
    family = config.get("model_type")
    if family not in FAMILIES:
        raise HubError(
            f"{repo} is a {family!r} model, which the engine cannot run yet; supported families: "
            f"{', '.join(sorted(FAMILIES))} (see `completiond pull --list`)"
        )
    check_sizes(repo, config)


def shards(snapshot: Path) -> list[str]:
    index = read_json(snapshot / INDEX_FILE)
    return sorted(set(index["weight_map"].values()))
