"""Servers for the team-backend tests: a stdlib HTTP server that misbehaves on purpose (each failure a
completion server can show), and llama.cpp's real `llama-server` serving the bundled model as GGUF.
Both listen on 127.0.0.1 only."""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from completiond.backends.llama_server import LlamaServer, free_port  # noqa: F401  (the tests' servers)


class Misbehaving:
    """What the next requests get. `mode`: stream | status | malformed | stall | die | json."""

    def __init__(self):
        self.mode = "stream"
        self.pieces: list[str] = ["hello", " world"]
        self.status = 500
        self.body = b'{"error": {"message": "boom"}}'
        self.headers: dict[str, str] = {}
        self.requests: list[dict] = []        # {"path", "headers", "body"} per request
        self.client_closed = threading.Event()  # a handler saw the client hang up mid-stream
        self.release = threading.Event()       # ends a stall
        self.interim = 0                       # interim `100 Continue` heads sent before the response
        self.echo_auth = False                 # mode status: the body repeats the Authorization header (a 401 page)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet test output
        pass

    def handle(self):
        try:
            super().handle()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client hung up on purpose (a cancel, a refused response): nothing to report

    def do_POST(self):  # noqa: N802 (the stdlib's name)
        plan: Misbehaving = self.server.plan  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        plan.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
        if plan.interim:
            try:
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n" * plan.interim)
            except (BrokenPipeError, ConnectionResetError):
                return
        if plan.mode == "status":
            payload = plan.body
            if plan.echo_auth:
                echoed = self.headers.get("Authorization", "")
                payload = json.dumps({"error": {"message": f"invalid credentials: got header Authorization: {echoed}"
                                                           f" ({'x' * 150} {echoed})"}}).encode()
            self.send_response(plan.status)
            for k, v in plan.headers.items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        if plan.mode == "json":
            data = json.dumps({"choices": [{"text": "".join(plan.pieces), "finish_reason": "stop"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if plan.mode == "malformed":
            self._chunk(b"data: {not json\n\n")
            self._chunk(b"")
            return
        infill = self.path.endswith("/infill")
        for piece in plan.pieces:
            event = {"content": piece, "stop": False} if infill else {"choices": [{"text": piece, "finish_reason": None}]}
            self._chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
        if plan.mode == "die":
            self.connection.shutdown(socket.SHUT_RDWR)  # no terminating chunk: the stream breaks off
            return
        if plan.mode == "stall":
            # Bounded: the test releases it, or the client hangs up (which is what cancelling must do).
            for _ in range(400):
                if plan.release.is_set():
                    break
                ready, _, _ = select.select([self.connection], [], [], 0.025)
                if ready and not self.connection.recv(1, socket.MSG_PEEK):
                    plan.client_closed.set()
                    return
            return
        last = {"content": "", "stop": True} if infill else {"choices": [{"text": "", "finish_reason": "stop"}]}
        self._chunk(b"data: " + json.dumps(last).encode() + b"\n\n")
        if not infill:
            self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        try:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.server.plan.client_closed.set()  # type: ignore[attr-defined]


class FakeServer:
    def __init__(self):
        self.plan = Misbehaving()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.plan = self.plan  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.plan.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


# --- llama.cpp's server ------------------------------------------------------------------------------

BUILD_WAIT_S = 40 * 60


def llama_server_binary() -> tuple[str | None, str]:
    """(path or None, why not). COMPLETIOND_LLAMA_SERVER, else the build .ci/run started in the background
    (COMPLETIOND_LLAMA_SERVER_BUILD: a folder that gets `rc`, `path` and `log`; it builds while the rest
    of the suite runs, so these tests wait for it), else llama-server on PATH."""
    path = os.environ.get("COMPLETIOND_LLAMA_SERVER")
    build = os.environ.get("COMPLETIOND_LLAMA_SERVER_BUILD")
    if not path and build:
        folder = Path(build)
        for _ in range(BUILD_WAIT_S):
            if (folder / "rc").is_file():
                break
            time.sleep(1)
        else:
            return None, f"the llama-server build in {folder} did not finish in {BUILD_WAIT_S // 60} minutes"
        rc = (folder / "rc").read_text().strip()
        if rc != "0":
            log = (folder / "log").read_text(errors="replace")[-3000:] if (folder / "log").is_file() else ""
            return None, f"the llama-server build failed (exit {rc}):\n{log}"
        path = (folder / "path").read_text().strip()
    path = path or shutil.which("llama-server")
    if path and os.access(path, os.X_OK):
        return path, ""
    return None, ("llama.cpp's llama-server not found: run `bash .ci/llama_server.sh` and set "
                  "COMPLETIOND_LLAMA_SERVER to the path it prints")


def need_llama_server() -> str:
    """The binary, or a skip outside CI; in CI (CI=true) its absence fails the test: .ci/run builds it."""
    binary, message = llama_server_binary()
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return binary
