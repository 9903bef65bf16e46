"""The team backend (completiond/backends/, completion/team.py): an OpenAI-compatible or llama.cpp
server generates, completiond keeps documents, stop rules and typed-through reuse.

Two kinds of server, both on 127.0.0.1: a stdlib server that misbehaves on purpose (401, 404, 429, 500,
malformed streams, stalls, a stream that breaks off) for the error paths, and llama.cpp's own
llama-server serving the bundled model converted to GGUF (tests/remote_servers.py), driven through
`completiond lsp` -> daemon -> server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from types import SimpleNamespace

import pytest
from lsprotocol import types

from completiond import config as config_mod
from completiond.backends import http
from completiond.backends.team_server import TeamServer, TeamServerError, TeamRequest, read_api_key
from completiond.completion.completer import suggest
from completiond.completion.team import TeamCompleter, template_for
from completiond.completion.plan import Planner, PromptOptions
from completiond.completion.text_prompt import TextEncoder, render
from completiond.engine.cancel import CancelToken
from completiond.models.fim import text_layout

from remote_servers import FakeServer, free_port

def suggest_remote(server, text, offset, cfg, **kw):
    """(suggestions, generation, warnings) of one completion through the team server's Completer."""
    done = suggest(TeamCompleter(server), text, offset, cfg, **kw)
    return done.suggestions, done.generation, done.warnings


KEY = "sk-test-7f3a9c1e5d"


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.close()


def cfg_for(url: str, **extra):
    cfg, errors = config_mod.merge(config_mod.Config(), {"backend": "openai", "endpoint": url,
                                                         "endpointModel": "completiond-py-mini",
                                                         "endpointTimeout": 2.0, **extra})
    assert not errors, errors
    return cfg


def request(text: str = "x = ") -> TeamRequest:
    return TeamRequest(prompt=text, max_tokens=8)


# --- the stream and the stop rules ------------------------------------------------------------------

def test_stream_reaches_the_stop_rules_and_closes_early(fake):
    fake.plan.pieces = ["foo(", "1)\n", "bar = 2\n", "baz = 3\n"]
    backend = TeamServer(cfg_for(fake.url, multiline="never"))
    text = "def f():\n    x = "
    found, gen, warnings = suggest_remote(backend, text, len(text), cfg_for(fake.url, multiline="never"),
                                          cancel=CancelToken(), path="/home/someone/project/app.py", language="python")
    assert [s.text for s in found] == ["foo(1)"]
    assert gen.finish_reason == "stop-rule" and not warnings
    body = fake.plan.requests[0]["body"]
    # Single-line here: the server is told to stop at the newline too, and gets the served model name.
    assert "\n" in body["stop"] and "<|endoftext|>" in body["stop"] and body["model"] == "completiond-py-mini"
    assert body["stream"] is True and body["max_tokens"] == 64
    # Suffix-first, as the bundled model was trained: <fim_prefix><fim_suffix>S<fim_middle>P.
    assert body["prompt"] == "<|fim_prefix|><|fim_suffix|><|fim_middle|>" + text


def test_multiline_block_and_suffix_trimming(fake):
    fake.plan.pieces = ["\n        return", " a + b\n", "\n", "def other():\n", "    pass\n"]
    cfg = cfg_for(fake.url)
    text = "class A:\n    def f(self, a, b):"
    found, gen, _ = suggest_remote(TeamServer(cfg), text, len(text), cfg, cancel=CancelToken())
    assert found[0].text == "\n        return a + b"  # dedent out of the block ends it, as locally
    fake.plan.pieces = ['"hi")']
    text, after = 'print(', ')\n'
    found, _, _ = suggest_remote(TeamServer(cfg), text + after, len(text), cfg, cancel=CancelToken())
    assert found[0].text == '"hi"'   # the ")" already right of the cursor is not repeated


