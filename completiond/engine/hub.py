"""Models from the Hugging Face hub: short names, the local cache first, safe downloads, fast failure offline.

`pull` turns a hub id (`org/name`, optionally `@revision`) or a short name from CATALOG into
a complete snapshot directory in the user's Hugging Face cache, in the hub's own layout
(`models--org--name/{blobs,refs,snapshots/<commit>}`), so `huggingface-cli`, transformers and
completiond share one copy. The engine then loads that directory like any local one: the
network is touched only here, and only when the cache lacks the model.

What is downloaded is chosen from the repository's file list before anything is fetched:
config, tokenizer and `*.safetensors` weights only. Pickle checkpoints are never fetched, and
a repository whose config names its own Python code (`auto_map`) is refused unless
trustRemoteCode is on. The config is fetched first, so an unsupported family costs a few
kilobytes, not gigabytes.

Offline (`HF_HUB_OFFLINE=1`) or unreachable: one metadata request with a short timeout and
no retries, then a `HubError` that says what to do. The hub library's own downloads retry
with backoff for about a minute when nothing is cached; they are only reached once the hub
has answered.

Torch-free: `completiond pull` does not need torch. Environment variables (HF_HUB_CACHE,
HF_HOME, HF_ENDPOINT, HF_HUB_OFFLINE) are read at each call, not when huggingface_hub is
imported, so a process can point at another cache or endpoint.
"""

from __future__ import annotations

import inspect
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from completiond.config import is_local_model
from completiond.engine.catalog import (  # noqa: F401  (hub.CATALOG and the rest: the catalog's API)
    CATALOG,
    CATALOG_BY_NAME,
    CATALOG_BY_REPO,
    CPU_BANDWIDTH,
    GPU_BANDWIDTH,
    CatalogEntry,
    _speed_class,
    catalog_table,
    cpu_speed,
)
from completiond.engine.download_progress import ByteCounter
from completiond.errors import CompletionError
from completiond.fileio import check_file, read_file, user_cache_dir
from completiond.models.adapters import FAMILIES

# One metadata request decides whether the hub is reachable: an editor waiting for its first
# suggestion must not sit through the hub library's retry loop.
HUB_TIMEOUT = 5.0
RESUME_READ_TIMEOUT = 30.0  # a weights download that stalls this long fails, and the next pull continues it
DEFAULT_ENDPOINT = "https://huggingface.co"

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
INFO_FILES = ("completiond.json",)
INDEX_FILE = "model.safetensors.index.json"
# Files beside a model's weights that are trained on it here (keyed to its identity), not part of it.
DRAFT_FILES = frozenset({"exit_adapter.safetensors", "medusa_heads.safetensors"})

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes in all)

# Every side file is read as a regular file under a cap (fileio.read_file): a symlink to /dev/zero or a
# FIFO, or a multi-gigabyte "config", fails at once with its name instead of exhausting memory. The caps
# are far above real files (Qwen2.5's tokenizer.json: 7 MB; a 405B model's weight index: 100 kB).
SIDE_FILE_LIMITS: dict[str, int] = {
    "config.json": 1 << 20, "generation_config.json": 1 << 20, "completiond.json": 1 << 20,
    INDEX_FILE: 16 << 20, "tokenizer.json": 64 << 20, "tokenizer_config.json": 16 << 20,
    "special_tokens_map.json": 1 << 20, "added_tokens.json": 16 << 20, "vocab.json": 32 << 20,
    "merges.txt": 32 << 20, "tokenizer.model": 32 << 20, "chat_template.jinja": 1 << 20,
}
REF_LIMIT = 256  # refs/<revision>: one commit hash

