"""A team's completion server in the engine's place: OpenAI-compatible `/v1/completions` (vLLM, SGLang, TGI,
llama.cpp's `llama-server`) or llama.cpp's native `/infill`.

`TeamServer.complete` sends one prompt (text: these servers tokenize themselves), streams the
answer, hands the text so far to the caller after every event (the caller's stop rules may end the
stream early: closing the connection is how the server learns to stop), and lets go within
`http.POLL_S` of a cancel. Every failure becomes one `TeamServerError` whose message names the URL, what
happened and what to do; after a failure the backend waits before it asks the server again (doubling
from 0.5 s up to 30 s, or what a 429's Retry-After asks), and until then answers with the same error at
once, so a dead server costs a keystroke nothing and the editor shows the message once.

The API key comes from an environment variable or a file, never from the settings themselves (editors
sync those); it is sent only as the `Authorization` header to the configured endpoint, over plain http://
only to this machine (loopback) or to an endpoint the user named in apiKeyOverHttp, and it is cut out of
every message and log line (a server that echoes the header in its error body included).
"""

from __future__ import annotations

import json
import logging
import os
import re
import ssl
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from completiond.backends import http
from completiond.config import Config
from completiond.errors import CompletionError

log = logging.getLogger(__name__)

API_PATHS = {"openai": "/v1/completions", "llamacpp-infill": "/infill"}
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
RETRY_AFTER_MAX_S = 120.0
MAX_KEY_FILE_BYTES = 4096
TOTAL_FACTOR = 6  # the longest a whole request may take, in endpointTimeouts
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class TeamServerError(CompletionError):
    """The completion server could not serve a request. `kind`: config | refused | timeout | tls |
    network | unauthorized | not_found | rate_limited | rejected | server | malformed."""

    def __init__(self, kind: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.kind = kind
        self.retry_after = retry_after


@dataclass
class TeamRequest:
    """What is sent: for `openai` the whole prompt (FIM layout included); for `llamacpp-infill` the
    prefix, suffix and context files, which the server lays out with the model's own FIM tokens."""

    prompt: str = ""
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[tuple[str, str]] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def chars(self) -> int:
        return (
            len(self.prompt)
            + len(self.input_prefix)
            + len(self.input_suffix)
            + sum(len(p) + len(t) for p, t in self.input_extra)
        )


@dataclass
class TeamGeneration:
    text: str
    finish_reason: str  # stop | length | stop-rule | cancelled
    stats: dict[str, Any]


def read_api_key(key_env: str, key_file: str) -> str | None:
    """The API key from the environment variable named `key_env`, else the file `key_file`; None when
    neither is set. TeamServerError("config") when one is set but unusable. The file must be private
    (not readable by group or others, as ssh demands of keys) and hold one line."""
    if key_env:
        if not _ENV_NAME.fullmatch(key_env):
            raise TeamServerError("config", f"apiKeyEnv {key_env!r} is not an environment variable name")
        value = os.environ.get(key_env, "").strip()
        if not value:
            raise TeamServerError(
                "config",
                f"apiKeyEnv names ${key_env}, which is not set in the daemon's environment "
                "(set it where the editor starts, then restart the daemon)",
            )
        return _check_key(value, f"${key_env}")
    if not key_file:
        return None
    path = os.path.expanduser(key_file)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise TeamServerError("config", f"apiKeyFile {key_file}: cannot open it: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TeamServerError("config", f"apiKeyFile {key_file}: not a regular file")
        if st.st_mode & 0o077:
            raise TeamServerError(
                "config",
                f"apiKeyFile {key_file}: readable by other users (mode "
                f"{stat.S_IMODE(st.st_mode):o}); run chmod 600 on it",
            )
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise TeamServerError("config", f"apiKeyFile {key_file}: owned by another user")
        data = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise TeamServerError(
            "config", f"apiKeyFile {key_file}: over {MAX_KEY_FILE_BYTES} bytes; an API key is one line"
        )
    try:
        lines = [ln.strip() for ln in data.decode("ascii").splitlines() if ln.strip()]
    except UnicodeDecodeError:
        raise TeamServerError("config", f"apiKeyFile {key_file}: not ASCII text; an API key is one line") from None
    if len(lines) != 1:
        # A multi-line file is not a key but, say, a private key picked by mistake: never send that.
        raise TeamServerError(
            "config", f"apiKeyFile {key_file}: expected the key on one line, found {len(lines)} lines"
        )
    return _check_key(lines[0], f"apiKeyFile {key_file}")


def _check_key(value: str, where: str) -> str:
    if value.startswith("-----BEGIN") or any(c.isspace() or not c.isprintable() for c in value):
        raise TeamServerError("config", f"{where}: does not look like an API key (one word of printable characters)")
    return value


class TeamServer:
    """A team's completion server for the settings `cfg` (a Config). Thread-safe for one worker thread
    plus status readers. Prompts are text: the server tokenizes."""

    def __init__(self, cfg: Config):
        self.api = cfg.backend
        if self.api not in API_PATHS:
            raise TeamServerError(
                "config", f"backend {self.api!r} is not a remote API; expected one of {', '.join(API_PATHS)}"
            )
        if not cfg.endpoint:
            raise TeamServerError(
                "config",
                f"backend {self.api} needs completiond.endpoint, the server's base URL (e.g. http://gpu-box:8000)",
            )
        try:
            self.endpoint = http.Endpoint.parse(cfg.endpoint)
        except ValueError as exc:
            raise TeamServerError("config", f"endpoint: {exc}") from None
        self.path = API_PATHS[self.api]
        self.url = self.endpoint.url(self.path)
        self.served_model = cfg.endpoint_model
        self.timeout_s = float(cfg.endpoint_timeout)
        self._key = read_api_key(cfg.api_key_env, cfg.api_key_file)
        if self._key and self.endpoint.scheme == "http" and not http.is_loopback(self.endpoint.host):
            allowed = {_origin(u) for u in str(getattr(cfg, "api_key_over_http", "") or "").split(",") if u.strip()}
            if _origin(cfg.endpoint) not in allowed:
                raise TeamServerError(
                    "config",
                    f"refusing to send the API key unencrypted to {self.endpoint.url()} "
                    "(plain http:// to another machine): use an https:// endpoint, or, if "
                    "the network is yours, allow this endpoint with completiond.apiKeyOverHttp "
                    f'= "{self.endpoint.url()}"',
                )
        self._tls = None
        if self.endpoint.scheme == "https":
            try:
                self._tls = ssl.create_default_context(cafile=os.path.expanduser(cfg.endpoint_ca_file) or None)
            except (OSError, ssl.SSLError) as exc:
                raise TeamServerError("config", f"endpointCaFile {cfg.endpoint_ca_file}: {exc}") from None
        self.model_id = f"{self.served_model or '(server default)'} at {self.endpoint.url()}"
        self.device = "remote"
        self._lock = threading.Lock()
        self._failures = 0
        self._retry_at = 0.0
        self._last_error: TeamServerError | None = None

    # -- retry with backoff ----------------------------------------------------------------------
    def backoff(self) -> TeamServerError | None:
        """The last error while the backend waits before asking the server again, else None."""
        with self._lock:
            if self._last_error is not None and time.monotonic() < self._retry_at:
                return self._last_error
            return None

    def redact(self, text: str) -> str:
        """`text` with the API key cut out (as sent, and as JSON would escape it)."""
        key = self._key
        if not key or not text:
            return text
        for form in {key, json.dumps(key)[1:-1], key.replace("/", "\\/")}:
            text = text.replace(form, "[API key]")
            # And what is left of it where someone clipped the text: any run of 8 or more of its first characters.
            head = form[: min(8, len(form))]
            at = text.find(head)
            while at >= 0:
                end = at + len(head)
                while end < len(text) and end - at < len(form) and text[end] == form[end - at]:
                    end += 1
                text = text[:at] + "[API key]" + text[end:]
                at = text.find(head, at + len("[API key]"))
        return text

    def _failed(self, error: TeamServerError) -> TeamServerError:
        # The last net: every error the user or the log sees passes here (messages built from a server's
        # words are redacted before they are clipped, so no prefix of the key survives either).
        error = TeamServerError(error.kind, self.redact(str(error)), retry_after=error.retry_after)
        with self._lock:
            self._failures += 1
            delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self._failures - 1))
            if error.retry_after is not None:
                delay = min(RETRY_AFTER_MAX_S, max(delay, error.retry_after))
            self._retry_at = time.monotonic() + delay
            self._last_error = error
        log.warning("%s (next try in %.1f s)", error, delay)
        return error

    def _succeeded(self) -> None:
        with self._lock:
            if self._failures:
                log.info("completion server %s answers again", self.endpoint.url())
            self._failures = 0
            self._retry_at = 0.0
            self._last_error = None

    # -- one request -----------------------------------------------------------------------------
    def body(self, req: TeamRequest) -> dict[str, Any]:
        if self.api == "openai":
            body: dict[str, Any] = {
                "prompt": req.prompt,
                "max_tokens": req.max_tokens,
                "temperature": req.temperature,
                "top_p": req.top_p,
                "seed": req.seed,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if self.served_model:
                body["model"] = self.served_model
            if req.top_k > 0:
                body["top_k"] = req.top_k  # not OpenAI's, but vLLM, SGLang, TGI and llama.cpp take it
        else:
            body = {
                "input_prefix": req.input_prefix,
                "input_suffix": req.input_suffix,
                "input_extra": [{"filename": p, "text": t} for p, t in req.input_extra],
                "prompt": "",
                "n_predict": req.max_tokens,
                "temperature": req.temperature,
                "top_p": req.top_p,
                "top_k": req.top_k,
                "seed": req.seed,
                "stream": True,
                "cache_prompt": True,
            }
        if req.stop:
            body["stop"] = list(req.stop)
        return body

    def complete(
        self, req: TeamRequest, *, cancel: Any, on_text: Callable[[str], bool] | None = None
    ) -> TeamGeneration:
        """Stream one completion. on_text(text so far) returns True to end it there (the stream is
        closed). Raises TeamServerError; a cancel returns finish_reason "cancelled"."""
        waiting = self.backoff()
        if waiting is not None:
            raise waiting
        payload = json.dumps(self.body(req)).encode("utf-8")
        headers = {"Accept": "text/event-stream"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        start = time.perf_counter()
        stats: dict[str, Any] = {"prompt_chars": req.chars, "remote": True}
        response = None
        try:
            # A stalled server fails after timeout_s without a byte; TOTAL_FACTOR bounds even one that
            # trickles, so a request can never hold the worker for good.
            response = http.post(
                self.endpoint,
                self.path,
                payload,
                headers,
                cancel=cancel,
                connect_s=min(self.timeout_s, 5.0),
                stall_s=self.timeout_s,
                total_s=max(self.timeout_s, 5.0) * TOTAL_FACTOR,
                tls=self._tls,
            )
            if response.status == 101:  # we asked for no upgrade: a server that switches protocols is no server of ours
                raise http.HttpFailure("protocol", "the server switched protocols (HTTP 101)")
            if response.status != 200:
                raise self._failed(self._status_error(response))
            gen = self._read_stream(response, on_text, stats, start)
        except http.Cancelled:
            return TeamGeneration("", "cancelled", self._finish_stats(stats, start))
        except http.HttpFailure as exc:
            raise self._failed(self._transport_error(exc)) from None
        finally:
            if response is not None:
                response.close()
        if gen.finish_reason == "cancelled":
            return gen
        self._succeeded()
        return gen

    def _read_stream(
        self, response: http.Response, on_text: Callable[[str], bool] | None, stats: dict[str, Any], start: float
    ) -> TeamGeneration:
        ctype = response.headers.get("content-type", "")
        if "text/event-stream" not in ctype:
            if "json" in ctype:  # a server that ignored "stream": one JSON answer is still an answer
                body = response.read_body(1 << 20)
                text, finish = self._event(self._json(body.decode("utf-8", errors="replace")), stats)
                return self._done(text, finish or "stop", on_text, stats, start)
            raise self._failed(self._malformed(f"expected an event stream, got content type {ctype or 'none'!r}"))
        text = ""
        finish = None
        events = 0
        for data in http.sse_events(response.chunks()):
            if data.strip() == "[DONE]":
                finish = finish or "stop"
                break
            piece, reason = self._event(self._json(data), stats)
            events += 1
            if piece and "ttft_ms" not in stats:
                stats["ttft_ms"] = round((time.perf_counter() - start) * 1000, 2)
            text += piece
            finish = reason or finish
            stats["rounds"] = events
            if piece and on_text is not None and on_text(text):
                return TeamGeneration(text, "stop-rule", self._finish_stats(stats, start, text))
            if finish is not None and self.api == "llamacpp-infill":
                break  # the native API's last event says stop; there is no [DONE]
        if finish is None:
            raise self._failed(
                TeamServerError(
                    "network",
                    f"the completion server at {self.endpoint.url()} ended the "
                    "stream before the completion finished (did it stop or restart?); "
                    "completiond retries with backoff",
                )
            )
        return self._done(text, finish, on_text, stats, start)

    def _done(self, text: str, finish: str, on_text, stats, start) -> TeamGeneration:
        if text and on_text is not None and on_text(text):
            finish = "stop-rule"
        return TeamGeneration(text, finish, self._finish_stats(stats, start, text))

    def _finish_stats(self, stats: dict[str, Any], start: float, text: str = "") -> dict[str, Any]:
        stats["total_ms"] = round((time.perf_counter() - start) * 1000, 2)
        stats["generated_chars"] = len(text)
        stats.setdefault("rounds", 0)
        return stats

    def _json(self, data: str) -> dict[str, Any]:
        try:
            obj = json.loads(data)
        except ValueError:
            raise self._failed(self._malformed(f"an event is not JSON: {self.redact(data)[:60]!r}")) from None
        if not isinstance(obj, dict):
            raise self._failed(self._malformed(f"an event is not a JSON object: {self.redact(data)[:60]!r}"))
        return obj

    def _event(self, obj: dict[str, Any], stats: dict[str, Any]) -> tuple[str, str | None]:
        """(text, finish reason or None) of one event; usage and llama.cpp timings go into stats."""
        if "error" in obj:
            err = obj["error"]
            message = err.get("message") if isinstance(err, dict) else err
            raise self._failed(
                TeamServerError(
                    "server",
                    f"the completion server at {self.endpoint.url()} failed during "
                    f"the completion: {_clip(self.redact(str(message)))}; completiond retries "
                    "with backoff",
                )
            )
        usage = obj.get("usage")
        if isinstance(usage, dict):
            for ours, theirs in (("prompt_tokens", "prompt_tokens"), ("generated_tokens", "completion_tokens")):
                if isinstance(usage.get(theirs), int):
                    stats[ours] = usage[theirs]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if isinstance(cached, int):
                stats["reused_tokens"] = cached
        timings = obj.get("timings")
        if isinstance(timings, dict):  # llama.cpp: prompt_n evaluated now, cache_n served from its cache
            prompt_n, cache_n = timings.get("prompt_n"), timings.get("cache_n")
            if isinstance(prompt_n, int) and isinstance(cache_n, int):
                stats["prompt_tokens"] = prompt_n + cache_n
                stats["reused_tokens"] = cache_n
            if isinstance(timings.get("predicted_n"), int):
                stats["generated_tokens"] = timings["predicted_n"]
        if self.api == "llamacpp-infill":
            piece = obj.get("content", "")
            if not isinstance(piece, str):
                raise self._failed(self._malformed("an event's content is not a string"))
            reason = None
            if obj.get("stop") is True:
                reason = "length" if obj.get("stop_type") == "limit" else "stop"
            return piece, reason
        choices = obj.get("choices")
        if choices == []:
            return "", None  # the usage-only event of stream_options.include_usage (or a keep-alive)
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise self._failed(self._malformed("an event has no choices"))
        piece = choices[0].get("text", "")
        if not isinstance(piece, str):
            raise self._failed(self._malformed("an event's text is not a string"))
        reason = choices[0].get("finish_reason")
        return piece, (str(reason) if reason else None)

    # -- messages --------------------------------------------------------------------------------
    def _malformed(self, detail: str) -> TeamServerError:
        return TeamServerError(
            "malformed",
            f"the completion server at {self.url} sent a malformed stream ({detail}); "
            f"is it an OpenAI-compatible or llama.cpp server (backend {self.api})? "
            "completiond retries with backoff",
        )

    def _transport_error(self, exc: http.HttpFailure) -> TeamServerError:
        where = self.endpoint.url()
        if exc.kind == "refused":
            return TeamServerError(
                "refused",
                f"cannot reach the completion server at {where} (connection refused): "
                "is it running, and is completiond.endpoint right? completiond retries "
                "with backoff",
            )
        if exc.kind == "timeout":
            return TeamServerError(
                "timeout",
                f"the completion server at {where} did not answer in time ({exc.detail}; "
                f"endpointTimeout is {self.timeout_s:g} s); completiond retries with backoff",
            )
        if exc.kind == "tls":
            return TeamServerError(
                "tls",
                f"TLS with {where} failed: {_clip(exc.detail)}; for a private CA set "
                "completiond.endpointCaFile to its certificate (verification stays on)",
            )
        if exc.kind == "protocol":
            return self._malformed(exc.detail)
        return TeamServerError(
            "network",
            f"the completion server at {where} could not be used: {exc.detail}; completiond retries with backoff",
        )

    def _status_error(self, response: http.Response) -> TeamServerError:
        try:
            body = response.read_body().decode("utf-8", errors="replace")
        except (http.HttpFailure, http.Cancelled):
            body = ""
        detail = _server_message(self.redact(body))
        status = response.status
        said = f" (the server says: {detail})" if detail else ""
        if status in (401, 403):
            return TeamServerError(
                "unauthorized",
                f"the completion server at {self.endpoint.url()} refused the request "
                f"(HTTP {status}){said}: set completiond.apiKeyEnv or apiKeyFile to a "
                "valid API key, then restart the daemon",
            )
        if status == 404:
            return TeamServerError(
                "not_found",
                f"{self.url} does not exist (HTTP 404){said}: completiond.endpoint is the "
                f"server's base URL, and backend {self.api} needs a server with "
                f"{self.path}; check endpointModel ({self.served_model or 'unset'})",
            )
        if status == 429:
            retry = _retry_after(response.headers.get("retry-after", ""))
            return TeamServerError(
                "rate_limited",
                f"the completion server at {self.endpoint.url()} is rate limiting "
                f"(HTTP 429){said}; completiond waits as it asks, then retries",
                retry_after=retry,
            )
        if status >= 500:
            return TeamServerError(
                "server",
                f"the completion server at {self.endpoint.url()} failed (HTTP {status})"
                f"{said}; completiond retries with backoff",
            )
        return TeamServerError(
            "rejected",
            f"the completion server at {self.url} rejected the request (HTTP {status})"
            f"{said}; check endpointModel ({self.served_model or 'unset'}) and backend "
            f"({self.api})",
        )


def _origin(url: str) -> str:
    """An endpoint as apiKeyOverHttp compares it: scheme, host and port (the default port spelled out)."""
    try:
        e = http.Endpoint.parse(url)
    except ValueError:
        return ""
    return f"{e.scheme}://{e.host.lower()}:{e.port}{e.base_path}"


def _clip(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _server_message(body: str) -> str:
    """The message of an error body ({"error": {"message"}}, {"error": "..."}, {"message"}, or text)."""
    body = body.strip()
    if not body:
        return ""
    try:
        obj = json.loads(body)
    except ValueError:
        return _clip(body)
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            err = err.get("message") or err.get("detail") or ""
        return _clip(str(err))
    return _clip(body)


def _retry_after(value: str) -> float | None:
    value = value.strip()
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: rare from these servers; the doubling backoff applies
