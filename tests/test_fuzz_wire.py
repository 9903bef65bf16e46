"""Protocol fuzzing of the daemon's socket (issue 7, item 1).

Every hostile frame must get the answer the protocol promises (completiond/commands/stress.py,
check_wire_frame): a request -> an error (or result) reply with its id and a message;
a notification -> no reply, connection kept; an undecodable frame -> that connection
closed and the reason logged. Never an exception escaping a handler, never a daemon
exit, and a sentinel client on another connection keeps getting answers.

`InProcDaemon` (a DaemonServer on its own thread with the fake engine) is shared with
the other reliability tests.
"""

from __future__ import annotations

import asyncio
import logging
import random
import struct
import tempfile
import threading
from pathlib import Path

import numpy  # noqa: F401  (imported before the daemon thread does: hypothesis peeks at sys.modules["numpy"])
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from completiond import config
from completiond.serving import paths
from completiond.commands import stress
from completiond.serving import wire
from completiond.serving.server import DaemonServer
from completiond.serving.service import Service
from test_scheduler import FakeEngine, local


class InProcDaemon:
    """A real DaemonServer on a private event loop thread, socket in <runtime>/completiond.

    `errors` collects whatever reaches the loop's exception handler (an exception that
    escaped a handler task); tests assert it stays empty.
    """

    def __init__(self, runtime: Path | None = None, engine=None, loader=None, **service_kw):
        self.runtime = Path(runtime or tempfile.mkdtemp(prefix="completiond-test-"))
        self.runtime.mkdir(parents=True, exist_ok=True)
        self.rundir = self.runtime / "completiond"
        self.engine = engine or FakeEngine(continuation="urn a + b\n", per_round=2, round_s=0.001)
        self.errors: list[dict] = []
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._loader = loader or local(self.engine)
        self._service_kw = service_kw
        # Fakes ignore the healing constraint: their scripted text is what the user sees.
        self._settings = {"maxTokens": 16, **({} if loader else {"tokenHealing": False})}
        self.thread = threading.Thread(target=self._run, name="inproc-daemon", daemon=True)
        self.thread.start()
        assert self._ready.wait(30), "in-process daemon did not start"
        if self._failed is not None:
            raise self._failed

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        loop.set_exception_handler(lambda _l, ctx: self.errors.append(ctx))

        async def main() -> None:
            cfg, _ = config.merge(config.Config(), self._settings)
            self.service = Service(cfg, loader=self._loader, **self._service_kw)
            self.server = DaemonServer(self.service, self.rundir, idle_timeout=3600)
            await self.server.start()
            self.service.start_loading()
            self._ready.set()
            await self.server.serve_until_stopped()

        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # surfaced by __init__ / stop
            self._failed = exc
            self._ready.set()
        finally:
            loop.close()

    @property
    def socket_path(self) -> Path:
        return paths.socket_path(self.rundir)

    def call(self, fn, *args):
        """Run fn(*args) on the daemon's loop thread and return its result."""
        done = threading.Event()
        box: list = []

        def run():
            try:
                box.append((True, fn(*args)))
            except BaseException as exc:  # pragma: no cover - re-raised below
                box.append((False, exc))
            done.set()

        self.loop.call_soon_threadsafe(run)
        assert done.wait(10)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def documents(self) -> dict:
        return self.call(lambda: {k: (v.version, v.text) for k, v in self.service.documents.items()})

    def stop(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.server.request_stop, "test over")
            self.thread.join(15)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def inproc(tmp_path_factory):
    d = InProcDaemon(tmp_path_factory.mktemp("fuzz-rt"))
    yield d
    d.stop()
    assert not d.errors, f"exceptions escaped daemon handlers: {d.errors[:3]}"


@pytest.fixture
def sentinel(inproc):
    """Another client, connected all along: it must be unaffected by the fuzzing."""
    probe = stress.WireProbe(inproc.socket_path)
    probe.request("open", {"uri": "file:///sentinel.py", "version": 1, "text": "def add(a, b):\n    ret"})
    yield probe
    reply = probe.request("complete", {"uri": "file:///sentinel.py", "version": 1, "offset": 22})
    assert reply.get("r", {}).get("suggestion", {}).get("text") == "urn a + b", reply
    probe.close()
    assert not inproc.errors, f"exceptions escaped daemon handlers: {inproc.errors[:3]}"