def test_what_is_sent_is_the_prompt_only(fake):
    """The document windows, the file's name (not its directory) and the context snippets given."""
    cfg = cfg_for(fake.url, fimTemplate="qwen2.5-coder", prefixTokens=16, suffixTokens=8)
    lines = [f"line_{i} = {i}" for i in range(200)]
    text = "\n".join(lines[:150]) + "\nx = " + "\n" + "\n".join(lines[150:])
    cursor = text.index("\nx = ") + 5
    context = [("lib/util.py", "def helper():\n    return '<|fim_middle|>'\n")]
    suggest_remote(TeamServer(cfg), text, cursor, cfg, cancel=CancelToken(), path="/home/alice/secret-project/app.py",
                   language="python", context=context)
    sent = fake.plan.requests[0]["body"]["prompt"]
    assert "/home/alice" not in sent and "secret-project" not in sent
    assert sent.startswith("<|file_sep|>lib/util.py\ndef helper():")
    assert "<|file_sep|>app.py\n<|fim_prefix|>" in sent
    # Special-token spellings inside files are broken, so the server cannot read them as tokens.
    assert sent.count("<|fim_middle|>") == 1 and "<\u200b|fim_middle|>" in sent
    prefix = sent.split("<|fim_prefix|>", 1)[1].split("<|fim_suffix|>", 1)[0]
    suffix = sent.split("<|fim_suffix|>", 1)[1].split("<|fim_middle|>", 1)[0]
    assert prefix.endswith("\nx = ") and len(prefix) <= 16 * 4 and text.index(prefix) >= 0
    assert len(suffix) <= 8 * 4 and suffix.endswith("\n")
    assert "line_0 = 0" not in sent  # outside the budgets: never leaves the machine


def test_windows_are_stable_while_typing():
    """The team server's windows are the planner's, measured in characters: typing on the cursor line does
    not move the prefix window (the server's prefix cache keeps hitting), which starts on a chunk boundary."""
    text = "".join(f"v{i} = {i}\n" for i in range(100)) + "y = "
    planner = Planner(TextEncoder.for_template("qwen2.5-coder"), PromptOptions(prefix_tokens=50, suffix_tokens=1))
    plans = [planner.plan(text + "a" * n, len(text) + n) for n in range(8)]
    assert len({p.prefix_start for p in plans}) == 1
    begin = plans[0].prefix_start
    assert begin > 0 and text[begin - 1] == "\n" and text.count("\n", 0, begin) % 16 == 0
    assert sum(map(len, TextEncoder.for_template("qwen2.5-coder").encode(text[begin:]))) <= 50 * 4
    enc = TextEncoder.for_template("qwen2.5-coder")
    tail = Planner(enc, PromptOptions(prefix_tokens=4, suffix_tokens=1))
    assert enc.lay_out(tail.plan("ab\ncd\nef", 0), "ab\ncd\nef").suffix == "ab\n"  # cut at a line end
    assert enc.lay_out(tail.plan("abcdef", 0), "abcdef").suffix == "abcd"  # a longer line: what fits of it


def test_templates_render_each_family():
    # Suffix first where the family was trained on it (as locally): typing then only appends.
    assert render(text_layout("codellama"), "P", "S") == "<PRE> <SUF>S <MID> P"
    assert render(text_layout("qwen2.5-coder"), "P", "S") == "<|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>"
    assert render(text_layout("none"), "P", "S") == "P"
    assert render(text_layout("none"), "P", "S", [("a.py", "A = 1")], language="python") == "# a.py\nA = 1\nP"
    cfg = SimpleNamespace(fim_template="auto", endpoint_model="Qwen/Qwen2.5-Coder-7B", backend="openai")
    assert template_for(cfg) == ("qwen2.5-coder", [])
    name, warnings = template_for(SimpleNamespace(fim_template="auto", endpoint_model="mystery", backend="openai"))
    assert name == "none" and "fimTemplate" in warnings[0]


def test_infill_api_gets_prefix_suffix_and_files(fake):
    fake.plan.pieces = ["42"]
    cfg = cfg_for(fake.url, backend="llamacpp-infill")
    text, after = "x = ", "\nprint(x)\n"
    found, gen, _ = suggest_remote(TeamServer(cfg), text + after, len(text), cfg, cancel=CancelToken(),
                                   context=[("b.py", "B = 2\n")])
    assert found[0].text == "42" and gen.finish_reason == "stop"
    req = fake.plan.requests[0]
    assert req["path"] == "/infill"
    assert req["body"]["input_prefix"] == text and req["body"]["input_suffix"] == after
    assert req["body"]["input_extra"] == [{"filename": "b.py", "text": "B = 2\n"}]


