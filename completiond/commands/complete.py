"""`completiond complete FILE:LINE:COL`: the suggestion for one cursor position in a real file.

LINE and COL are 1-based, as compilers print them; COL counts characters.
By default the model is loaded in this process (the bundled model unless
--model or config.toml says otherwise); --daemon asks the shared daemon
instead, starting it if needed, which is much faster for repeated calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from completiond import config as config_mod
from completiond.completion.documents import UTF32, line_starts, position_to_offset


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
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--multiline", choices=("auto", "always", "never"))
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--no-speculation", action="store_true", help="plain decoding (same output, slower)")
    parser.add_argument("--daemon", action="store_true", help="use the shared daemon (started if absent)")
    parser.add_argument("--config", type=Path, help="config.toml (default: ~/.config/completiond/config.toml)")
    parser.add_argument("--json", action="store_true", help="print a JSON object with the suggestion and stats")


def _config(args: argparse.Namespace) -> tuple[Any, list[str]]:
    cfg, errors = config_mod.load_file(args.config)
    cfg, more = config_mod.merge(cfg, {
        "model": args.model, "device": args.device, "dtype": args.dtype, "maxTokens": args.max_tokens,
        "multiline": args.multiline, "temperature": args.temperature,
        "speculation": False if args.no_speculation else None})
    return cfg, errors + more


def complete_in_process(cfg: Any, text: str, offset: int) -> dict[str, Any]:
    from completiond.completion.suggest import suggest
    from completiond.serving.service import load_engine
    from completiond.engine.engine import CancelToken

    t0 = time.perf_counter()
    engine = load_engine(cfg)
    load_ms = (time.perf_counter() - t0) * 1000
    t1 = time.perf_counter()
    suggestion, gen = suggest(engine, text, offset, cfg, cancel=CancelToken(), path=None)
    if gen is None:
        return {"suggestion": None, "finish_reason": "skipped", "stats": {}, "latency_ms": 0.0,
                "load_ms": round(load_ms, 1), "model": engine.model_id, "device": engine.device}
    latency = (time.perf_counter() - t1) * 1000
    return {
        "suggestion": None if suggestion is None else {"text": suggestion.text, "start": suggestion.start,
                                                       "end": suggestion.end, "multiline": suggestion.multiline},
        "finish_reason": gen.finish_reason, "stats": gen.stats.to_dict(), "latency_ms": round(latency, 2),
        "load_ms": round(load_ms, 1), "model": engine.model_id, "device": engine.device,
    }


async def complete_via_daemon(cfg: Any, path: Path, text: str, offset: int) -> dict[str, Any]:
    from completiond.serving.client import connect_or_spawn

    settings = config_mod.to_settings(cfg)
    client = await connect_or_spawn(settings, client_name="completiond-complete")
    try:
        if client.welcome.get("warning"):
            print(f"completiond: {client.welcome['warning']}", file=sys.stderr)
        uri = path.resolve().as_uri()
        client.notify("open", {"uri": uri, "version": 1, "text": text, "languageId": ""})
        t0 = time.perf_counter()
        result = await client.request("complete", {
            "uri": uri, "version": 1, "offset": offset,
            "settings": {k: v for k, v in settings.items() if k not in config_mod.ENGINE_KEYS}})
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
        parts.append(f"α {st['alpha']:.2f}")
    parts.append(f"{st.get('generated_tokens', 0)} tokens")
    if st.get("tokens_per_s"):
        parts.append(f"{st['tokens_per_s']:.0f} tokens/s")
    if st.get("prompt_tokens"):
        parts.append(f"prompt {st['prompt_tokens']} ({st.get('reused_tokens', 0)} cached)")
    parts.append(f"{result.get('model')} on {result.get('device')}")
    return " · ".join(parts)


def run(args: argparse.Namespace) -> int:
    try:
        path, line_no, col_no = parse_target(args.target)
        text = path.read_bytes().decode("utf-8")
        offset = cursor_offset(text, line_no, col_no)
    except TargetError as exc:
        print(f"completiond complete: {exc}", file=sys.stderr)
        return 2
    except (OSError, UnicodeDecodeError) as exc:
        print(f"completiond complete: cannot read {args.target.rsplit(':', 2)[0]}: {exc}", file=sys.stderr)
        return 2
    cfg, errors = _config(args)
    for error in errors:
        print(f"completiond: {error}", file=sys.stderr)
    try:
        if args.daemon:
            result = asyncio.run(complete_via_daemon(cfg, path, text, offset))
        else:
            result = complete_in_process(cfg, text, offset)
    except Exception as exc:  # the CLI's last line of defence: one clear line, not a traceback
        name = type(exc).__name__
        if name not in ("EngineError", "PromptError", "RemoteError", "DaemonUnavailable", "OSError",
                        "FileNotFoundError", "ValueError", "ConnectionLost"):
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
            print(f"(replaces {text[suggestion['start']:suggestion['end']]!r} after the cursor)", file=sys.stderr)
    print(_summary(result), file=sys.stderr)
    return 0