# config.json values the engine accepts, checked before anything is allocated from them: each bound is
# far beyond any released model (Llama 3.1 405B: 126 layers, hidden 16,384, intermediate 53,248, 128 heads;
# Gemma: vocabulary 256,000; Llama 4 Scout: 10M positions) and keeps one value from asking for terabytes.
CONFIG_LIMITS: tuple[tuple[str, int], ...] = (
    ("num_hidden_layers", 1024), ("hidden_size", 65_536), ("num_attention_heads", 1024),
    ("num_key_value_heads", 1024), ("head_dim", 4096), ("vocab_size", 1 << 21),
    ("intermediate_size", 1 << 20), ("max_position_embeddings", 1 << 24),
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
    return (len(revision) <= MAX_REVISION and _REVISION.match(revision) is not None and ".." not in revision
            and not revision.endswith((".lock", ".")))


def parse(model: str) -> tuple[str, str | None]:
    """(hub id, revision or None) of `org/name`, `org/name@revision` or a CATALOG short name."""
    name, _, revision = model.strip().partition("@")
    entry = CATALOG_BY_NAME.get(name.lower())
    repo = entry.repo if entry is not None else name
    if not _HUB_ID.match(repo) or ".." in repo:
        short = ", ".join(CATALOG_BY_NAME)
        raise HubError(f"{model!r} is neither a local directory, nor a Hugging Face hub id (org/name, optionally "
                       f"@revision), nor a short name ({short}). A local directory must be written as a path: "
                       f"starting with './', '../', '/' or '~'.")
    if revision and not valid_revision(revision):
        raise HubError(f"{model!r}: {revision!r} is not a revision (a branch, tag or commit: letters, digits, "
                       f"'_', '-', '.', '+' in '/'-separated parts, no '..', at most {MAX_REVISION} characters)")
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
        repo = parts[-3][len("models--"):].replace("--", "/", 1)
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
            raise HubError(f"refusing {repo}: its config.json has {key} = {value!r}; the engine accepts a whole "
                           f"number from 1 to {limit:,}")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and kv > heads:
        raise HubError(f"refusing {repo}: its config.json has num_key_value_heads = {kv} > num_attention_heads = {heads}")


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
                "(transformers' save_pretrained(..., safe_serialization=True)) and set the model to that directory.")
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
            "`completiond pull --trust-remote-code`.")
    family = config.get("model_type")
    if family not in FAMILIES:
        raise HubError(f"{repo} is a {family!r} model, which the engine cannot run yet; supported families: "
                       f"{', '.join(sorted(FAMILIES))} (see `completiond pull --list`)")
    check_sizes(repo, config)


def shards(snapshot: Path) -> list[str]:
    index = read_json(snapshot / INDEX_FILE)
    return sorted(set(index["weight_map"].values()))


# --- pulling ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pulled:
    path: Path          # the snapshot directory
    repo: str
    revision: str | None
    commit: str
    downloaded: int     # bytes fetched now (0: it was in the cache)
    total: int          # bytes of the files chosen

    @property
    def name(self) -> str:
        return display_name(self.repo, self.revision, self.commit)


def _where_to_copy(repo: str) -> str:
    return (f"Set completiond.model to a local model directory, or run `completiond pull {repo}` on a connected "
            f"machine and copy its {repo_folder(repo).name} folder into {cache_dir()} here "
            "(HF_HUB_CACHE or HF_HOME choose that place)")


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's connection and timeout errors: huggingface_hub 1.x talks through httpx
    (2.x through its fork httpx2), and neither's errors are OSErrors."""
    found: list[type[BaseException]] = [OSError]
    try:
        import httpx2

        found.append(httpx2.TransportError)
    except ImportError:
        pass
    try:
        import httpx

        found.append(httpx.TransportError)
    except ImportError:
        pass
    return tuple(found)


def _hub_errors():
    from huggingface_hub import errors

    return errors


def _describe(repo: str, exc: BaseException) -> HubError:
    errors = _hub_errors()
    if isinstance(exc, errors.GatedRepoError):
        return HubError(f"{repo} is gated: accept its licence at {endpoint()}/{repo} while logged in, then log in "
                        "here (`hf auth login`, or set HF_TOKEN) and pull again")
    if isinstance(exc, errors.RevisionNotFoundError):
        return HubError(f"{repo} has no such revision on the hub: {exc}")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return HubError(f"{repo} is not on the hub {endpoint()} (or it is private: log in with `hf auth login` or "
                        "set HF_TOKEN). Check the id, or see `completiond pull --list`")
    return HubError(f"cannot reach the Hugging Face hub ({endpoint()}) for {repo}: {type(exc).__name__}: {exc}. "
                    + _where_to_copy(repo) + ".")


