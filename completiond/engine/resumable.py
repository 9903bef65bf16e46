"""Weights downloads that resume after an interruption.

huggingface_hub 2.x downloads each file into a process-unique temporary file, so a pull that was killed
(the editor closed, the laptop slept) starts the weights again from the first byte, and leaves the old
part behind. The weights are the whole download, so `pull` fetches them itself: into
`blobs/<sha256>.completiond-partial`, continuing with an HTTP Range request from what is already there,
then checks the hub's sha256 and lays the file out as the hub library does (the blob named by its sha256,
the snapshot's entry a relative link to it), so offline loads find it like any other.
"""

from __future__ import annotations

import http.client
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

PARTIAL_SUFFIX = ".completiond-partial"
BLOCK = 1 << 20


class DownloadError(OSError):
    """The server refused or broke off the download (the caller words it for the user)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class _SameHostAuth(urllib.request.HTTPRedirectHandler):
    """Follow redirects (the hub sends weights from a CDN) without carrying the user's token to another host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")
        return new


def fetch_blob(
    url: str,
    folder: Path,
    commit: str,
    filename: str,
    sha256: str,
    size: int,
    *,
    token: str | None,
    timeout: float,
    progress: Callable[[int], None],
) -> Path:
    """Download `filename` (whose sha256 the hub gave) into the cache `folder` of its repository, resuming a
    partial download; returns the snapshot path. Raises DownloadError. The caller checks the file against
    `sha256` (hub.check_digest, which removes a blob that does not match: the next pull starts afresh)."""
    blobs = folder / "blobs"
    blob = blobs / sha256
    blobs.mkdir(parents=True, exist_ok=True)
    if not blob.is_file():
        partial = blobs / (sha256 + PARTIAL_SUFFIX)
        _download(url, partial, size, token=token, timeout=timeout, progress=progress)
        os.replace(partial, blob)
    else:
        progress(size)
    link = folder / "snapshots" / commit / filename
    link.parent.mkdir(parents=True, exist_ok=True)
    target = os.path.relpath(blob, link.parent)
    if link.is_symlink() or link.exists():
        if os.path.realpath(link) == os.path.realpath(blob):
            return link
        link.unlink()
    try:
        os.symlink(target, link)
    except OSError:  # no symlinks (some Windows setups): a copy, as the hub library falls back to
        import shutil

        shutil.copyfile(blob, link)
    return link


def _download(
    url: str, partial: Path, size: int, *, token: str | None, timeout: float, progress: Callable[[int], None]
) -> None:
    have = partial.stat().st_size if partial.is_file() else 0
    if size and have > size:  # not ours to continue: start over
        partial.unlink()
        have = 0
    if have:
        progress(have)
    if size and have == size:
        return
    headers = {"User-Agent": "completiond"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if have:
        headers["Range"] = f"bytes={have}-"
    opener = urllib.request.build_opener(_SameHostAuth())
    try:
        response = opener.open(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # the range is past the end: what we have is the whole file
            return
        raise DownloadError(f"HTTP {exc.code} {exc.reason}", exc.code) from None
    with response:
        status = getattr(response, "status", 200)
        mode = "ab" if status == 206 and have else "wb"
        if mode == "wb" and have:
            progress(-have)  # the server ignored the range: the whole file again
        with open(partial, mode) as out:
            try:
                for block in iter(lambda: response.read(BLOCK), b""):
                    out.write(block)
                    progress(len(block))
            except http.client.HTTPException as exc:  # the connection ended early (IncompleteRead)
                raise DownloadError(
                    f"the download stopped at {out.tell()} of {size} bytes ({type(exc).__name__})"
                ) from None
    # A whole response that still differs from the hub's size fails the sha256 check next.
