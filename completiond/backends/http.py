"""A small HTTP/1.1 client for one streamed POST, on the standard library only.

Why not http.client: a streamed completion must let go within milliseconds when the user types on
(the request is superseded), and must notice a server that stops sending. http.client reads through a
buffered file whose state is undefined after a read timeout, so it can neither be polled for a cancel
flag nor resumed. Here every wait on the socket lasts at most `POLL_S`, the cancel flag is checked in
between, and `stall_s` without a byte ends the request with a timeout. Closing the socket is how the
server learns that a superseded request's stream is no longer wanted (vLLM, llama.cpp and TGI all
abort the generation when the client disconnects).

One request per connection (`Connection: close`): a cancelled stream cannot be reused anyway, and a
completion's cost is the generation, not the handshake.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any, Iterator
from urllib.parse import urlsplit

POLL_S = 0.02  # longest wait on the socket between two looks at the cancel flag
MAX_HEADER_BYTES = 64 * 1024
MAX_ERROR_BODY = 16 * 1024
MAX_INTERIM = 8  # interim (1xx) heads skipped before the final one; a server sending more is broken


class HttpFailure(Exception):
    """The exchange failed below HTTP semantics. `kind`: refused | timeout | tls | network | protocol."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


class Cancelled(Exception):
    """The caller's cancel flag was set while waiting on the server."""


@dataclass(frozen=True)
class Endpoint:
    scheme: str
    host: str
    port: int
    base_path: str  # without a trailing slash

    @classmethod
    def parse(cls, url: str) -> "Endpoint":
        """ValueError with the reason unless `url` is an http(s) URL with a host."""
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"expected an http:// or https:// URL, got {url!r}")
        if not parts.hostname:
            raise ValueError(f"no host in {url!r}")
        if parts.username or parts.password:
            raise ValueError(
                "credentials in the URL are not accepted (they would be stored in settings); "
                "use apiKeyEnv or apiKeyFile"
            )
        if parts.query or parts.fragment:
            raise ValueError(f"{url!r}: give the server's base URL, without a query or fragment")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:
            raise ValueError(f"{url!r}: {exc}") from None
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

    def url(self, path: str = "") -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        netloc = host if self.port == default else f"{host}:{self.port}"
        return f"{self.scheme}://{netloc}{self.base_path}{path}"