def test_a_server_that_ignores_stream_still_answers(fake):
    fake.plan.mode, fake.plan.pieces = "json", ["1 + 1"]
    gen = TeamServer(cfg_for(fake.url)).complete(request(), cancel=CancelToken())
    assert gen.text == "1 + 1"


# --- cancellation -------------------------------------------------------------------------------------

def test_cancel_closes_the_stream(fake):
    fake.plan.mode, fake.plan.pieces = "stall", ["a"]
    backend = TeamServer(cfg_for(fake.url, endpointTimeout=30.0))
    token = CancelToken()
    got_text = threading.Event()

    def on_text(text):
        got_text.set()
        return False

    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("gen", backend.complete(request(), cancel=token,
                                                                                       on_text=on_text)))
    worker.start()
    assert got_text.wait(10)
    token.cancel()
    worker.join(10)
    assert not worker.is_alive()
    assert result["gen"].finish_reason == "cancelled"
    assert fake.plan.client_closed.wait(10), "the server never saw the connection close"
    assert backend.backoff() is None  # a cancel is no failure


# --- errors: one clear message each, then backoff ---------------------------------------------------

@pytest.mark.parametrize("status,kind,says", [
    (401, "unauthorized", "apiKeyEnv"), (403, "unauthorized", "HTTP 403"), (404, "not_found", "/v1/completions"),
    (500, "server", "boom"), (503, "server", "HTTP 503"), (400, "rejected", "endpointModel")])
def test_http_errors(fake, status, kind, says):
    fake.plan.mode, fake.plan.status = "status", status
    backend = TeamServer(cfg_for(fake.url))
    with pytest.raises(TeamServerError) as err:
        backend.complete(request(), cancel=CancelToken())
    assert err.value.kind == kind and says in str(err.value) and fake.url in str(err.value)
    # Until the backoff passes the server is not asked again, and the editor gets the same message
    # (shown once: the LSP shows each distinct message once).
    with pytest.raises(TeamServerError) as again:
        backend.complete(request(), cancel=CancelToken())
    assert str(again.value) == str(err.value) and len(fake.plan.requests) == 1


def test_rate_limit_waits_as_asked(fake):
    fake.plan.mode, fake.plan.status, fake.plan.headers = "status", 429, {"Retry-After": "7"}
    backend = TeamServer(cfg_for(fake.url))
    with pytest.raises(TeamServerError) as err:
        backend.complete(request(), cancel=CancelToken())
    assert err.value.kind == "rate_limited" and err.value.retry_after == 7.0
    assert backend._retry_at - __import__("time").monotonic() > 5  # noqa: SLF001 (the wait it asked for)


def test_backoff_doubles_then_resets_on_success(fake):
    fake.plan.mode = "status"
    backend = TeamServer(cfg_for(fake.url))
    delays = []
    for _ in range(4):
        backend._retry_at = 0.0  # noqa: SLF001 (skip the wait itself: only its length is under test)
        before = __import__("time").monotonic()
        with pytest.raises(TeamServerError):
            backend.complete(request(), cancel=CancelToken())
        delays.append(round(backend._retry_at - before, 1))  # noqa: SLF001
    assert delays == [0.5, 1.0, 2.0, 4.0]
    fake.plan.mode = "stream"
    backend._retry_at = 0.0  # noqa: SLF001
    assert backend.complete(request(), cancel=CancelToken()).text == "hello world"
    assert backend.backoff() is None and backend._failures == 0  # noqa: SLF001


def test_malformed_stream(fake):
    fake.plan.mode = "malformed"
    with pytest.raises(TeamServerError) as err:
        TeamServer(cfg_for(fake.url)).complete(request(), cancel=CancelToken())
    assert err.value.kind == "malformed" and "not JSON" in str(err.value)


def test_stream_that_breaks_off(fake):
    fake.plan.mode = "die"
    with pytest.raises(TeamServerError) as err:
        TeamServer(cfg_for(fake.url)).complete(request(), cancel=CancelToken())
    assert err.value.kind in ("malformed", "network") and fake.url in str(err.value)


def test_stall_times_out(fake):
    fake.plan.mode = "stall"
    with pytest.raises(TeamServerError) as err:
        TeamServer(cfg_for(fake.url, endpointTimeout=0.5)).complete(request(), cancel=CancelToken())
    assert err.value.kind == "timeout" and "endpointTimeout" in str(err.value)


