"""The editing benchmark: the first suggestion after a jump, a file switch or an open, through the real editor path.

An LSP client (this process) drives a `completiond lsp` subprocess, which talks to its own daemon (in a
private runtime directory, as `bench --typing` does), the way an editor session goes:

  open        didOpen of a file, then a request 0.3 s later at a line end a third of the way in (7 code lines
              further each round)
  keystroke   a line retyped in place, a character per 100 ms (a didChange and a request each, the previous
              one cancelled when still unanswered, as editors do); the line's last request is awaited
  jump        the cursor moves to a line end at least 40 lines away and asks at once (no rest)
  jump_rest   the cursor moves there and rests a second before it asks; as our plugins do (editors/nvim rest.lua,
              vscode rest.ts), the client reports the rest with `completiond/cursorRest` PLUGIN_REST_S after
              the move (rest_notes=False: a plain LSP client, which sends none)
  switch      back to a file used in the last minute, at the cursor it was left at, after 0.3 s

Each file gets an open, a retyped line, `jumps` jumps, `jumps` rested jumps; then every file but the last is
switched back to, in order. `rounds` repeats the whole session (files closed and reopened; the daemon keeps
its caches). Every measured request is the only one in flight except during typing, and is timed from the
request sent to its answer received. With `maxTokens = 1` (the default here) a request costs the prompt's
prefill plus one step, so random weights of a real shape time exactly what a user waits for.

Reported, as JSON: per event kind p50 / p95 / max / count (ms, answered requests only) and the share of
prompt tokens served from the KV cache (from the daemon's counters around each measured request), the tokens
prefilled and the engine's time in them (`prefill_ms_per_token`: the daemon's prefill rate) and in the steps, the
requests answered from the daemon's last answers with no model run (`repeated_answers`: the same question asked
again, serving/results.py), the overall share, the daemon's RSS and KV cache bytes at the end, and what ran (model, weights, files). `memory` checks
issue 45's bound: the kept prefixes within cacheMegabytes (`cache_ok`), and the daemon's RSS within the weights
(their size on disk) + cacheMegabytes + MEMORY_SLACK_MB (`rss_ok`); `file_count=20` opens 20 files.

Default files: held-out third-party Python (modules of the installed pygls and watchdog packages, neither in
models/training/train_packages.txt), 4-40 kB each.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from completiond.commands.bench_typing import _percentile, _stop_daemon, initialize_bench_client, start_bench_client
from completiond.errors import CompletionError

EVENTS = ("open", "keystroke", "jump", "jump_rest", "switch")
MIN_JUMP_LINES = 40
OPEN_DELAY_S = 0.3
REST_S = 1.0
PLUGIN_REST_S = 0.3  # our plugins' delay before they report a resting cursor (rest.lua's delay_ms)
SWITCH_DELAY_S = 0.3
KEY_INTERVAL_S = 0.1
# Packages installed with completiond (pygls is the LSP's own dependency) and absent from the bundled
# model's training list: held-out third-party code on every machine that runs the LSP.
HELDOUT_PACKAGES = ("pygls", "watchdog", "lsprotocol")
# What the daemon may hold besides the weights and the KV cache budget (issue 45: with 20 files opened, RSS within
# weights + cacheMegabytes + this): the interpreter, torch, the tokenizer, the workspace index, the documents.
MEMORY_SLACK_MB = 300


def default_files(count: int = 4) -> list[Path]:
    """`count` held-out third-party Python files of 4-40 kB (deterministic: largest first, one package after
    another), from the installed packages of HELDOUT_PACKAGES that are not in the training list."""
    import importlib.util

    from completiond.models.training.data_prep import normalise, read_package_list

    trained = {normalise(name) for name, _ in read_package_list()}
    per_package: list[list[Path]] = []
    for name in HELDOUT_PACKAGES:
        if normalise(name) in trained:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        found = sorted(
            (p for p in root.rglob("*.py") if 4_000 <= p.stat().st_size <= 40_000),
            key=lambda p: (-p.stat().st_size, str(p)),
        )
        if found:
            per_package.append(found)
    files: list[Path] = []
    while len(files) < count and any(per_package):
        for found in per_package:
            if found and len(files) < count:
                files.append(found.pop(0))
    if not files:
        raise FileNotFoundError(f"none of {', '.join(HELDOUT_PACKAGES)} is installed with 4-40 kB modules; pass --file")
    return files


def code_lines(text: str) -> list[int]:
    """Lines a cursor may end on: some code on them, not a comment or a string's line."""
    return [
        i
        for i, line in enumerate(text.split("\n"))
        if len(line.strip()) >= 8 and not line.strip().startswith(("#", '"', "'"))
    ]