class Response:
    """A response being read: status and headers first, then the body as it arrives."""

    def __init__(self, sock: socket.socket, cancel: Any, stall_s: float, deadline: float):
        self._sock = sock
        self._cancel = cancel
        self._stall_s = stall_s
        self._deadline = deadline
        self._buf = bytearray()
        self._eof = False
        self.status = 0
        self.reason = ""
        self.headers: dict[str, str] = {}

    # -- raw bytes --------------------------------------------------------------------------
    def _fill(self) -> bool:
        """Read what the socket has into the buffer; False at EOF. Raises Cancelled / HttpFailure."""
        if self._eof:
            return False
        started = time.monotonic()
        while True:
            if self._cancel is not None and self._cancel.cancelled:
                raise Cancelled()
            now = time.monotonic()
            if now >= self._deadline:
                raise HttpFailure("timeout", "the response did not finish in time")
            # TLS may hold decrypted bytes that select() cannot see.
            pending = isinstance(self._sock, ssl.SSLSocket) and self._sock.pending()
            if not pending:
                ready, _, _ = select.select([self._sock], [], [], min(POLL_S, self._deadline - now))
                if not ready:
                    if time.monotonic() - started >= self._stall_s:
                        raise HttpFailure("timeout", f"no data from the server for {self._stall_s:g} s")
                    continue
            try:
                data = self._sock.recv(65536)
            except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
                continue
            except ssl.SSLError as exc:
                raise HttpFailure("tls", str(exc)) from None
            except OSError as exc:
                raise HttpFailure("network", f"connection lost: {exc.strerror or exc}") from None
            if not data:
                self._eof = True
                return False
            self._buf += data
            return True

    def _read_line(self, limit: int) -> bytes:
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                line = bytes(self._buf[: nl + 1])
                del self._buf[: nl + 1]
                return line
            if len(self._buf) > limit:
                raise HttpFailure("protocol", "line too long in the response")
            if not self._fill():
                raise HttpFailure("protocol", "the server closed the connection in the middle of a response")

    def _read_exact(self, n: int) -> bytes:
        while len(self._buf) < n:
            if not self._fill():
                raise HttpFailure("protocol", "the server closed the connection in the middle of a response")
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    # -- HTTP -------------------------------------------------------------------------------
    def read_head(self) -> None:
        """The status line and headers of the final response. Interim heads (1xx: a Continue we did not
        ask for, Early Hints) are skipped, at most MAX_INTERIM of them: a loop, not recursion, and a
        bound, so a server streaming `100 Continue` forever ends in HttpFailure("protocol")."""
        for _ in range(MAX_INTERIM + 1):
            self._read_one_head()
            if not (100 <= self.status < 200) or self.status == 101:
                return
            self.headers.clear()
        raise HttpFailure("protocol", f"more than {MAX_INTERIM} interim (1xx) responses before the real one")

    def _read_one_head(self) -> None:
        line = self._read_line(MAX_HEADER_BYTES).decode("latin-1").strip()
        parts = line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HttpFailure("protocol", f"not an HTTP response: {line[:80]!r}")
        self.status, self.reason = int(parts[1]), parts[2] if len(parts) > 2 else ""
        size = 0
        while True:
            raw = self._read_line(MAX_HEADER_BYTES)
            size += len(raw)
            if size > MAX_HEADER_BYTES:
                raise HttpFailure("protocol", "response headers too large")
            text = raw.decode("latin-1").strip()
            if not text:
                break
            name, sep, value = text.partition(":")
            if sep:
                self.headers[name.strip().lower()] = value.strip()

    def chunks(self) -> Iterator[bytes]:
        """The body as it arrives (chunked, sized, or up to the close)."""
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size_line = self._read_line(1024).split(b";", 1)[0].strip()
                try:
                    size = int(size_line, 16)
                except ValueError:
                    raise HttpFailure("protocol", f"bad chunk size {size_line[:20]!r}") from None
                if size == 0:
                    return
                yield self._read_exact(size)
                self._read_exact(2)  # the CRLF after each chunk
        length = self.headers.get("content-length")
        if length is not None and length.isdigit():
            left = int(length)
            while left > 0:
                if not self._buf and not self._fill():
                    raise HttpFailure("protocol", "the server closed the connection before the end of the body")
                piece = bytes(self._buf[:left])
                del self._buf[: len(piece)]
                left -= len(piece)
                yield piece
            return
        while True:
            if self._buf:
                piece = bytes(self._buf)
                self._buf.clear()
                yield piece
            if not self._fill():
                return

    def read_body(self, limit: int = MAX_ERROR_BODY) -> bytes:
        out = bytearray()
        for piece in self.chunks():
            out += piece
            if len(out) >= limit:
                break
        return bytes(out[:limit])

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine, so that traffic to it never leaves it: a literal loopback address
    (127.0.0.0/8, ::1) or the name `localhost` itself. No other name counts, `*.localhost` and
    `localhost.localdomain` included: where those resolve is up to the resolver (DNS may answer for them),
    and an API key must not go over plain http to wherever that is."""
    import ipaddress

    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def post(
    endpoint: Endpoint,
    path: str,
    body: bytes,
    headers: dict[str, str],
    *,
    cancel: Any,
    connect_s: float,
    stall_s: float,
    total_s: float,
    tls: ssl.SSLContext | None,
) -> Response:
    """Send one POST and read the response head; the caller reads the body and must close() it.

    Every wait (connect, TLS handshake, send, response) is polled for the cancel flag: a superseded
    request never holds the worker while the next keystroke waits. Raises HttpFailure (with the kind
    of failure) or Cancelled.
    """
    deadline = time.monotonic() + total_s
    sock = _connect(endpoint, min(connect_s, total_s), cancel)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if endpoint.scheme == "https":
            sock = _handshake(sock, tls or ssl.create_default_context(), endpoint.host, connect_s, cancel)
        host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
        head = [
            f"POST {endpoint.base_path}{path} HTTP/1.1",
            f"Host: {host}:{endpoint.port}",
            "Connection: close",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
        ]
        head += [f"{k}: {v}" for k, v in headers.items()]
        _send_all(sock, ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body, connect_s, cancel)
        response = Response(sock, cancel, stall_s, deadline)
        response.read_head()
        return response
    except BaseException:
        try:
            sock.close()
        except OSError:
            pass
        raise


def _wait(sock: socket.socket, write: bool, until: float, cancel: Any, what: str) -> None:
    """Wait until `sock` is readable (or writable), polling `cancel`; HttpFailure("timeout") at `until`."""
    while True:
        if cancel is not None and cancel.cancelled:
            raise Cancelled()
        left = until - time.monotonic()
        if left <= 0:
            raise HttpFailure("timeout", what)
        r, w, _ = select.select([] if write else [sock], [sock] if write else [], [], min(POLL_S, left))
        if r or w:
            return


def _connect(endpoint: Endpoint, connect_s: float, cancel: Any) -> socket.socket:
    until = time.monotonic() + connect_s
    try:
        infos = socket.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise HttpFailure("network", f"cannot resolve {endpoint.host}: {exc.strerror or exc}") from None
    failure = HttpFailure("network", f"no address for {endpoint.host}")
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            code = sock.connect_ex(address)
            if code not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
                raise OSError(code, os.strerror(code))
            if code:
                _wait(sock, True, until, cancel, f"no connection within {connect_s:g} s")
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    raise OSError(code, os.strerror(code))
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno == errno.ECONNREFUSED:
                failure = HttpFailure("refused", "connection refused")
            else:
                failure = HttpFailure("network", exc.strerror or str(exc))
        except BaseException:
            sock.close()
            raise
    raise failure


def _handshake(sock: socket.socket, context: ssl.SSLContext, host: str, connect_s: float, cancel: Any) -> ssl.SSLSocket:
    until = time.monotonic() + connect_s
    try:
        tls = context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
    except (ssl.SSLError, OSError) as exc:
        raise HttpFailure("tls", str(exc)) from None
    while True:
        try:
            tls.do_handshake()
            return tls
        except ssl.SSLWantReadError:
            _wait(tls, False, until, cancel, "the TLS handshake did not finish in time")
        except ssl.SSLWantWriteError:
            _wait(tls, True, until, cancel, "the TLS handshake did not finish in time")
        except ssl.SSLCertVerificationError as exc:
            raise HttpFailure("tls", f"certificate not trusted: {exc.verify_message or exc}") from None
        except (ssl.SSLError, OSError) as exc:
            raise HttpFailure("tls", str(exc)) from None


def _send_all(sock: socket.socket, data: bytes, send_s: float, cancel: Any) -> None:
    until = time.monotonic() + send_s
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError, InterruptedError):
            _wait(sock, True, until, cancel, "the server did not take the request in time")
            continue
        except OSError as exc:
            raise HttpFailure("network", f"sending the request failed: {exc.strerror or exc}") from None
        view = view[sent:]


def sse_events(chunks: Iterator[bytes], max_event: int = 1 << 20) -> Iterator[str]:
    """The `data:` payloads of a server-sent-event stream, one per event (comments and other fields
    skipped). HttpFailure("protocol") for an event over max_event bytes."""
    buf = bytearray()
    data: list[str] = []
    for piece in chunks:
        buf += piece
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                if len(buf) > max_event:
                    raise HttpFailure("protocol", "server-sent event too large")
                break
            line = bytes(buf[:nl]).rstrip(b"\r").decode("utf-8", errors="replace")
            del buf[: nl + 1]
            if not line:
                if data:
                    yield "\n".join(data)
                    data = []
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            if name == "data":
                data.append(value[1:] if value.startswith(" ") else value)
    tail = bytes(buf).rstrip(b"\r").decode("utf-8", errors="replace")
    if tail.startswith("data:"):
        data.append(tail[5:].lstrip(" "))
    if data:
        yield "\n".join(data)