def test_connection_refused():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TeamServerError) as err:
        TeamServer(cfg_for(url)).complete(request(), cancel=CancelToken())
    assert err.value.kind == "refused" and "is it running" in str(err.value) and url in str(err.value)


def test_tls_is_verified(tmp_path):
    """A TLS server with a certificate nobody vouches for is refused (verification is on by default)."""
    import ssl
    import subprocess

    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                           "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"openssl cannot make a test certificate: {made.stderr[-200:]!r}")
    server = FakeServer()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.httpd.socket = context.wrap_socket(server.httpd.socket, server_side=True)
    try:
        url = server.url.replace("http://", "https://")
        with pytest.raises(TeamServerError) as err:
            TeamServer(cfg_for(url)).complete(request(), cancel=CancelToken())
        assert err.value.kind == "tls" and "endpointCaFile" in str(err.value)
    finally:
        server.close()


# --- the API key ------------------------------------------------------------------------------------

def test_api_key_from_env_is_sent_and_never_shown(fake, monkeypatch, caplog):
    monkeypatch.setenv("TEAM_COMPLETIONS_KEY", KEY)
    caplog.set_level(logging.DEBUG)
    backend = TeamServer(cfg_for(fake.url, apiKeyEnv="TEAM_COMPLETIONS_KEY"))
    backend.complete(request(), cancel=CancelToken())
    assert fake.plan.requests[0]["headers"]["Authorization"] == f"Bearer {KEY}"
    fake.plan.mode, fake.plan.status = "status", 401
    backend._retry_at = 0.0  # noqa: SLF001
    with pytest.raises(TeamServerError) as err:
        backend.complete(request(), cancel=CancelToken())
    assert KEY not in str(err.value) and KEY not in caplog.text and KEY not in repr(vars(backend).get("model_id"))


def test_a_server_echoing_the_key_never_puts_it_in_a_message_or_the_log(fake, monkeypatch, caplog):
    """Issue 31, item 5: a 401 page that repeats the Authorization header (whole, and clipped)."""
    monkeypatch.setenv("TEAM_COMPLETIONS_KEY", KEY)
    caplog.set_level(logging.DEBUG)
    backend = TeamServer(cfg_for(fake.url, apiKeyEnv="TEAM_COMPLETIONS_KEY"))
    fake.plan.mode, fake.plan.status, fake.plan.echo_auth = "status", 401, True
    with pytest.raises(TeamServerError) as err:
        backend.complete(request(), cancel=CancelToken())
    assert err.value.kind == "unauthorized" and "[API key]" in str(err.value)
    assert fake.plan.requests[0]["headers"]["Authorization"] == f"Bearer {KEY}"   # the server did get it
    for text in (str(err.value), str(backend.backoff()), caplog.text):
        assert KEY[:8] not in text, text          # not whole, and no clipped prefix of it either
    # The same for an error event in the middle of a stream, and a status line that is no HTTP.
    assert KEY[:8] not in backend.redact(f"boom: {KEY[:12]}…") and backend.redact("no key here") == "no key here"


def test_the_key_goes_over_plain_http_only_to_loopback_or_an_endpoint_the_user_named(monkeypatch):
    monkeypatch.setenv("TEAM_COMPLETIONS_KEY", KEY)
    for url in ("http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000", "https://gpu-box:8443"):
        TeamServer(cfg_for(url, apiKeyEnv="TEAM_COMPLETIONS_KEY"))
    with pytest.raises(TeamServerError, match="refusing to send the API key unencrypted to http://gpu-box:8000") as err:
        TeamServer(cfg_for("http://gpu-box:8000", apiKeyEnv="TEAM_COMPLETIONS_KEY"))
    assert err.value.kind == "config" and "apiKeyOverHttp" in str(err.value)
    TeamServer(cfg_for("http://gpu-box:8000", apiKeyEnv="TEAM_COMPLETIONS_KEY",
                          apiKeyOverHttp="http://other:1, http://gpu-box:8000/"))          # opted in, per endpoint
    with pytest.raises(TeamServerError, match="unencrypted"):                            # another endpoint's opt-in
        TeamServer(cfg_for("http://gpu-box:8000", apiKeyEnv="TEAM_COMPLETIONS_KEY", apiKeyOverHttp="http://other:8000"))
    with pytest.raises(TeamServerError, match="unencrypted"):                            # another port of the same host
        TeamServer(cfg_for("http://gpu-box:8000", apiKeyEnv="TEAM_COMPLETIONS_KEY", apiKeyOverHttp="http://gpu-box"))
    TeamServer(cfg_for("http://gpu-box:8000"))                                    # no key, nothing to protect
    schema = {item["key"]: item for item in config_mod.schema()}
    assert schema["apiKeyOverHttp"].get("scope") == "machine" and "apiKeyOverHttp" in config_mod.ENGINE_KEYS