def far_line(candidates: list[int], current: int, rng: random.Random) -> int:
    """A candidate at least MIN_JUMP_LINES from `current` (the farthest when none is)."""
    far = [i for i in candidates if abs(i - current) >= MIN_JUMP_LINES]
    return rng.choice(far) if far else max(candidates, key=lambda i: abs(i - current))


SHAPE_PREFIX = "shape:"


def model_for(name: str | None, tmp: Path) -> tuple[str, str]:
    """(the model setting, its label): None = the bundled model; `shape:NAME` writes a model of random weights in
    bench-device's shape NAME (e.g. shape:qwen2.5-coder-0.5b, the real vocabulary) into `tmp`; anything else is
    passed on (a directory or hub id)."""
    if not name or name == "bundled":
        return "", "bundled"
    if name.startswith(SHAPE_PREFIX):
        shape = name[len(SHAPE_PREFIX) :]
        # A child process, as bench-device writes them (and the bench command never imports bench-device).
        code = (
            "import sys; from pathlib import Path; from completiond.commands.bench_device import random_model; "
            "random_model(sys.argv[1], Path(sys.argv[2]))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, shape, str(tmp / "model")], check=False, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise CompletionError(f"writing a random {shape} failed: {done.stderr.strip().splitlines()[-1:]}")
        return str(tmp / "model"), f"{shape} (random weights)"
    path = Path(name).expanduser()
    return (str(path.resolve()) if path.is_dir() else name), name


def shape_settings(name: str | None) -> dict[str, Any]:
    """Settings a `shape:` model needs to prompt as the real model does: its random weights come with the bundled
    tokenizer (whose own FIM layout is suffix-first), while a real Qwen2.5-Coder's tokenizer gives its prefix-first
    layout, which decides what a jump and a prefetch can reuse."""
    if name and name.startswith(SHAPE_PREFIX + "qwen2.5-coder"):
        return {"fimTemplate": "qwen2.5-coder"}
    return {}


class _Req:
    __slots__ = (
        "answered",
        "cancelled",
        "decode_ms",
        "engine_ms",
        "error",
        "event",
        "items",
        "prefill_ms",
        "prompt",
        "reduced",
        "repeated",
        "reused",
        "sent",
    )

    def __init__(self, event: str):
        self.event = event
        self.sent = time.perf_counter()
        self.answered: float | None = None
        self.cancelled = False
        self.error: str | None = None
        self.items = 0
        self.prompt = 0.0
        self.reused = 0.0
        self.engine_ms: float | None = None  # the daemon's own time for it (prompt, context, engine)
        self.prefill_ms = 0.0  # the engine's time in the prompt's uncached tokens
        self.decode_ms = 0.0  # and in the step(s) after them
        self.reduced = 0.0  # requests of it run on fewer threads than configured
        self.repeated = 0.0  # answered from the daemon's last answers (the same question asked again)

    @property
    def ms(self) -> float | None:
        return None if self.answered is None or self.cancelled or self.error else (self.answered - self.sent) * 1000


async def _session(
    model: str,
    files: list[Path],
    rounds: int,
    jumps: int,
    keystrokes: int,
    settings: dict[str, Any],
    runtime_dir: Path,
    timeout_s: float,
    seed: int,
    progress: Callable[[str], None] | None,
    lsp_command: list[str] | None,
    rest_notes: bool = True,
    rest_delay_s: float = PLUGIN_REST_S,
) -> dict[str, Any]:
    from lsprotocol import types
    from pygls.exceptions import JsonRpcException

    rng = random.Random(seed)
    folder = runtime_dir / "workspace"
    folder.mkdir(exist_ok=True)
    texts = {f: f.read_bytes().decode("utf-8") for f in files}
    # Copies under distinct names in one workspace folder: the files' own directories are not the editor's.
    uris = {}
    for i, f in enumerate(files):
        copy = folder / f"{i}_{f.parent.name}_{f.name}"
        copy.write_text(texts[f], encoding="utf-8")
        uris[f] = copy.as_uri()
    init = {"model": model, "maxTokens": 1, "multiline": "never", "idleTimeout": 60, **settings}
    client, messages = await start_bench_client("completiond-editing-bench", runtime_dir, lsp_command)
    requests: list[_Req] = []
    ids = iter(range(1, 1 << 30))
    versions: dict[Path, int] = {}

    async def stats() -> dict[str, Any]:
        result: Any = await asyncio.wait_for(
            client.workspace_execute_command_async(types.ExecuteCommandParams(command="completiond.stats")), 60
        )
        return result if isinstance(result, dict) else {}

    def send(event: str, f: Path, line: int, character: int) -> tuple[_Req, str, asyncio.Future]:
        req = _Req(event)
        msg_id = f"edit-{next(ids)}"
        params = types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri=uris[f]),
            position=types.Position(line, character),
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Automatic),
        )
        cf: Future = client.protocol.send_request(types.TEXT_DOCUMENT_INLINE_COMPLETION, params, msg_id=msg_id)
        fut = asyncio.wrap_future(cf)

        def done(fu: asyncio.Future) -> None:
            req.answered = time.perf_counter()
            exc = fu.exception()
            if isinstance(exc, JsonRpcException) and getattr(exc, "code", None) == -32800:
                req.cancelled = True
            elif exc is not None:
                req.error = f"{type(exc).__name__}: {exc}"
            else:
                result = fu.result()
                req.items = len(result.items) if result is not None and result.items else 0

        fut.add_done_callback(done)
        requests.append(req)
        return req, msg_id, fut

    def charge(req: _Req, before: dict[str, Any], after: dict[str, Any]) -> None:
        """The daemon's counters between `before` and `after`, charged to `req`."""

        def delta(name: str) -> float:
            return float(after.get(name) or 0) - float(before.get(name) or 0)

        req.prompt, req.reused = delta("prompt_tokens"), delta("reused_tokens")
        req.prefill_ms, req.decode_ms = delta("prefill_ms_sum"), delta("decode_ms_sum")
        req.reduced = delta("reduced_threads")
        req.repeated = delta("result_hits")

    async def measured(event: str, f: Path, line: int) -> None:
        """One request at the end of `line`, alone in flight, awaited; with the cache counters around it."""
        before = await stats()
        req, _, fut = send(event, f, line, _utf16_len(texts[f].split("\n")[line]))
        await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        after = await stats()
        charge(req, before, after)
        if float(after.get("completed") or 0) > float(before.get("completed") or 0):
            req.engine_ms = float(after.get("latency_ms_sum") or 0) - float(before.get("latency_ms_sum") or 0)

    def open_file(f: Path) -> None:
        versions[f] = versions.get(f, 0) + 1
        client.text_document_did_open(
            types.DidOpenTextDocumentParams(
                text_document=types.TextDocumentItem(
                    uri=uris[f], language_id="python", version=versions[f], text=texts[f]
                )
            )
        )

    def change(f: Path, text: str, partial: tuple[int, int, str] | None = None) -> None:
        versions[f] += 1
        if partial is None:
            changes: list[Any] = [types.TextDocumentContentChangeWholeDocument(text=text)]
        else:
            pos = types.Position(partial[0], partial[1])
            changes = [types.TextDocumentContentChangePartial(range=types.Range(start=pos, end=pos), text=partial[2])]
        client.text_document_did_change(
            types.DidChangeTextDocumentParams(
                text_document=types.VersionedTextDocumentIdentifier(uri=uris[f], version=versions[f]),
                content_changes=changes,
            )
        )

    async def retype(f: Path, li: int) -> None:
        """Line li retyped from its indentation, `keystrokes` characters at most; the file as it was after."""
        original = texts[f]
        lines = original.split("\n")
        line = lines[li]
        indent = line[: len(line) - len(line.lstrip())]
        typed_lines = list(lines)
        typed_lines[li] = indent
        change(f, "\n".join(typed_lines))
        col = _utf16_len(indent)
        before = await stats()
        pending: tuple[_Req, str, asyncio.Future] | None = None
        for ch in line[len(indent) :][:keystrokes]:
            change(f, "", (li, col, ch))
            col += _utf16_len(ch)
            if pending is not None and not pending[2].done():
                client.protocol.notify(types.CANCEL_REQUEST, types.CancelParams(id=pending[1]))
            pending = send("keystroke", f, li, col)
            await asyncio.sleep(KEY_INTERVAL_S)
        if pending is not None:
            await asyncio.wait_for(asyncio.shield(pending[2]), timeout_s)
            after = await stats()
            # The line's keystrokes together (their requests overlap): the counters are charged to the last one.
            charge(pending[0], before, after)
        change(f, original)  # back to the file as it is, so later positions hold

    cursor: dict[Path, int] = {}
    try:
        await initialize_bench_client(client, folder, init)
        deadline = time.monotonic() + timeout_s
        warm = runtime_dir / "warm.py"
        warm.write_text("import os\n\n\ndef main():\n    return os\n", encoding="utf-8")
        client.text_document_did_open(
            types.DidOpenTextDocumentParams(
                text_document=types.TextDocumentItem(
                    uri=warm.as_uri(), language_id="python", version=1, text=warm.read_text()
                )
            )
        )
        while True:  # the daemon loads the model: wait, then one unmeasured request in a file of its own
            st = (await stats()).get("status") or {}
            if st.get("state") in ("ready", "busy"):
                break
            if st.get("state") == "error":
                raise RuntimeError(f"daemon failed: {st.get('error')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon not ready within {timeout_s:g} s: {st or messages}")
            await asyncio.sleep(0.2)
        while True:  # the workspace folder's scan, before anything is timed
            index = (await stats()).get("index") or {}
            if not index.get("scanning") or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        uris[warm] = warm.as_uri()
        _, _, fut = send("warm-up", warm, 4, 13)
        await asyncio.wait_for(fut, timeout_s)
        requests.clear()
        first = await stats()

        for r in range(rounds):
            for n, f in enumerate(files):
                if time.monotonic() > deadline:
                    break
                candidates = code_lines(texts[f])
                if not candidates:
                    continue
                open_file(f)
                await asyncio.sleep(OPEN_DELAY_S)
                # a line of its own each round: a reopened file asked at the same cursor is answered from the
                # daemon's last answers (switch measures that), and an open is to time the prompt
                line = candidates[(len(candidates) // 3 + 7 * r) % len(candidates)]
                await measured("open", f, line)
                await retype(f, line)
                for _ in range(jumps):
                    line = far_line(candidates, line, rng)
                    await measured("jump", f, line)
                for _ in range(jumps):
                    line = far_line(candidates, line, rng)  # the cursor moves there, then rests
                    if rest_notes:
                        await asyncio.sleep(rest_delay_s)
                        position = {"line": line, "character": _utf16_len(texts[f].split("\n")[line])}
                        client.protocol.notify(
                            "completiond/cursorRest", {"textDocument": {"uri": uris[f]}, "position": position}
                        )
                        await asyncio.sleep(REST_S - rest_delay_s)
                    else:
                        await asyncio.sleep(REST_S)
                    await measured("jump_rest", f, line)
                cursor[f] = line
                if progress is not None:
                    progress(f"round {r + 1}/{rounds}, file {n + 1}/{len(files)}: {f.name}")
            for f in files[:-1]:
                if f in cursor and time.monotonic() <= deadline:
                    await asyncio.sleep(SWITCH_DELAY_S)
                    await measured("switch", f, cursor[f])
            if r + 1 < rounds:
                for f in files:
                    client.text_document_did_close(
                        types.DidCloseTextDocumentParams(text_document=types.TextDocumentIdentifier(uri=uris[f]))
                    )
        outstanding = [q for q in requests if q.answered is None]
        for _ in range(int(30 / 0.05)):
            if all(q.answered is not None for q in outstanding):
                break
            await asyncio.sleep(0.05)
        last = await stats()
    finally:
        try:
            await asyncio.wait_for(client.shutdown_async(None), 10)
            client.exit(None)
        except (asyncio.TimeoutError, JsonRpcException, RuntimeError, ConnectionError):
            pass
        await client.stop()

    events: dict[str, Any] = {}
    for kind in EVENTS:
        mine = [q for q in requests if q.event == kind]
        times = [q.ms for q in mine if q.ms is not None]
        prompt = sum(q.prompt for q in mine)
        daemon = [q.engine_ms for q in mine if q.engine_ms is not None]
        prefilled = sum(q.prompt - q.reused for q in mine)
        events[kind] = {
            "p50_ms": _round(_percentile(times, 0.5)),
            "p95_ms": _round(_percentile(times, 0.95)),
            "max_ms": _round(max(times) if times else None),
            "count": len(times),
            "daemon_p50_ms": _round(_percentile(daemon, 0.5)),
            "cache_served_fraction": _round(sum(q.reused for q in mine) / prompt, 3) if prompt else None,
            # Where the wait goes, from the daemon's counters (a keystroke's: its whole line's requests, superseded
            # ones included): tokens prefilled (not from the cache) and the engine's time in them and in the steps.
            "prefilled_tokens": _round(prefilled, 0),
            "prefill_ms": _round(sum(q.prefill_ms for q in mine)),
            "prefill_ms_per_token": _round(sum(q.prefill_ms for q in mine) / prefilled, 3) if prefilled else None,
            "decode_ms": _round(sum(q.decode_ms for q in mine)),
            # requests the daemon ran on fewer threads than configured (others wanted the cores)
            "reduced_threads": _round(sum(q.reduced for q in mine), 0),
            # answered from the daemon's last answers (serving/results.py), with no prompt and no model run
            "repeated_answers": _round(sum(q.repeated for q in mine), 0),
        }
    prompt_all = float(last.get("prompt_tokens") or 0) - float(first.get("prompt_tokens") or 0)
    reused_all = float(last.get("reused_tokens") or 0) - float(first.get("reused_tokens") or 0)
    status = last.get("status") or {}
    return {
        "events": events,
        "cache_served_fraction": _round(reused_all / prompt_all, 3) if prompt_all else None,
        "requests": len(requests),
        "responses": sum(1 for q in requests if q.answered is not None),
        "cancelled_responses": sum(1 for q in requests if q.cancelled),
        "with_suggestion": sum(1 for q in requests if q.items),
        "errors": [q.error for q in requests if q.error][:5],
        "kv_cache": last.get("kv_cache"),
        "prefetch": last.get("prefetch"),
        "model": status.get("model"),
        "decode_step": status.get("decode_step"),
        "device": status.get("device"),
        "files": [str(f) for f in files],
        "rounds": rounds,
        "messages": messages,
    }


def _utf16_len(s: str) -> int:
    return len(s.encode("utf-16-le")) // 2


def _round(v: float | None, digits: int = 1) -> float | None:
    return None if v is None else round(v, digits)


def _daemon_rss_mb(xdg_dir: Path) -> float | None:
    from completiond.serving import paths

    try:
        pid = int((xdg_dir / "completiond" / paths.PID_NAME).read_text())
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError):
        pass
    return None


def weights_mb(model_setting: str) -> float | None:
    """The model's weight files on disk, MiB (the bundled model for ''); None where they are not a local folder."""
    if model_setting:
        folder = Path(model_setting)
    else:
        from completiond.models import default_model_dir

        folder = default_model_dir()
    if not folder.is_dir():
        return None
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors")) or sum(
        p.stat().st_size for p in folder.glob("*.bin")
    )
    return round(size / 2**20, 1) if size else None


