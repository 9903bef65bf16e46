"""The documents editors have open in the daemon, per editor, and the workspace they feed: the context
files a prompt may draw on, behind the privacy gate (completion/privacy.py)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable
from typing import Any

from completiond.config import Config
from completiond.completion.documents import Document, EditError
from completiond.errors import CompletionError

log = logging.getLogger(__name__)

MAX_FOLDERS = 16  # workspace folders watched per editor


class OutOfSync(CompletionError):
    """A document the daemon does not have (any more) as the editor has it: the editor resends it whole."""


class Documents:
    """Open documents keyed by (client, uri), the workspace (created on first use) and each editor's
    folders. Event loop thread only; the workspace does its I/O on its own thread."""

    def __init__(self) -> None:
        self.documents: dict[tuple[Hashable, str], Document] = {}
        self.workspace: Any = None  # completiond.completion.workspace.Workspace, created on first use
        self._client_folders: dict[Hashable, set[str]] = {}  # workspace folders each editor added

    # --- documents -----------------------------------------------------------

    def get(self, client: Hashable, uri: str) -> Document | None:
        return self.documents.get((client, uri))

    def open(self, client: Hashable, uri: str, version: int, text: str, language_id: str = "") -> None:
        doc = Document(uri=uri, text=text, version=version, language_id=language_id)
        self.documents[(client, uri)] = doc
        self._ws_update(client, uri, doc)

    def change(self, client: Hashable, uri: str, version: int, edits: list) -> None:
        """Apply edits; OutOfSync (the document forgotten) when it is not open or they do not apply."""
        doc = self.documents.get((client, uri))
        if doc is None:
            raise OutOfSync(f"{uri} is not open")
        try:
            doc.apply_edits([tuple(e) if isinstance(e, list) else e for e in edits], version)
        except EditError as exc:
            # Out of sync: forget it, so the next completion asks the client to resend it whole.
            del self.documents[(client, uri)]
            raise OutOfSync(f"{uri}: {exc}; resend the document") from None
        if edits:
            first = edits[0]
            self._ws_update(client, uri, doc, first[0] if isinstance(first[0], int) else 0)

    def close(self, client: Hashable, uri: str) -> None:
        if self.documents.pop((client, uri), None) is not None:
            self._ws_update(client, uri, None)

    def drop_client(self, client: Hashable) -> None:
        for key in [k for k in self.documents if k[0] == client]:
            del self.documents[key]
        self._client_folders.pop(client, None)
        if self.workspace is not None:
            self.workspace.drop_owner(client)  # its open documents, and its folders unless another editor has them

    # --- workspace context ------------------------------------------------------

    def _ws(self) -> Any:
        if self.workspace is None:
            from completiond.completion.workspace import Workspace

            self.workspace = Workspace()
            # A file's context block stays put while the cursor moves (selection.Selector.hold): its prompts'
            # KV is then reused after a jump, a rest or a switch back (issue 45).
            self.workspace.selector.hold = True
        return self.workspace

    def add_folders(self, client: Hashable, folders: list[str], removed: list[str] | None = None) -> None:
        """Workspace folders of one editor: watched for the context block of that editor's prompts only.
        Set-up (checks, watches, scans) runs on the workspace's I/O thread, not here on the event loop."""
        ws = self._ws()
        # Counted here, synchronously: the workspace registers folders later, on its I/O thread.
        mine = self._client_folders.setdefault(client, set())
        for folder in removed or []:
            mine.discard(os.path.abspath(folder))
            ws.remove_folder(folder, owner=client, wait=False)
        for folder in folders:
            folder = os.path.abspath(folder)
            if folder in mine:
                continue
            if len(mine) >= MAX_FOLDERS:
                log.warning("workspace folder %s ignored: an editor may add at most %d", folder, MAX_FOLDERS)
                continue
            mine.add(folder)
            ws.add_folder(folder, owner=client, wait=False)
        if folders:
            ws.start(wait=False)

    def _ws_update(self, client: Hashable, uri: str, doc: Document | None, edit_start: int | None = None) -> None:
        path = uri_path(uri)
        if path is None:
            return
        try:
            if doc is None:
                self._ws().did_close(path, owner=client)
            elif edit_start is None:
                self._ws().did_open(path, doc.text, doc.language_id or None, owner=client)
            else:
                self._ws().did_change(
                    path,
                    doc.text,
                    edit_line=doc.text.count("\n", 0, edit_start),
                    language=doc.language_id or None,
                    owner=client,
                )
        except (OSError, ValueError) as exc:  # context is a nicety: never fail the edit for it
            log.debug("workspace update for %s failed: %s", uri, exc)

    def admission(self, client: Hashable, cfg: Config, path: str | None) -> Any:
        """The privacy gate's verdict on a document of `client` (privacy.classify: its folders, ignore rules
        and contextExclude). Folders the editor announced count before the workspace has set them up."""
        return self._ws().admission(
            path, owner=client, exclude=_exclude_patterns(cfg), roots=self._client_folders.get(client, ())
        )

    def context(
        self,
        client: Hashable,
        cfg: Config,
        path: str | None,
        language: str | None,
        text: str | None = None,
        offset: int | None = None,
        budgets: tuple[int, int, int] | None = None,
        count: Callable[[str], int] | None = None,
    ) -> list[tuple[str, str]]:
        """The context block's files: retrieved for the cursor (contextRetrieval on) or recent snippets.
        budgets: the prompt's (prefix, suffix, context) budgets, where the completer knows them; count: how
        the completer measures text (None: characters)."""
        if self.workspace is None or not path or not cfg.workspace_context or cfg.context_tokens <= 0:
            return []
        prefix_budget, suffix_budget, budget = budgets or (cfg.prefix_tokens, cfg.suffix_tokens, cfg.context_tokens)
        mode = "retrieval" if getattr(cfg, "context_retrieval", "off") == "on" else "recent"
        try:
            return self.workspace.context(
                path,
                language,
                budget,
                count,
                owner=client,
                exclude=_exclude_patterns(cfg),
                text=text,
                offset=offset,
                mode=mode,
                window_tokens=(prefix_budget, suffix_budget),
                # Folders the editor announced count before the I/O thread has set them up (as in `admission`).
                roots=self._client_folders.get(client, ()),
            )
        except (OSError, ValueError) as exc:
            log.debug("workspace context for %s failed: %s", path, exc)
            return []

    def stop(self) -> None:
        if self.workspace is not None:
            self.workspace.stop()


def uri_path(uri: str) -> str | None:
    if uri.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return unquote(urlparse(uri).path)
    return None


def gate_path(uri: str) -> str | None:
    """The path the privacy gate judges: a file's, and another scheme's too (a `git:` diff of `.env` is
    the deny-listed file all the same, and outside the workspace folders); None for an untitled buffer."""
    from urllib.parse import unquote, urlparse

    path = unquote(urlparse(uri).path)
    return path if path.startswith("/") else None


def _exclude_patterns(cfg: Config) -> list[str]:
    return [p for p in str(getattr(cfg, "context_exclude", "") or "").split(",") if p.strip()]
