"""The typing benchmark: replay typing over a held-out file through the real editor path.

An LSP client (this process) drives a `completiond lsp` subprocess, which
talks to its own daemon (in a private runtime directory, so the measurement
never touches the user's daemon). For each chosen line the document is reset
to the file with that line's text removed (indentation kept), then the line is
typed one character at a time: per keystroke a didChange and an
inlineCompletion, and, as editors do, a $/cancelRequest for the previous
completion if it has not been answered yet. The last request of a line is
awaited.

Reported:
  typing_p50_ms / typing_p95_ms    keystroke (didChange sent) to suggestion received, over
                                   requests answered with a result (not cancelled)
  cache_served_fraction            prompt tokens served from the KV cache / all prompt tokens
  wasted_rounds_per_superseded     engine rounds spent on requests that were then superseded
                                   or cancelled, per such request (all their rounds, also those
                                   run while they were still current)
  rounds_after_cancel_per_superseded   of those, rounds finished after the cancel arrived (how
                                   fast the engine lets go: at most the one round in flight)
  responses / requests             every request must get exactly one response
  context_changes_per_100_keystrokes   how often the context block differed from the one before for
                                   the same file (each change re-prefills the prompt after it)
  index                            the retrieval index when typing started (files, chunks)
  index_update                     with `workspace`: what one didChange costs the workspace and its
                                   index (p50/p95/max ms over the same keystrokes, replayed in this
                                   process on a Workspace over the same folder; `measure_index_updates`)

With `workspace` (a project directory), that directory is the editor's workspace folder and the
typed file one of its files (opened as it is on disk, never written), so the context block draws on
the rest of the project: run it with contextRetrieval on and off to see what retrieval costs.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

URI_NAME = "typing_bench.py"


def default_file() -> Path:
    """A held-out file of the bundled model's corpus, of moderate size (deterministic)."""
    from completiond.models.corpus import heldout_files

    files = [f for f in heldout_files() if 4_000 <= f.path.stat().st_size <= 40_000]
    if not files:
        raise FileNotFoundError("no held-out corpus file of 4-40 kB found; pass a file")
    return files[0].path