def memory_check(rss_mb: float | None, weights: float | None, kv_cache: dict[str, Any] | None) -> dict[str, Any]:
    """Issue 45's memory bound on the session's end state: the KV cache's kept prefixes within its budget
    (cacheMegabytes), and the daemon's RSS within weights + that budget + MEMORY_SLACK_MB. A check that cannot be
    made (no RSS, weights not on disk) is None, never a pass."""
    cache = kv_cache or {}
    budget = cache.get("budget_bytes")
    held = cache.get("bytes")
    budget_mb = round(budget / 2**20, 1) if isinstance(budget, (int, float)) else None
    bound = round(weights + budget_mb + MEMORY_SLACK_MB, 1) if weights is not None and budget_mb is not None else None
    return {
        "rss_mb": rss_mb,
        "weights_mb": weights,
        "cache_mb": round(held / 2**20, 1) if isinstance(held, (int, float)) else None,
        "cache_budget_mb": budget_mb,
        "bound_mb": bound,
        "cache_ok": None if budget is None or held is None else held <= budget,
        "rss_ok": None if rss_mb is None or bound is None else rss_mb <= bound,
    }


def run_editing_bench(
    model: str | None = None,
    files: list[Path] | None = None,
    *,
    file_count: int = 4,
    rounds: int = 2,
    jumps: int = 3,
    keystrokes: int = 8,
    weights: str | None = None,
    threads: int | None = None,
    settings: dict[str, Any] | None = None,
    timeout_s: float = 1800.0,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    lsp_command: list[str] | None = None,
    prefetch: bool | None = None,
    rest_notes: bool = True,
    rest_delay_s: float = PLUGIN_REST_S,
) -> dict[str, Any]:
    """Run the editing benchmark; see the module docstring for what it does and reports.

    model: None / "bundled", a model directory, a hub id, or `shape:` and a bench-device shape (random weights,
    e.g. shape:qwen2.5-coder-0.5b, prompted in the real model's layout: shape_settings). file_count: how many
    default files when `files` is not given. weights: the weights setting (auto, bf16, int8). threads: COMPLETIOND_THREADS for the
    daemon. settings: more editor settings (camelCase, as in initializationOptions). prefetch: False runs the daemon
    without its background warm-ups (COMPLETIOND_PREFETCH=0: what they bring); None leaves the daemon's default.
    rest_notes: report the rested cursor before jump_rest's request as our plugins do (False: a plain LSP client),
    rest_delay_s after the move (the plugins' delay by default; a shorter one gives the warm-up more of the rest)."""
    if not 0 <= rest_delay_s <= REST_S:
        raise ValueError(f"the rest note's delay must be within the rest (0-{REST_S} s), not {rest_delay_s}")
    files = [Path(f) for f in files] if files else default_files(file_count)
    base = Path(tempfile.mkdtemp(prefix="completiond-editing-"))
    # The daemon inherits these through the LSP.
    env = {
        "COMPLETIOND_THREADS": str(threads) if threads else None,
        "COMPLETIOND_PREFETCH": None if prefetch is None else str(int(prefetch)),
    }
    saved = {name: os.environ.get(name) for name, value in env.items() if value is not None}
    try:
        os.environ.update({name: value for name, value in env.items() if value is not None})
        model_setting, label = model_for(model, base)
        extra = {**shape_settings(model), **(settings or {})}
        if weights:
            extra["weights"] = weights
        result = asyncio.run(
            _session(
                model_setting,
                files,
                rounds,
                jumps,
                keystrokes,
                extra,
                base,
                timeout_s,
                seed,
                progress,
                lsp_command,
                rest_notes,
                rest_delay_s,
            )
        )
        result["daemon_rss_mb"] = _daemon_rss_mb(base)
        result["memory"] = memory_check(result["daemon_rss_mb"], weights_mb(model_setting), result.get("kv_cache"))
        result.update(
            model_label=label,
            weights=weights or "auto",
            threads=threads,
            settings=extra,
            prefetch_setting="default" if prefetch is None else ("on" if prefetch else "off"),
            rest_notes=rest_notes,
            rest_delay_ms=round(1000 * rest_delay_s),
        )
        return result
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
        _stop_daemon(base)
        shutil.rmtree(base, ignore_errors=True)