# --- strategies -------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True)
           | st.text(max_size=40) | st.binary(max_size=40)
           | st.sampled_from(["file:///f.py", "u", "", "\x00", "😀", "\ud7ff"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=24)
ints = st.integers(-(2**63), 2**64 - 1) | st.sampled_from([0, 1, 2, 5, -1, 2**31 - 1, 2**53 + 1])
edits = st.lists(st.lists(ints | values, min_size=0, max_size=4) | values, max_size=4)
params = st.fixed_dictionaries({}, optional={
    "uri": st.sampled_from(["file:///f.py", "file:///sentinel.py"]) | values,
    "version": ints | values, "text": st.text(max_size=200) | values, "edits": edits,
    "offset": ints | values, "id": ints | values, "settings": st.dictionaries(
        st.sampled_from(["maxTokens", "temperature", "topP", "multiline", "model", "bogus"]), values | ints, max_size=3),
    "languageId": values})
methods = st.sampled_from(["ping", "status", "stats", "open", "change", "close", "complete", "cancel", "stop-not",
                           "frobnicate", ""]) | values
messages = st.fixed_dictionaries({"m": methods}, optional={"id": ints | values, "p": params | values, "t": values})

FUZZ = settings(max_examples=250, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@FUZZ
@given(msg=messages)
def test_structured_messages(inproc, sentinel, msg):
    try:
        frame = wire.encode(msg)
    except (wire.ProtocolError, ValueError, TypeError, OverflowError):  # not encodable: nothing to send
        return
    stress.check_wire_frame(inproc.socket_path, frame)
    assert sentinel.request("ping", {})["r"] == "pong"


@FUZZ
@given(payload=st.binary(min_size=1, max_size=300))
def test_random_payloads(inproc, sentinel, payload):
    stress.check_wire_frame(inproc.socket_path, wire.HEADER.pack(len(payload)) + payload)


@FUZZ
@given(msg=messages, data=st.data())
def test_mutated_frames(inproc, sentinel, msg, data):
    """Valid frames with bytes flipped, cut, or a lying length header."""
    try:
        frame = bytearray(wire.encode(msg))
    except (wire.ProtocolError, ValueError, TypeError, OverflowError):
        return
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "header"]))
        if op == "flip":
            i = data.draw(st.integers(4, max(4, len(frame) - 1)))
            if i < len(frame):
                frame[i] = data.draw(st.integers(0, 255))
        elif op == "cut" and len(frame) > 5:
            frame = frame[: data.draw(st.integers(5, len(frame) - 1))]
            frame[:4] = wire.HEADER.pack(len(frame) - 4)
        else:
            frame[:4] = struct.pack(">I", data.draw(st.sampled_from([0, 1, len(frame) + 10, wire.MAX_FRAME + 1,
                                                                     2**32 - 1])))
    stress.check_wire_frame(inproc.socket_path, bytes(frame))


@pytest.mark.parametrize("payload, why", [
    (b"\x81\xa1a" * 17 + b"\xc0", "nested deeper"),                                # our depth limit
    (b"\x91" * 5000 + b"\x01", "undecodable"),                                       # the unpacker's own limit
    (b"\x83\xa2id\x01\xa1m\xa4open\xa1p\x81\xa4text\xa2\xff\xfe", "undecodable"),   # invalid UTF-8 in a str
    (b"\x81\xa1a\xc7\x01\x05\x00", "undecodable"),                                   # ext type
    (b"\xdd" + struct.pack(">I", 2**31) + b"\x01", "undecodable"),                   # array32 claiming 2^31 items
], ids=["depth-17", "depth-5000", "bad-utf8", "ext", "array32"])
def test_named_hostile_frames_are_logged(inproc, sentinel, caplog, payload, why):
    caplog.set_level(logging.WARNING, logger="completiond.serving")
    assert stress.check_wire_frame(inproc.socket_path, wire.HEADER.pack(len(payload)) + payload) == "closed"
    for _ in range(100):
        if why in caplog.text:
            break
        threading.Event().wait(0.01)
    assert "bad frame" in caplog.text and why in caplog.text


def test_huge_numbers_get_error_replies(inproc, sentinel):
    probe = stress.WireProbe(inproc.socket_path)
    try:
        probe.request("open", {"uri": "h", "version": 1, "text": "abc"})
        for offset in (2**63 - 1, -(2**63), 2**64 - 1):
            reply = probe.request("complete", {"uri": "h", "version": 1, "offset": offset})
            assert reply["e"]["code"] == wire.Code.BAD_REQUEST and "offset" in reply["e"]["message"]
        reply = probe.request("change", {"uri": "h", "version": 2, "edits": [[0, 2**64 - 1, "x"]]})
        assert reply["e"]["code"] == wire.Code.UNKNOWN_DOCUMENT and "resend" in reply["e"]["message"]
        reply = probe.request("complete", {"uri": "h", "version": 2**64 - 1, "offset": 0})
        assert reply["e"]["code"] == wire.Code.UNKNOWN_DOCUMENT
    finally:
        probe.close()


def test_random_frame_run(inproc):
    """The long script's generator, bounded: 1,500 frames of every kind."""
    report = stress.fuzz_wire(inproc.socket_path, 1500, seed=random.randrange(1 << 30))
    assert report["frames_tried"] == 1500
    assert set(report["kinds"]) >= {"message", "mutated", "bad-utf8", "deep", "huge", "length"}
    assert report["outcomes"].get("closed", 0) > 0 and sum(v for k, v in report["outcomes"].items()
                                                          if k.startswith("error-")) > 0


@pytest.mark.slow
def test_real_daemon_process_survives_fuzzing(tiny_model_dir, tmp_path):
    """The same against a `completiond serve` process on the tiny model: zero exits, completions still served."""
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    proc = stress.start_daemon(str(tiny_model_dir), runtime)
    try:
        report = stress.fuzz_wire(paths.socket_path(runtime / "completiond"), 400, seed=7)
        assert report["frames_tried"] == 400
        assert proc.poll() is None, "the daemon exited"
    finally:
        proc.kill()
        proc.wait()
        stress.kill_daemon_in(runtime)
