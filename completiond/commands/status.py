"""`completiond status`: what the running daemon serves and how it has done (never starts one)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from completiond.serving import paths
from completiond.serving.client import DaemonClient, DaemonUnavailable
from completiond.serving.wire import RemoteError

NOT_RUNNING = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runtime-dir", type=Path, help="daemon socket directory (default: $XDG_RUNTIME_DIR/completiond)"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the daemon")


async def connect(directory: Path) -> DaemonClient:
    paths.check_private_dir(directory)
    socket = paths.socket_path(directory)
    try:
        return await DaemonClient.connect(socket, "completiond-control", {})
    except (FileNotFoundError, ConnectionRefusedError):
        raise DaemonUnavailable(f"no completiond daemon is running (no socket at {socket})") from None


async def _status(directory: Path, as_json: bool, timeout: float) -> int:
    client = await connect(directory)
    try:
        stats = await client.request("stats", {}, timeout=timeout)
    finally:
        await client.close()
    if as_json:
        print(json.dumps(stats, indent=2, default=str))
        return 0
    print("\n".join(describe(stats, directory)))
    return 0


def describe(stats: dict[str, Any], directory: Path) -> list[str]:
    """The human-readable status: what the daemon serves, for whom, and how its suggestions fared."""
    st = stats["status"]
    lines = [f"completiond daemon pid {st['pid']}: {st['state']}{' - ' + st['error'] if st.get('error') else ''}"]
    progress = st.get("progress")
    if st["state"] == "loading" and isinstance(progress, dict):
        lines.append(f"  loading  {progress.get('message')} ({progress.get('percentage')}%)")
    device = st["device"]
    if st["state"] in ("starting", "loading") and device == "auto":
        device = "the device auto picks once loaded"  # not a device's name: none is chosen yet
    lines.append(f"  model    {st['model']} on {device}")
    for warning in st.get("warnings") or []:
        lines.append(f"  warning  {warning}")
    calibration = st.get("calibration")
    if isinstance(calibration, dict) and calibration.get("message"):
        lines.append(f"  calibration  {calibration['message']}")
    index = stats.get("index")
    if isinstance(index, dict):  # the retrieval index, built in the background: its progress
        scanning = (
            f", scanning ({index.get('loaded', 0)} of {index.get('found', 0)} files read)"
            if index.get("scanning")
            else ""
        )
        lines.append(f"  context  index of {index.get('files', 0)} files, {index.get('chunks', 0)} chunks{scanning}")
    editors = stats.get("editors", 0)
    others = stats.get("clients", 0) - editors - 1  # minus this command's own connection
    lines.append(
        f"  clients  {editors} editor connection(s)" + (f", {others} other (command line)" if others > 0 else "")
    )
    lines.append(
        f"  uptime   {st['uptime_s']:.0f} s, {stats['requests']:.0f} requests, {stats['completed']:.0f} completed, "
        f"{stats['superseded']:.0f} superseded, {stats['cancelled']:.0f} cancelled, {stats['errors']:.0f} errors"
    )
    if stats.get("withheld_syntax"):
        lines.append(
            f"  syntax   {stats['withheld_syntax']:.0f} suggestions withheld by the syntax check "
            f"(of {stats.get('empty', 0):.0f} requests with none shown)"
        )
    counts = st.get("suggestions") or {}
    accepted = sum(counts.get(k, 0) for k in ("accepted_full", "accepted_word", "accepted_line"))
    lines.append(
        f"  editors  {counts.get('shown', 0)} suggestions shown, {accepted} accepted "
        f"({counts.get('accepted_full', 0)} whole, {counts.get('accepted_word', 0)} by word, "
        f"{counts.get('accepted_line', 0)} by line), {counts.get('dismissed', 0)} dismissed"
    )
    if st.get("last_latency_ms") is not None:
        last = [f"{st['last_latency_ms']:.0f} ms"]
        if st.get("draft_acceptance") is not None:
            last.append(f"draft acceptance {st['draft_acceptance']:.2f} per token")
        if st.get("tokens_per_s") is not None:
            last.append(f"{st['tokens_per_s']:.0f} tokens/s while decoding")
        lines.append("  last     " + ", ".join(last))
    if st.get("decode_step"):
        lines.append(f"  step     {st['decode_step']}")
    if st.get("tokenizer"):
        lines.append(f"  tokens   {st['tokenizer']}")
    if st.get("draft"):
        lines.append(
            f"  draft    {st['draft']}" + (f" (last request: {st['last_draft']})" if st.get("last_draft") else "")
        )
    if stats.get("draft_acceptance") is not None:
        lines.append(
            f"  drafts   {stats['draft_acceptance']:.2f} of draft tokens accepted (per token, all requests)"
            + (
                f"; {stats['history_accepted']:.0f} of them from earlier suggestions' text"
                if stats.get("history_accepted")
                else ""
            )
        )
    if stats.get("cache_served_fraction") is not None:
        lines.append(f"  cache    {stats['cache_served_fraction']:.2f} of prompt tokens served from the KV cache")
    lines.append(f"  socket   {paths.socket_path(directory)}")
    return lines


def run(args: argparse.Namespace) -> int:
    return with_running_daemon(args, lambda directory: _status(directory, args.json, args.timeout))


def with_running_daemon(args: argparse.Namespace, action) -> int:
    """Run `action(directory)` against the running daemon (never start one); its failures as exit codes."""
    unsupported = paths.daemon_unsupported()
    if unsupported:
        print(
            f"no completiond daemon on this platform: {unsupported}; editors run the model in their language "
            "server (`completiond lsp --no-daemon`)",
            file=sys.stderr,
        )
        return NOT_RUNNING
    directory = args.runtime_dir or paths.current_runtime_dir()
    try:
        return asyncio.run(action(directory))
    except paths.InsecureDirectoryError as exc:
        if "does not exist" in str(exc):
            print(f"no completiond daemon is running ({directory} does not exist)", file=sys.stderr)
            return NOT_RUNNING
        print(f"completiond: {exc}", file=sys.stderr)
        return 2
    except DaemonUnavailable as exc:
        print(str(exc), file=sys.stderr)
        return NOT_RUNNING
    except (RemoteError, ConnectionError, asyncio.TimeoutError) as exc:
        print(f"completiond: the daemon did not answer: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