def test_interim_responses_are_bounded_and_arm_the_backoff(fake):
    """Issue 31, item 5: 5,000 `100 Continue` heads raised RecursionError out of complete(), unhandled."""
    backend = TeamServer(cfg_for(fake.url))
    fake.plan.interim, fake.plan.pieces = 3, ["ok"]                  # a few are allowed, and skipped
    assert backend.complete(request(), cancel=CancelToken()).text == "ok"
    fake.plan.interim = 5000
    with pytest.raises(TeamServerError, match="interim") as err:
        backend.complete(request(), cancel=CancelToken())
    assert err.value.kind == "malformed"
    assert backend.backoff() is err.value                            # the next keystroke does not ask again


def test_api_key_file_must_be_private_and_one_line(tmp_path):
    key = tmp_path / "key"
    key.write_text(KEY + "\n")
    key.chmod(0o644)
    with pytest.raises(TeamServerError, match="chmod 600"):
        read_api_key("", str(key))
    key.chmod(0o600)
    assert read_api_key("", str(key)) == KEY
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\n")
    with pytest.raises(TeamServerError, match="one line"):
        read_api_key("", str(key))
    with pytest.raises(TeamServerError, match="not set"):
        read_api_key("COMPLETIOND_TEST_UNSET_KEY", "")
    assert read_api_key("", "") is None


def test_settings_refuse_credentials_in_the_url():
    cfg, errors = config_mod.merge(config_mod.Config(), {"endpoint": "https://user:pw@gpu-box:8000"})
    assert cfg.endpoint == "" and "credentials" in errors[0]
    cfg, errors = config_mod.merge(config_mod.Config(), {"backend": "ollama"})
    assert cfg.backend == "local" and errors
    schema = {item["key"]: item for item in config_mod.schema()}
    # A repository's workspace settings cannot point a reader's editor at a server of its choosing.
    assert all(schema[k].get("scope") == "machine" for k in ("backend", "endpoint", "apiKeyEnv", "apiKeyFile"))
    assert set(("backend", "endpoint", "endpointModel")) <= set(config_mod.ENGINE_KEYS)


def test_endpoint_parse():
    e = http.Endpoint.parse("https://gpu-box:8443/api/")
    assert (e.scheme, e.host, e.port, e.base_path) == ("https", "gpu-box", 8443, "/api")
    assert e.url("/v1/completions") == "https://gpu-box:8443/api/v1/completions"
    with pytest.raises(ValueError):
        http.Endpoint.parse("ftp://x")


# --- through the service: the daemon survives every failure ------------------------------------------

async def test_service_reports_and_recovers(fake, tmp_path):
    from completiond.serving.service import Service, ServiceError
    from completiond.serving.wire import Code

    service = Service(cfg_for(fake.url, multiline="never"))
    service.start_loading()
    for _ in range(100):
        if service.state == "ready":
            break
        await asyncio.sleep(0.05)
    assert service.state == "ready" and service.status()["device"] == "remote"
    service.notify("c", "workspace", {"folders": [str(tmp_path)]})  # the privacy gate sends workspace files only
    uri = (tmp_path / "a.py").as_uri()
    service.open("c", uri, 1, "x = ", "python")
    fake.plan.mode = "status"
    with pytest.raises(ServiceError) as err:
        await service.complete("c", 1, uri, 1, 4)
    assert err.value.code == Code.ENGINE_ERROR and "HTTP 500" in err.value.message
    fake.plan.mode, fake.plan.pieces = "stream", ["42\n", "y = 1"]
    for _ in range(200):  # the first backoff is half a second; bounded wait for it to pass
        if service.completer.server.backoff() is None:
            break
        await asyncio.sleep(0.01)
    result = await service.complete("c", 2, uri, 1, 4)
    assert result["suggestion"]["text"] == "42" and result["stats"]["token_healing"] is False
    service.shutdown()
    os.environ.pop("COMPLETIOND_TEST_UNSET_KEY", None)