def pick_lines(text: str, keystrokes: int, min_chars: int = 12) -> list[int]:
    """Indices of lines to retype, spread over the file, totalling about `keystrokes` characters."""
    lines = text.split("\n")
    candidates = [
        i
        for i, line in enumerate(lines)
        if len(line.strip()) >= min_chars and not line.strip().startswith(("#", '"', "'"))
    ]
    if not candidates:
        raise ValueError("no line long enough to type in this file")
    mean = sum(len(lines[i].strip()) for i in candidates) / len(candidates)
    wanted = max(1, int(keystrokes / mean + 0.999))
    step = max(1, len(candidates) // wanted)
    spread = candidates[::step]
    taken = set(spread)
    order = spread + [i for i in candidates if i not in taken]
    chosen: list[int] = []
    total = 0
    for idx in order:
        if total >= keystrokes:
            break
        chosen.append(idx)
        total += len(lines[idx].strip())
    return sorted(chosen)


def measure_index_updates(file: Path, workspace: Path, keystrokes: int = 200) -> dict[str, Any]:
    """Time Workspace.did_change (the text store and the retrieval index's update) for the bench's own
    keystrokes: the same lines typed character by character into `file`, opened in a Workspace over
    `workspace` (scanned first, so the index holds the whole project). The daemon does this work on
    every didChange, before the completion request that follows it."""
    from completiond.completion.workspace import Workspace

    text = Path(file).read_bytes().decode("utf-8")
    lines = text.split("\n")
    ws = Workspace([workspace], scan=False)
    try:
        ws.scan()
        ws.did_open(file, text, "python")
        times: list[float] = []
        typed = 0
        for li in pick_lines(text, keystrokes):
            line = lines[li]
            indent = line[: len(line) - len(line.lstrip())]
            doc = list(lines)
            doc[li] = indent
            ws.did_change(file, "\n".join(doc), edit_line=li)
            for ch in line[len(indent) :]:
                if typed >= keystrokes:
                    break
                doc[li] += ch
                changed = "\n".join(doc)
                t0 = time.perf_counter()
                ws.did_change(file, changed, edit_line=li)
                times.append((time.perf_counter() - t0) * 1000)
                typed += 1
        return {
            "p50_ms": _percentile(times, 0.5),
            "p95_ms": _percentile(times, 0.95),
            "max_ms": max(times) if times else None,
            "changes": len(times),
            "chunks": len(ws.index),
            "files": ws.index.files(),
        }
    finally:
        ws.stop()


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


class _Request:
    __slots__ = ("msg_id", "sent", "answered", "cancelled", "error", "items")

    def __init__(self, msg_id: str, sent: float):
        self.msg_id = msg_id
        self.sent = sent
        self.answered: float | None = None
        self.cancelled = False
        self.error: str | None = None
        self.items = 0


async def _bench(
    model: str | None,
    file: Path,
    keystrokes: int,
    interval_ms: float,
    device: str,
    max_tokens: int,
    runtime_dir: Path,
    settings: dict[str, Any] | None,
    timeout_s: float,
    progress: Callable[[str], None] | None,
    lsp_command: list[str] | None,
    workspace: Path | None = None,
) -> dict[str, Any]:
    from lsprotocol import types
    from pygls.exceptions import JsonRpcException

    text = file.read_bytes().decode("utf-8")
    lines = text.split("\n")
    targets = pick_lines(text, keystrokes)
    # The document lies in a workspace folder the editor announces: a remote backend is sent workspace
    # files only (the privacy gate, completion/privacy.py).
    if workspace is not None:
        folder = Path(workspace).resolve()
        uri = Path(file).resolve().as_uri()
    else:
        folder = runtime_dir / "workspace"
        folder.mkdir(exist_ok=True)
        uri = (folder / URI_NAME).as_uri()
    init = {
        "model": model or "",
        "device": device,
        "maxTokens": max_tokens,
        "multiline": "never",
        "idleTimeout": 30,
        **(settings or {}),
    }

    client, messages = await start_bench_client("completiond-typing-bench", runtime_dir, lsp_command)
    requests: list[_Request] = []
    ids = iter(range(1, 1 << 30))

    async def stats() -> Any:  # the stats dict
        return await asyncio.wait_for(
            client.workspace_execute_command_async(types.ExecuteCommandParams(command="completiond.stats")), 60
        )

    def send_inline(line: int, character: int) -> tuple[_Request, asyncio.Future]:
        req = _Request(f"bench-{next(ids)}", time.perf_counter())
        params = types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri=uri),
            position=types.Position(line, character),
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Automatic),
        )
        cf: Future = client.protocol.send_request(types.TEXT_DOCUMENT_INLINE_COMPLETION, params, msg_id=req.msg_id)
        fut = asyncio.wrap_future(cf)

        def done(f: asyncio.Future) -> None:
            req.answered = time.perf_counter()
            exc = f.exception()
            if isinstance(exc, JsonRpcException) and getattr(exc, "code", None) == -32800:
                req.cancelled = True
            elif exc is not None:
                req.error = f"{type(exc).__name__}: {exc}"
            else:
                result = f.result()
                req.items = len(result.items) if result is not None and result.items else 0

        fut.add_done_callback(done)
        requests.append(req)
        return req, fut

    try:
        await initialize_bench_client(client, folder, init)
        version = 1
        client.text_document_did_open(
            types.DidOpenTextDocumentParams(
                text_document=types.TextDocumentItem(uri=uri, language_id="python", version=version, text=text)
            )
        )
        deadline = time.monotonic() + timeout_s
        while True:  # the daemon loads the model: wait, then warm up with one unmeasured request
            st = (await stats()).get("status") or {}
            if st.get("state") in ("ready", "busy"):
                break
            if st.get("state") == "error" or (st.get("error") and "cannot" in str(st.get("error"))):
                raise RuntimeError(f"daemon failed: {st.get('error')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon not ready within {timeout_s:g} s: {st or messages}")
            await asyncio.sleep(0.2)
        while workspace is not None:  # the folder's background scan: let it finish before timing keystrokes
            index = (await stats()).get("index") or {}
            if (index.get("files") and not index.get("scanning")) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        _, warm = send_inline(0, 0)
        await asyncio.wait_for(warm, timeout_s)
        requests.clear()
        before = await stats()

        typed = 0
        for n, li in enumerate(targets):
            if typed >= keystrokes or time.monotonic() > deadline:
                break
            line = lines[li]
            indent = line[: len(line) - len(line.lstrip())]
            body = line[len(indent) :]
            doc_lines = list(lines)
            doc_lines[li] = indent
            version += 1
            client.text_document_did_change(
                types.DidChangeTextDocumentParams(
                    text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=version),
                    content_changes=[types.TextDocumentContentChangeWholeDocument(text="\n".join(doc_lines))],
                )
            )
            col = len(indent.encode("utf-16-le")) // 2
            pending: tuple[_Request, asyncio.Future] | None = None
            for ch in body:
                if typed >= keystrokes:
                    break
                pos = types.Position(li, col)
                version += 1
                client.text_document_did_change(
                    types.DidChangeTextDocumentParams(
                        text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=version),
                        content_changes=[
                            types.TextDocumentContentChangePartial(range=types.Range(start=pos, end=pos), text=ch)
                        ],
                    )
                )
                col += len(ch.encode("utf-16-le")) // 2
                typed += 1
                if pending is not None and not pending[1].done():
                    client.protocol.notify(types.CANCEL_REQUEST, types.CancelParams(id=pending[0].msg_id))
                pending = send_inline(li, col)
                await asyncio.sleep(interval_ms / 1000)
            if pending is not None:
                await asyncio.wait_for(asyncio.shield(pending[1]), timeout_s)
            if progress is not None:
                progress(f"line {n + 1}/{len(targets)}: {typed} keystrokes")
        # Every request gets exactly one response: wait for stragglers.
        outstanding = [r for r in requests if r.answered is None]
        for _ in range(int(30 / 0.05)):
            if all(r.answered is not None for r in outstanding):
                break
            await asyncio.sleep(0.05)
        after = await stats()
    finally:
        try:
            await asyncio.wait_for(client.shutdown_async(None), 10)
            client.exit(None)
        except (asyncio.TimeoutError, JsonRpcException, RuntimeError, ConnectionError):
            pass
        await client.stop()

    def delta(key: str) -> float:
        return float(after.get(key) or 0) - float(before.get(key) or 0)

    answered = [r for r in requests if r.answered is not None and not r.cancelled and r.error is None]
    latencies = [(r.answered - r.sent) * 1000 for r in answered]  # type: ignore[operator]
    with_items = [(r.answered - r.sent) * 1000 for r in answered if r.items]  # type: ignore[operator]
    prompt = delta("prompt_tokens")
    superseded = delta("superseded") + delta("cancelled")
    return {
        "typing_p50_ms": _percentile(latencies, 0.5),
        "typing_p95_ms": _percentile(latencies, 0.95),
        "cache_served_fraction": (delta("reused_tokens") / prompt) if prompt else None,
        "wasted_rounds_per_superseded": (delta("wasted_rounds") / superseded) if superseded else 0.0,
        "responses": sum(1 for r in requests if r.answered is not None),
        "requests": len(requests),
        "answered": len(answered),
        "with_suggestion": len(with_items),
        "suggestion_p50_ms": _percentile(with_items, 0.5),
        "cancelled_responses": sum(1 for r in requests if r.cancelled),
        "errors": [r.error for r in requests if r.error][:5],
        "keystrokes": typed,
        "lines": len(targets),
        "interval_ms": interval_ms,
        "file": str(file),
        "model": (after.get("status") or {}).get("model"),
        "device": (after.get("status") or {}).get("device"),
        "engine_mean_ms": (delta("latency_ms_sum") / delta("completed")) if delta("completed") else None,
        "typed_through": (
            (after.get("lsp") or {}).get("typed_through", 0) - (before.get("lsp") or {}).get("typed_through", 0)
        ),
        "superseded": superseded,
        "wasted_rounds": delta("wasted_rounds"),
        "rounds_after_cancel_per_superseded": (delta("rounds_after_cancel") / superseded) if superseded else 0.0,
        "rounds": delta("rounds"),
        "context_changes_per_100_keystrokes": 100 * delta("context_changes") / typed if typed else 0.0,
        "index": before.get("index"),
        "last_alpha": (after.get("status") or {}).get("draft_acceptance"),
        "messages": messages,
    }


