"""`completiond complete FILE:LINE:COL`: the suggestion for one cursor position in a real file.

LINE and COL are 1-based, as compilers print them; COL counts characters.
By default the model is loaded in this process (the bundled model unless
--model or config.toml says otherwise); --daemon asks the shared daemon
instead, starting it if needed, which is much faster for repeated calls.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from completiond import config as config_mod
from completiond.completion.documents import UTF32, line_starts, position_to_offset
from completiond.config import Config


class TargetError(ValueError):
    pass


def parse_target(target: str) -> tuple[Path, int, int]:
    parts = target.rsplit(":", 2)
    if len(parts) != 3:
        raise TargetError(f"expected FILE:LINE:COL, got {target!r}")
    path, line, col = parts
    try:
        line_no, col_no = int(line), int(col)
    except ValueError:
        raise TargetError(f"LINE and COL must be numbers in {target!r}") from None
    if line_no < 1 or col_no < 1:
        raise TargetError(f"LINE and COL are 1-based, got {line_no}:{col_no}")
    return Path(path), line_no, col_no


def read_text(path: Path) -> str:
    """The file as UTF-8 text; TargetError saying plainly why not, for binary or other-encoded files."""
    data = path.read_bytes()
    if b"\0" in data[: 1 << 16]:
        raise TargetError(f"{path} is a binary file (it contains NUL bytes); completiond completes text files only")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise TargetError(
            f"{path} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line} cannot be "
            "decoded); completiond reads source files as UTF-8"
        ) from None


def cursor_offset(text: str, line_no: int, col_no: int) -> int:
    """Offset of 1-based LINE:COL in `text`; COL may be one past the end of the line."""
    starts = line_starts(text)
    if line_no > len(starts):
        raise TargetError(f"line {line_no} is past the end of the file ({len(starts)} lines)")
    start = starts[line_no - 1]
    end = position_to_offset(text, line_no - 1, 1 << 30, UTF32, starts)
    if start + col_no - 1 > end:
        raise TargetError(f"column {col_no} is past the end of line {line_no} ({end - start} characters)")
    return start + col_no - 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="FILE:LINE:COL", help="cursor position (1-based line and column)")
    parser.add_argument("--model", help="model directory or hub id (default: the bundled model)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "mps"))
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument(
        "--weights",
        choices=config_mod.SETTINGS_BY_KEY["weights"].enum,
        help="weight format of the native CPU step: auto, bf16 or int8 (default: the weights setting)",
    )
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--multiline", choices=("auto", "always", "never"))
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--no-speculation", action="store_true", help="plain decoding (same output, slower)")
    parser.add_argument("--daemon", action="store_true", help="use the shared daemon (started if absent)")
    parser.add_argument("--config", type=Path, help="config.toml (default: ~/.config/completiond/config.toml)")
    parser.add_argument("--json", action="store_true", help="print a JSON object with the suggestion and stats")


def _config(args: argparse.Namespace) -> tuple[Any, list[str]]:
    cfg, errors = config_mod.load_file(args.config)
    cfg, more = config_mod.merge(
        cfg,
        {
            "model": args.model,
            "device": args.device,
            "dtype": args.dtype,
            "weights": args.weights,
            "maxTokens": args.max_tokens,
            "multiline": args.multiline,
            "temperature": args.temperature,
            "speculation": False if args.no_speculation else None,
        },
    )
    return cfg, errors + more


class LoadReporter:
    """Load phases on stderr while the model loads: on a terminal one line rewritten in place, else
    one line per phase."""

    def __init__(self, model: str, stream=sys.stderr):
        self.model = config_mod.model_label(model)  # the one naming (completiond status, the editors)
        self.stream = stream
        self.tty = stream.isatty()
        self.t0 = time.perf_counter()
        self.last = ""

    def __call__(self, message: str, percentage: int) -> None:
        if message == self.last:
            return
        self.last = message
        line = f"completiond: loading {self.model}: {message} ({percentage}%, {time.perf_counter() - self.t0:.1f} s)"
        if self.tty:
            self.stream.write("\r\x1b[K" + line + ("\n" if percentage >= 100 else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def complete_in_process(cfg: Config, text: str, offset: int, path: str | None = None) -> dict[str, Any]:
    from completiond.completion.completer import suggest
    from completiond.engine.cancel import CancelToken
    from completiond.serving.lifecycle import LOAD_PHASES, load_completer
    from completiond.serving.service import language_unserved

    report = LoadReporter(cfg.model)
    report("starting", 0)  # before torch is imported, which alone takes seconds
    t0 = time.perf_counter()
    completer = load_completer(
        cfg,
        progress=lambda phase, pct, message=None: report(message or LOAD_PHASES[phase][1], pct),
        warn=lambda message: print(f"completiond: warning: {message}", file=sys.stderr),
    )
    load_ms = (time.perf_counter() - t0) * 1000
    unserved = language_unserved(completer, None, path)
    if unserved:  # as the daemon answers an editor: nothing, and why
        print(f"completiond: {unserved}", file=sys.stderr)
        return {
            "suggestion": None,
            "finish_reason": "language",
            "stats": {},
            "latency_ms": 0.0,
            "load_ms": round(load_ms, 1),
            "model": completer.name,
            "device": completer.device,
        }
    t1 = time.perf_counter()
    # the path names the language (the syntax check of the suggestion) as an editor's document would
    done = suggest(completer, text, offset, dataclasses.replace(cfg, alternatives=1), cancel=CancelToken(), path=path)
    described = {"load_ms": round(load_ms, 1), "model": completer.name, "device": completer.device}
    if done.skipped:
        return {"suggestion": None, "finish_reason": "skipped", "stats": {}, "latency_ms": 0.0, **described}
    latency = (time.perf_counter() - t1) * 1000
    suggestion = done.suggestion
    return {
        "suggestion": None
        if suggestion is None
        else {
            "text": suggestion.text,
            "start": suggestion.start,
            "end": suggestion.end,
            "multiline": suggestion.multiline,
        },
        "finish_reason": done.finish_reason,
        "stats": done.stats,
        "latency_ms": round(latency, 2),
        **described,
        **({"withheld": done.withheld} if done.withheld and suggestion is None else {}),
    }


async def complete_via_daemon(cfg: Config, path: Path, text: str, offset: int) -> dict[str, Any]:
    from completiond.serving.client import connect_or_spawn

    settings = config_mod.to_settings(cfg)
    report = LoadReporter(cfg.model)

    def on_notification(method: str, params: dict[str, Any]) -> None:
        progress = params.get("progress") if method == "status" and params.get("state") == "loading" else None
        if isinstance(progress, dict):
            report(str(progress.get("message")), int(progress.get("percentage") or 0))
        elif method == "status" and params.get("state") == "ready" and report.last:
            report("ready", 100)

    client = await connect_or_spawn(settings, client_name="completiond-complete", on_notification=on_notification)
    try:
        if client.welcome.get("warning"):
            print(f"completiond: {client.welcome['warning']}", file=sys.stderr)
        uri = path.resolve().as_uri()
        client.notify("open", {"uri": uri, "version": 1, "text": text, "languageId": ""})
        t0 = time.perf_counter()
        result = await client.request(
            "complete", {"uri": uri, "version": 1, "offset": offset, "settings": config_mod.request_settings(cfg)}
        )
        result["round_trip_ms"] = round((time.perf_counter() - t0) * 1000, 2)
        status = client.welcome.get("status", {})
        result["model"], result["device"] = status.get("model"), status.get("device")
        return result
    finally:
        await client.close()


def _summary(result: dict[str, Any]) -> str:
    st = result.get("stats") or {}
    parts = [f"latency {result['latency_ms']:.0f} ms"]
    if st.get("alpha") is not None and st.get("drafted"):
        parts.append(f"draft acceptance {st['alpha']:.2f} per token")
    parts.append(f"{st.get('generated_tokens', 0)} tokens")
    if st.get("tokens_per_s") and st.get("generated_tokens"):
        parts.append(f"{st['tokens_per_s']:.0f} tokens/s")
    if st.get("prompt_tokens"):
        parts.append(f"prompt {st['prompt_tokens']} ({st.get('reused_tokens', 0)} cached)")
    parts.append(f"{result.get('model')} on {result.get('device')}")
    return " · ".join(parts)


def run(args: argparse.Namespace) -> int:
    try:
        path, line_no, col_no = parse_target(args.target)
        text = read_text(path)
        offset = cursor_offset(text, line_no, col_no)
    except TargetError as exc:
        print(f"completiond complete: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"completiond complete: cannot read {args.target.rsplit(':', 2)[0]}: {exc}", file=sys.stderr)
        return 2
    cfg, errors = _config(args)
    for error in errors:
        print(f"completiond: {error}", file=sys.stderr)
    from completiond.serving.paths import daemon_unsupported
    from completiond.serving.lifecycle import missing_model

    # Both checks need no torch, which takes seconds to import: fail fast.
    problem = missing_model(cfg.model)
    if not problem and args.daemon and daemon_unsupported():
        problem = f"{daemon_unsupported()}; leave out --daemon to load the model in this process"
    if problem:
        print(f"completiond complete: {problem}", file=sys.stderr)
        return 2
    try:
        if args.daemon:
            result = asyncio.run(complete_via_daemon(cfg, path, text, offset))
        else:
            result = complete_in_process(cfg, text, offset, str(path))
    except Exception as exc:  # the CLI's last line of defence: one clear line, not a traceback
        name = type(exc).__name__
        if name not in (
            "EngineError",
            "PromptError",
            "RemoteError",
            "TeamServerError",
            "DaemonUnavailable",
            "OSError",
            "FileNotFoundError",
            "ValueError",
            "ConnectionLost",
        ):
            raise
        print(f"completiond complete: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    suggestion = result.get("suggestion")
    if suggestion is None:
        print("(no suggestion)", file=sys.stderr)
    else:
        print(suggestion["text"])
        if suggestion["end"] > suggestion["start"]:
            print(f"(replaces {text[suggestion['start'] : suggestion['end']]!r} after the cursor)", file=sys.stderr)
    print(_summary(result), file=sys.stderr)
    return 0
