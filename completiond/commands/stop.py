"""`completiond stop`: stop the running daemon and wait until its socket is gone (never starts one)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from completiond.commands.status import connect, with_running_daemon
from completiond.serving import paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runtime-dir", type=Path, help="daemon socket directory (default: $XDG_RUNTIME_DIR/completiond)"
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the daemon to stop")


async def _stop(directory: Path, timeout: float) -> int:
    client = await connect(directory)
    try:
        reply = await client.request("stop", {}, timeout=timeout)
    finally:
        await client.close()
    socket = paths.socket_path(directory)
    deadline = time.monotonic() + timeout
    while socket.exists() and time.monotonic() < deadline:  # noqa: ASYNC110 (another process removes it: no event)
        await asyncio.sleep(0.05)
    if socket.exists():
        print(f"daemon pid {reply.get('pid')} did not stop within {timeout:g} s", file=sys.stderr)
        return 1
    print(f"stopped daemon pid {reply.get('pid')}")
    return 0


def run(args: argparse.Namespace) -> int:
    return with_running_daemon(args, lambda directory: _stop(directory, args.timeout))