def run_typing_bench(
    model: str | None = None,
    file: Path | None = None,
    keystrokes: int = 200,
    *,
    interval_ms: float = 100.0,
    device: str = "auto",
    max_tokens: int = 16,
    runtime_dir: Path | None = None,
    settings: dict[str, Any] | None = None,
    timeout_s: float = 600.0,
    progress: Callable[[str], None] | None = None,
    lsp_command: list[str] | None = None,
    log: Callable[..., None] | None = None,
    workspace: Path | None = None,
) -> dict[str, Any]:
    """Run the typing benchmark; see the module docstring for what the keys mean.

    model: None/"" = the bundled model. file: None = a held-out corpus file.
    runtime_dir: where the benchmark's own daemon puts its socket (default: a fresh
    temporary directory, removed afterwards, with the daemon stopped).
    progress / log: called with one line of text per typed line.
    workspace: a project directory holding `file`: the editor's workspace folder (context source).
    """
    progress = progress or log
    file = Path(file) if file is not None else default_file()
    own_dir = runtime_dir is None
    base = Path(runtime_dir) if runtime_dir is not None else Path(tempfile.mkdtemp(prefix="completiond-bench-"))
    try:
        result = asyncio.run(
            _bench(
                model,
                file,
                keystrokes,
                interval_ms,
                device,
                max_tokens,
                base,
                settings,
                timeout_s,
                progress,
                lsp_command,
                workspace,
            )
        )
        if workspace is not None:
            # After the replay (its daemon is idle by then): the in-process micro-benchmark of didChange.
            result["index_update"] = measure_index_updates(file, Path(workspace), keystrokes)
        return result
    finally:
        _stop_daemon(base)
        if own_dir:
            shutil.rmtree(base, ignore_errors=True)