def pull(model: str, trust_remote_code: bool = False, progress: ProgressFn | None = None) -> Pulled:
    """The local snapshot of `model` (hub id or short name), downloading what the cache lacks."""
    repo, revision = parse(model)
    cached = cached_snapshot(repo, revision)
    if cached is not None:
        _check_local(repo, cached, trust_remote_code)
        return Pulled(cached, repo, revision, cached.name, 0, _size(cached))
    if offline():
        raise HubError(f"{repo}{'@' + revision if revision else ''} is not in the local Hugging Face cache "
                       f"({cache_dir()}), and HF_HUB_OFFLINE is set, so it cannot be downloaded. "
                       + _where_to_copy(repo) + "; or unset HF_HUB_OFFLINE on a connected machine.")
    from huggingface_hub import HfApi, hf_hub_download

    errors = _hub_errors()
    api = HfApi(endpoint=endpoint())
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True, timeout=HUB_TIMEOUT)
    except (errors.HfHubHTTPError, *_transport_errors()) as exc:
        raise _describe(repo, exc) from None
    commit = info.sha
    if not commit or not _COMMIT.match(commit):
        raise HubError(f"the hub ({endpoint()}) gave no commit for {repo}; try again later")
    sizes = {s.rfilename: int(s.size or 0) for s in (info.siblings or [])}
    digests = {s.rfilename: _digest(s) for s in (info.siblings or [])}
    chosen = choose_files(repo, sizes, trust_remote_code)
    check_free_space(repo_folder(repo), sum(sizes.get(f, 0) for f in chosen))
    folder = repo_folder(repo)
    done = [0]

    def add(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(min(done[0], total), total)

    bar = type("_PullBytes", (ByteCounter,), {"sink": staticmethod(add)})

    # Byte-level progress needs the tqdm_class hook (huggingface_hub 0.3x and later); without it, per file.
    per_byte = "tqdm_class" in inspect.signature(hf_hub_download).parameters

    progress_hook: dict[str, Any] = {"tqdm_class": bar} if per_byte else {}

    def fetch(filename: str) -> Path:
        try:
            path = Path(hf_hub_download(repo, filename, revision=commit, cache_dir=str(cache_dir()),
                                        endpoint=endpoint(), etag_timeout=HUB_TIMEOUT,
                                        **progress_hook))
            if not per_byte:
                add(sizes.get(filename, 0))
            check_digest(repo, filename, path, digests.get(filename))
            return path
        except (errors.HfHubHTTPError, errors.LocalEntryNotFoundError, *_transport_errors()) as exc:
            raise _describe(repo, exc) from None

    # The config first: a model the engine cannot run, or one that wants its own code, costs kilobytes.
    small = [f for f in chosen if not f.endswith(".safetensors")]
    total = sum(sizes.get(f, 0) for f in chosen)
    config_path = fetch("config.json")
    try:
        config = read_json(config_path)
    except (OSError, ValueError) as exc:
        raise HubError(f"{repo}: config.json is unreadable: {exc}") from None
    check_config(repo, config if isinstance(config, dict) else {}, trust_remote_code)
    for f in small:
        if f != "config.json":
            fetch(f)
    snapshot = folder / "snapshots" / commit
    weights = [f for f in chosen if f.endswith(".safetensors")]
    if INDEX_FILE in chosen:
        try:
            weights = shards(snapshot)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise HubError(f"{repo}: {INDEX_FILE} is unreadable: {exc}") from None
        bad = [w for w in weights if "/" in w or not w.endswith(".safetensors")]
        if bad:
            raise HubError(f"refusing {repo}: its weight index names files that are not top-level safetensors: {bad[:3]}")
        total = sum(sizes.get(f, 0) for f in small) + sum(sizes.get(w, 0) for w in weights)
    for w in weights:
        digest = digests.get(w)
        if digest is not None and digest[0] == "sha256":
            _fetch_resumable(repo, commit, w, digest[1], sizes.get(w, 0), add)
        else:
            fetch(w)
    # The hub writes refs only when it resolves a branch itself; downloads by commit leave that to us,
    # and the next load finds the model through refs/<revision> without asking the hub.
    if not (revision and _COMMIT.match(revision)):
        ref = folder / "refs" / (revision or "main")  # a branch may hold slashes (refs/pr/1); parse checked it
        if not _inside_folder(ref, folder / "refs"):
            raise HubError(f"{repo}: revision {revision!r} leads out of {folder / 'refs'}")
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{ref.name}.tmp")
        tmp.write_text(commit, encoding="utf-8")
        os.replace(tmp, ref)
    missing = missing_files(snapshot)
    if missing:
        raise HubError(f"{repo}: the download left {snapshot} incomplete (missing {', '.join(missing)}); pull again")
    return Pulled(snapshot, repo, revision, commit, done[0], total)


def _fetch_resumable(repo: str, commit: str, filename: str, sha256: str, size: int, add: Callable[[int], None]) -> None:
    """The weights, resuming an interrupted download (engine/resumable.py)."""
    from urllib.parse import quote

    from huggingface_hub import get_token

    from completiond.engine import resumable

    url = f"{endpoint()}/{repo}/resolve/{commit}/{quote(filename)}"
    try:
        resumable.fetch_blob(url, repo_folder(repo), commit, filename, sha256, size, token=get_token(),
                             timeout=RESUME_READ_TIMEOUT, progress=add)
    except ValueError:
        raise HubError(f"{repo}: {filename} does not match the hub's sha256; it was removed, pull again") from None
    except resumable.DownloadError as exc:
        if exc.status in (401, 403):
            raise HubError(f"{repo} is gated: accept its licence at {endpoint()}/{repo} while logged in, then log "
                           "in here (`hf auth login`, or set HF_TOKEN) and pull again") from None
        raise HubError(f"{repo}: downloading {filename} failed ({exc}); pull again: it continues where it "
                       "stopped") from None
    except OSError as exc:
        raise HubError(f"cannot reach the Hugging Face hub ({endpoint()}) for {repo}: {exc}. The part already "
                       f"downloaded is kept: pull again to continue. " + _where_to_copy(repo) + ".") from None


def _digest(sibling) -> tuple[str, str] | None:
    """What the hub's metadata says a file hashes to: ("sha256", hex) for an LFS file (the weights),
    ("git-sha1", hex) for a small one (its git blob id); None when it says neither."""
    lfs = getattr(sibling, "lfs", None)
    sha256 = getattr(lfs, "sha256", None) if lfs is not None else None
    if isinstance(sha256, str) and re.fullmatch(r"[0-9a-f]{64}", sha256):
        return ("sha256", sha256)
    blob = getattr(sibling, "blob_id", None)
    if isinstance(blob, str) and re.fullmatch(r"[0-9a-f]{40}", blob):
        return ("git-sha1", blob)
    return None


def check_digest(repo: str, filename: str, path: Path, digest: tuple[str, str] | None) -> None:
    """The downloaded file hashes to what the hub's metadata says, or it is removed and the pull fails."""
    if digest is None:
        return
    import hashlib

    kind, want = digest
    h = hashlib.sha256() if kind == "sha256" else hashlib.sha1()
    if kind == "git-sha1":
        h.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != want:
        try:
            os.unlink(os.path.realpath(path))  # the blob: the next pull fetches it again
            os.unlink(path)
        except OSError:
            pass
        raise HubError(f"{repo}: {filename} does not match the hub's {kind} ({h.hexdigest()[:12]}... instead of "
                       f"{want[:12]}...); it was removed, pull again")


def check_free_space(folder: Path, needed: int) -> None:
    """Enough free disk where the model goes for what is still to download (with 5 % and 64 MB to spare)."""
    import shutil

    where = folder
    while not where.exists() and where != where.parent:
        where = where.parent
    have = sum(p.stat().st_size for p in (folder / "blobs").iterdir() if p.is_file()) if (folder / "blobs").is_dir() else 0
    missing = max(0, needed - have)
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return
    if missing and free < missing * 1.05 + (64 << 20):
        raise HubError(f"not enough free disk space for this model: {missing / 1e9:.2f} GB to download, "
                       f"{free / 1e9:.2f} GB free in {where}; free some space (or set HF_HUB_CACHE to a larger disk) "
                       "and pull again")


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _inside_folder(path: Path, folder: Path) -> bool:
    return os.path.abspath(path).startswith(os.path.abspath(folder) + os.sep)


def _check_local(repo: str, snapshot: Path, trust_remote_code: bool) -> None:
    try:
        config = read_json(snapshot / "config.json")
    except (OSError, ValueError) as exc:
        raise HubError(f"{snapshot}/config.json is unreadable: {exc}") from None
    check_config(repo, config if isinstance(config, dict) else {}, trust_remote_code)
