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

The offline half (names, the cache's layout and completeness, the checks before a fetch or a load) is
hub_cache.py's; its names are this module's API too.
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

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
from completiond.engine.hub_cache import (  # noqa: F401  (hub.HubError and the rest: the offline half's API)
    _COMMIT,
    CONFIG_FILES,
    CONFIG_LIMITS,
    DEFAULT_ENDPOINT,
    DRAFT_FILES,
    INDEX_FILE,
    INFO_FILES,
    MAX_REVISION,
    PICKLE_SUFFIXES,
    REF_LIMIT,
    SIDE_FILE_LIMITS,
    TOKENIZER_FILES,
    HubError,
    _ref,
    cache_dir,
    cached_snapshot,
    check_config,
    check_side_files,
    check_sizes,
    choose_files,
    display_name,
    endpoint,
    is_local,
    loads_json,
    missing_files,
    name_for_path,
    offline,
    parse,
    read_json,
    repo_folder,
    shards,
    valid_revision,
)

# One metadata request decides whether the hub is reachable: an editor waiting for its first
# suggestion must not sit through the hub library's retry loop.
HUB_TIMEOUT = 5.0
RESUME_READ_TIMEOUT = 30.0  # a weights download that stalls this long fails, and the next pull continues it

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes in all)


# --- pulling (the network) ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pulled:
    path: Path  # the snapshot directory
    repo: str
    revision: str | None
    commit: str
    downloaded: int  # bytes fetched now (0: it was in the cache)
    total: int  # bytes of the files chosen

    @property
    def name(self) -> str:
        return display_name(self.repo, self.revision, self.commit)


def _where_to_copy(repo: str) -> str:
    return (
        f"Set completiond.model to a local model directory, or run `completiond pull {repo}` on a connected "
        f"machine and copy its {repo_folder(repo).name} folder into {cache_dir()} here "
        "(HF_HUB_CACHE or HF_HOME choose that place)"
    )


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


def _gated(repo: str) -> HubError:
    return HubError(
        f"{repo} is gated: accept its licence at {endpoint()}/{repo} while logged in, then log in "
        "here (`hf auth login`, or set HF_TOKEN) and pull again"
    )


def _describe(repo: str, exc: BaseException) -> HubError:
    errors = _hub_errors()
    if isinstance(exc, errors.GatedRepoError):
        return _gated(repo)
    if isinstance(exc, errors.RevisionNotFoundError):
        return HubError(f"{repo} has no such revision on the hub: {exc}")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return HubError(
            f"{repo} is not on the hub {endpoint()} (or it is private: log in with `hf auth login` or "
            "set HF_TOKEN). Check the id, or see `completiond pull --list`"
        )
    return HubError(
        f"cannot reach the Hugging Face hub ({endpoint()}) for {repo}: {type(exc).__name__}: {exc}. "
        + _where_to_copy(repo)
        + "."
    )


def pull(model: str, trust_remote_code: bool = False, progress: ProgressFn | None = None) -> Pulled:
    """The local snapshot of `model` (hub id or short name), downloading what the cache lacks."""
    repo, revision = parse(model)
    cached = cached_snapshot(repo, revision)
    if cached is not None:
        _check_local(repo, cached, trust_remote_code)
        return Pulled(cached, repo, revision, cached.name, 0, _size(cached))
    if offline():
        raise HubError(
            f"{repo}{'@' + revision if revision else ''} is not in the local Hugging Face cache "
            f"({cache_dir()}), and HF_HUB_OFFLINE is set, so it cannot be downloaded. "
            + _where_to_copy(repo)
            + "; or unset HF_HUB_OFFLINE on a connected machine."
        )
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
            path = Path(
                hf_hub_download(
                    repo,
                    filename,
                    revision=commit,
                    cache_dir=str(cache_dir()),
                    endpoint=endpoint(),
                    etag_timeout=HUB_TIMEOUT,
                    **progress_hook,
                )
            )
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
            raise HubError(
                f"refusing {repo}: its weight index names files that are not top-level safetensors: {bad[:3]}"
            )
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
        path = resumable.fetch_blob(
            url,
            repo_folder(repo),
            commit,
            filename,
            sha256,
            size,
            token=get_token(),
            timeout=RESUME_READ_TIMEOUT,
            progress=add,
        )
    except resumable.DownloadError as exc:
        if exc.status in (401, 403):
            raise _gated(repo) from None
        raise HubError(
            f"{repo}: downloading {filename} failed ({exc}); pull again: it continues where it stopped"
        ) from None
    except OSError as exc:
        raise HubError(
            f"cannot reach the Hugging Face hub ({endpoint()}) for {repo}: {exc}. The part already "
            f"downloaded is kept: pull again to continue. " + _where_to_copy(repo) + "."
        ) from None
    check_digest(repo, filename, path, ("sha256", sha256))


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
        raise HubError(
            f"{repo}: {filename} does not match the hub's {kind} ({h.hexdigest()[:12]}... instead of "
            f"{want[:12]}...); it was removed, pull again"
        )


def check_free_space(folder: Path, needed: int) -> None:
    """Enough free disk where the model goes for what is still to download (with 5 % and 64 MB to spare)."""
    import shutil

    where = folder
    while not where.exists() and where != where.parent:
        where = where.parent
    have = (
        sum(p.stat().st_size for p in (folder / "blobs").iterdir() if p.is_file()) if (folder / "blobs").is_dir() else 0
    )
    missing = max(0, needed - have)
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return
    if missing and free < missing * 1.05 + (64 << 20):
        raise HubError(
            f"not enough free disk space for this model: {missing / 1e9:.2f} GB to download, "
            f"{free / 1e9:.2f} GB free in {where}; free some space (or set HF_HUB_CACHE to a larger disk) "
            "and pull again"
        )


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
