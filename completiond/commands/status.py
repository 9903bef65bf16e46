"""`completiond status`: what the running daemon serves and how it has done (never starts one)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from completiond.serving import paths
from completiond.serving.client import DaemonClient, DaemonUnavailable
from completiond.serving.wire import RemoteError

NOT_RUNNING = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runtime-dir", type=Path, help="daemon socket directory (default: $XDG_RUNTIME_DIR/completiond)")
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
    st = stats["status"]
    print(f"completiond daemon pid {st['pid']}: {st['state']}{' - ' + st['error'] if st.get('error') else ''}")
    print(f"  model    {st['model']} on {st['device']}")
    print(f"  clients  {stats.get('clients', 0) - 1} editor connection(s)")  # minus this command's own
    print(f"  uptime   {st['uptime_s']:.0f} s, {stats['requests']:.0f} requests, {stats['completed']:.0f} completed, "
          f"{stats['superseded']:.0f} superseded, {stats['cancelled']:.0f} cancelled, {stats['errors']:.0f} errors")
    if st.get("last_latency_ms") is not None:
        alpha = st.get("alpha")
        print(f"  last     {st['last_latency_ms']:.0f} ms" + (f", alpha {alpha:.2f}" if alpha is not None else "") +
              (f", {st['tokens_per_s']:.0f} tokens/s" if st.get("tokens_per_s") else ""))
    if stats.get("cache_served_fraction") is not None:
        print(f"  cache    {stats['cache_served_fraction']:.2f} of prompt tokens served from the KV cache")
    print(f"  socket   {paths.socket_path(directory)}")
    return 0


def run(args: argparse.Namespace) -> int:
    return with_running_daemon(args, lambda directory: _status(directory, args.json, args.timeout))


def with_running_daemon(args: argparse.Namespace, action) -> int:
    """Run `action(directory)` against the running daemon (never start one); its failures as exit codes."""
    directory = args.runtime_dir or paths.runtime_dir()
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