def _stop_daemon(xdg_dir: Path) -> None:
    """Stop the benchmark's daemon (started by our LSP subprocess in its private directory)."""
    import signal

    from completiond.serving import paths

    directory = xdg_dir / "completiond"
    try:
        pid = int((directory / paths.PID_NAME).read_text())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    """`python -m completiond.commands.bench_typing [--model M] [--file F] [--keystrokes N]` (the lead's
    `completiond bench --typing` is the documented entry point)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="completiond.commands.bench_typing")
    parser.add_argument("--model")
    parser.add_argument("--file", type=Path)
    parser.add_argument("--keystrokes", type=int, default=200)
    parser.add_argument("--interval-ms", type=float, default=100.0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--workspace", type=Path, help="project directory holding --file: the workspace folder")
    parser.add_argument("--retrieval", choices=("on", "off"), help="the contextRetrieval setting")
    args = parser.parse_args(argv)
    settings = {"contextRetrieval": args.retrieval} if args.retrieval else None
    result = run_typing_bench(
        args.model,
        args.file,
        args.keystrokes,
        interval_ms=args.interval_ms,
        device=args.device,
        max_tokens=args.max_tokens,
        settings=settings,
        progress=lambda m: print(m, file=sys.stderr),
        workspace=args.workspace,
    )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())


async def start_bench_client(name: str, runtime_dir: Path, lsp_command: list[str] | None) -> tuple[Any, list[str]]:
    """A pygls client running `completiond lsp` (or lsp_command) in its own runtime dir; the list collects the
    messages the server shows. The editing bench starts its client through this too."""
    from lsprotocol import types
    from pygls.lsp.client import LanguageClient

    client = LanguageClient(name, "1")
    messages: list[str] = []

    @client.feature(types.WINDOW_SHOW_MESSAGE)
    def _show(params: types.ShowMessageParams) -> None:
        messages.append(params.message)

    @client.feature(types.WINDOW_LOG_MESSAGE)
    def _log(params: types.LogMessageParams) -> None:
        pass

    @client.feature("completiond/status")
    def _status(params: Any) -> None:
        pass

    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime_dir))
    await client.start_io(*(lsp_command or [sys.executable, "-m", "completiond.cli", "lsp"]), env=env)
    return client, messages


async def initialize_bench_client(client: Any, folder: Path, init: dict) -> None:
    """The LSP handshake both benches make: UTF-16 positions, `init` as completiond's settings, `folder` as the
    one workspace folder."""
    from lsprotocol import types

    await client.initialize_async(
        types.InitializeParams(
            process_id=os.getpid(),
            capabilities=types.ClientCapabilities(
                general=types.GeneralClientCapabilities(position_encodings=[types.PositionEncodingKind.Utf16])
            ),
            initialization_options={"completiond": init},
            workspace_folders=[types.WorkspaceFolder(uri=folder.as_uri(), name="bench")],
        )
    )
    client.initialized(types.InitializedParams())