# --- through the editor: completiond lsp -> daemon -> a server that breaks off its streams -----------

from test_lsp import runtime, start, wait_for  # noqa: E402,F401  (fixtures)


async def open_in_folder(s, folder, text: str) -> str:
    """Open a document inside the session's workspace folder (the privacy gate sends nothing else to a
    team server); its URI."""
    uri = (folder / "example.py").as_uri()
    await s.open(text, uri=uri)
    return uri


async def inline_at(s, uri: str):
    return await asyncio.wait_for(s.client.text_document_inline_completion_async(s.inline_params(uri)), 120)


@pytest.mark.slow
async def test_editor_gets_one_message_for_broken_streams(fake, start, tmp_path):
    fake.plan.mode, fake.plan.pieces = "die", ["half"]
    folder = tmp_path / "project"
    folder.mkdir()
    s = await start({"backend": "openai", "endpoint": fake.url, "endpointModel": "completiond-py-mini",
                     "maxTokens": 8, "idleTimeout": 60}, folder=folder)
    uri = await open_in_folder(s, folder, "def main():\n    x = ")
    await s.wait_ready()
    for ch in "abc":  # one keystroke reaches the server; the next ones fall within the backoff
        s.type(ch, uri=uri)
        result = await inline_at(s, uri)
        assert not result.items
    told = [m.message for m in s.client.messages if "completion server" in m.message]
    assert len(told) == 1 and fake.url in told[0] and "retries" in told[0], s.client.messages
    stats = await s.stats()
    # Not "ready" while every request fails (issue 47): "error", with the server's failure, until it answers.
    assert stats["status"]["state"] == "error" and stats["status"]["device"] == "remote"
    assert fake.url in stats["status"]["error"]
    # The server is mended: once the backoff has passed, suggestions arrive (valid after the typed
    # `x = abc`: the syntax check would drop a bare "1 + 2" there).
    fake.plan.mode, fake.plan.pieces = "stream", ["+ 1 + 2"]
    for _ in range(100):
        s.type(" ", uri=uri)
        result = await inline_at(s, uri)
        if result.items:
            break
        await asyncio.sleep(0.05)
    assert result.items and result.items[0].insert_text.endswith("1 + 2")
    await wait_for(lambda: s.status[-1].get("state") in ("ready", "busy"), "the status to be ready again")


@pytest.mark.slow
async def test_changing_the_endpoint_restarts_the_daemon_onto_it(fake, start, tmp_path):
    from test_lsp import wait_for

    other = FakeServer()
    folder = tmp_path / "project"
    folder.mkdir()
    try:
        fake.plan.pieces, other.plan.pieces = ["1"], ["2"]
        s = await start({"backend": "openai", "endpoint": fake.url, "endpointModel": "completiond-py-mini",
                         "maxTokens": 8, "idleTimeout": 60}, folder=folder)
        uri = await open_in_folder(s, folder, "def main():\n    x = ")
        await s.wait_ready()
        assert (await inline_at(s, uri)).items[0].insert_text.endswith("1")
        pid = (await s.stats())["status"]["pid"]
        s.client.workspace_did_change_configuration(types.DidChangeConfigurationParams(
            settings={"completiond": {"backend": "openai", "endpoint": other.url, "endpointModel": "completiond-py-mini"}}))

        async def moved():
            # While the old daemon goes and the new one starts, stats carries "error" instead.
            status = (await s.stats()).get("status")
            return bool(status) and status["pid"] != pid and status["engine_settings"]["endpoint"] == other.url

        await wait_for(moved, "the daemon to restart onto the other endpoint")
        assert any("restarting the shared daemon" in m.message for m in s.client.messages)
        await s.wait_ready()
        s.type(" ", uri=uri)
        assert (await inline_at(s, uri)).items[0].insert_text.endswith("2") and other.plan.requests
    finally:
        other.close()
