"""Latest-wins scheduling, cancellation and fairness, with a fake engine (no model)."""

from __future__ import annotations

import asyncio
import functools
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from completiond import config
from completiond.models.tiny import build_tokenizer
from completiond.serving.service import Service, ServiceError
from completiond.serving.scheduler import CANCELLED, OK, Job, Overloaded, Scheduler
from completiond.serving.wire import Code


@functools.lru_cache(maxsize=1)
def fake_tokenizer():
    """A real byte-level BPE (the tiny models' tokenizer, trained in a moment): the real prompt
    pipeline accepts it, so fakes exercise the same path as real models. Its EOS is id 0."""
    from transformers import AutoTokenizer

    directory = Path(tempfile.mkdtemp(prefix="completiond-fake-tokenizer-"))
    build_tokenizer(directory)
    tok = AutoTokenizer.from_pretrained(directory)
    assert tok.eos_token_id == 0
    return tok


@dataclass
class FakeStats:
    prompt_tokens: int
    reused_tokens: int
    rounds: int = 0
    generated_tokens: int = 0

    def to_dict(self):
        return {"prompt_tokens": self.prompt_tokens, "reused_tokens": self.reused_tokens, "rounds": self.rounds,
                "generated_tokens": self.generated_tokens, "alpha": 0.5, "tokens_per_s": 100.0}


@dataclass
class FakeGeneration:
    tokens: list
    finish_reason: str
    stats: FakeStats


@dataclass
class FakeEngine:
    """Generates `continuation` a few characters per round, sleeping `round_s` per round."""

    continuation: str = "x = 1\n"
    per_round: int = 2
    round_s: float = 0.0
    tokenizer: Any = field(default_factory=fake_tokenizer)
    model_id: str = "fake"
    name: str = "fake"
    device: str = "cpu"
    calibration: Any = None     # nothing to calibrate in the background
    model: Any = None
    cache: Any = None
    eos_token_ids: set = field(default_factory=lambda: {0})
    max_context: int = 4096
    calls: list = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    last_prompt: list = field(default_factory=list)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def draft_in_use(self):
        return None

    def decode_step_in_use(self):
        return None

    def tokenizer_in_use(self):
        return None

    def generate(self, prompt_ids, params, cancel=None, on_round=None, stop=None, constraint=None):
        reused = 0
        for a, b in zip(self.last_prompt, prompt_ids):
            if a != b:
                break
            reused += 1
        self.last_prompt = list(prompt_ids)
        stats = FakeStats(prompt_tokens=len(prompt_ids), reused_tokens=reused)
        self.calls.append(stats)
        self.started.set()
        script = self.tokenizer.encode(self.continuation) + [0]
        out: list[int] = []
        finish = "length"
        while len(out) < params.max_tokens:
            if cancel is not None and cancel.cancelled:
                finish = "cancelled"
                break
            time.sleep(self.round_s)
            stats.rounds += 1
            new = script[len(out):len(out) + self.per_round]
            if 0 in new:
                out += new[:new.index(0)]
                finish = "eos"
                break
            out += new
            if stop is not None and (keep := stop(out)) is not None:
                del out[keep:]
                finish = "stop"
                break
            if on_round:
                on_round(list(out))
        stats.generated_tokens = len(out)
        return FakeGeneration(out, finish, stats)


def local(engine):
    """A Service loader serving `engine` (a fake or a real one) through the local Completer."""
    from completiond.completion.suggest import LocalCompleter

    return lambda _cfg, **_hooks: LocalCompleter(engine)


def make_job(sched_results, key, client, rid, run):
    def done(outcome):
        sched_results[rid] = outcome
    return Job(key=key, client=client, request_id=rid, run=run, done=done)


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_queued_job_superseded_without_running():
    sched = Scheduler()
    gate = threading.Event()
    ran = []
    results = {}
    try:
        sched.submit(make_job(results, "other", "c", 0, lambda tok: gate.wait(5)))
        wait_for(lambda: sched.snapshot()["running"])
        sched.submit(make_job(results, "doc", "c", 1, lambda tok: ran.append(1)))
        sched.submit(make_job(results, "doc", "c", 2, lambda tok: ran.append(2) or "two"))
        assert results[1].status == CANCELLED and results[1].reason == "superseded"
        gate.set()
        wait_for(lambda: 2 in results)
        assert results[2].status == OK and results[2].value == "two"
        assert ran == [2]
    finally:
        sched.stop()


def test_running_job_cancelled_by_newer_request():
    sched = Scheduler()
    results = {}
    started = threading.Event()

    def slow(token):
        started.set()
        while not token.cancelled:
            time.sleep(0.001)
        return "partial"

    try:
        sched.submit(make_job(results, "doc", "c", 1, slow))
        assert started.wait(5)
        sched.submit(make_job(results, "doc", "c", 2, lambda tok: "fresh"))
        wait_for(lambda: 2 in results)
        assert results[1].status == CANCELLED and results[1].reason == "superseded"
        assert results[2].value == "fresh"
        assert sched.counts["superseded_running"] == 1
    finally:
        sched.stop()


def test_cancel_by_id_queued_and_running():
    sched = Scheduler()
    results = {}
    started = threading.Event()

    def slow(token):
        started.set()
        while not token.cancelled:
            time.sleep(0.001)

    try:
        sched.submit(make_job(results, "a", "c", 1, slow))
        assert started.wait(5)
        sched.submit(make_job(results, "b", "c", 2, lambda tok: "b"))
        assert sched.cancel(2)
        assert results[2].status == CANCELLED
        assert sched.cancel(1)
        wait_for(lambda: 1 in results)
        assert results[1].status == CANCELLED and results[1].reason == "cancelled"
        assert not sched.cancel(99)
    finally:
        sched.stop()


def test_round_robin_across_clients():
    sched = Scheduler()
    gate = threading.Event()
    order = []
    results = {}
    try:
        sched.submit(make_job(results, "block", "z", 0, lambda tok: gate.wait(5)))
        wait_for(lambda: sched.snapshot()["running"])
        for i in range(3):
            sched.submit(make_job(results, f"a{i}", "A", f"a{i}", lambda tok, i=i: order.append(f"a{i}")))
        sched.submit(make_job(results, "b0", "B", "b0", lambda tok: order.append("b0")))
        gate.set()
        wait_for(lambda: len(order) == 4)
        assert order.index("b0") <= 1, order
    finally:
        sched.stop()


def test_overloaded_only_when_the_editors_own_share_is_full():
    """Issue 16 item 8: one local process with many connections used to fill the global 64-job queue,
    and every request of the editor was then refused. Now each client has its own share."""
    sched = Scheduler(max_pending_per_client=2)
    gate = threading.Event()
    results = {}
    try:
        sched.submit(make_job(results, "block", "z", 0, lambda tok: gate.wait(5)))
        wait_for(lambda: sched.snapshot()["running"])
        rid = 100
        for hog in range(40):                          # 80 queued jobs from 40 other clients
            for doc in range(2):
                rid += 1
                sched.submit(make_job(results, ("hog", hog, doc), ("hog", hog), rid, lambda tok: None))
        with pytest.raises(Overloaded, match="this editor's completion queue is full"):
            sched.submit(make_job(results, ("hog", 0, 9), ("hog", 0), 999, lambda tok: None))
        sched.submit(make_job(results, "d1", "A", 1, lambda tok: None))     # the editor: still accepted
        sched.submit(make_job(results, "d2", "A", 2, lambda tok: None))
        with pytest.raises(Overloaded):
            sched.submit(make_job(results, "d3", "A", 3, lambda tok: None))
        # Superseding an already-queued document is always allowed: it does not grow the queue.
        sched.submit(make_job(results, "d2", "A", 4, lambda tok: None))
        gate.set()
        wait_for(lambda: all(k in results for k in (0, 1, 2, 4)) and len(results) == 84)
        assert results[2].reason == "superseded" and results[1].status == results[4].status == OK
    finally:
        sched.stop()


def test_queued_work_has_a_deadline():
    """Issue 16 item 8: a request queued behind long work waited 70 s. Past the deadline it is
    answered ("expired") instead of run, by the timer while the worker is busy, or by the worker."""
    now = [0.0]
    sched = Scheduler(queue_deadline=10.0, clock=lambda: now[0])
    gate = threading.Event()
    results, ran = {}, []
    try:
        sched.submit(make_job(results, "long", "z", 0, lambda tok: gate.wait(5)))
        wait_for(lambda: sched.snapshot()["running"])
        sched.submit(make_job(results, "a", "A", 1, lambda tok: ran.append("a")))
        now[0] = 9.0
        assert sched.expire() == 0 and 1 not in results
        now[0] = 10.5
        assert sched.expire() == 1                                      # the timer's path
        assert results[1].status == CANCELLED and results[1].reason == "expired"
        sched.submit(make_job(results, "b", "B", 2, lambda tok: ran.append("b")))
        sched.submit(make_job(results, "c", "C", 3, lambda tok: ran.append("c")))
        now[0] = 30.0
        sched.submit(make_job(results, "d", "D", 4, lambda tok: ran.append("d")))   # fresh: queued at 30
        gate.set()                                                      # the worker's path
        wait_for(lambda: all(k in results for k in (0, 2, 3, 4)))
        assert [results[k].reason for k in (2, 3)] == ["expired", "expired"]
        assert results[4].status == OK and ran == ["d"]
        assert sched.snapshot()["expired_queued"] == 3
    finally:
        sched.stop()


def test_waiting_for_the_model_load_does_not_count_against_the_deadline():
    now = [0.0]
    sched = Scheduler(queue_deadline=10.0, clock=lambda: now[0])
    loading, loaded = threading.Event(), threading.Event()
    results, ran = {}, []
    try:
        sched.call(lambda: (loading.set(), loaded.wait(5)), lambda outcome: None)
        assert loading.wait(5)
        sched.submit(make_job(results, "a", "A", 1, lambda tok: ran.append("a")))
        now[0] = 100.0                                  # a slow model load
        assert sched.expire() == 0
        loaded.set()
        wait_for(lambda: 1 in results)
        assert results[1].status == OK and ran == ["a"]
    finally:
        sched.stop()


async def test_service_answers_expired_requests_overloaded():
    engine = FakeEngine(continuation="x = 1\n", per_round=1, round_s=0.05)
    service = await ready_service(engine)
    try:
        service.open(1, "file:///w/a.py", 1, "x = ", "python")
        service.open(2, "file:///w/b.py", 1, "y = ", "python")
        first = asyncio.ensure_future(service.complete(1, 1, "file:///w/a.py", 1, 4))
        assert await asyncio.to_thread(engine.started.wait, 10)      # the worker is busy with it
        service.scheduler.queue_deadline = 0.0                         # so the next one is overdue at once
        with pytest.raises(ServiceError) as err:
            await service.complete(2, 1, "file:///w/b.py", 1, 4)
        assert err.value.code == Code.OVERLOADED and "waited" in err.value.message
        assert service.stats()["expired"] >= 1
        await asyncio.wait_for(asyncio.gather(first, return_exceptions=True), 30)
    finally:
        service.shutdown()


def test_job_exception_does_not_kill_worker():
    sched = Scheduler()
    results = {}
    try:
        sched.submit(make_job(results, "a", "c", 1, lambda tok: 1 / 0))
        sched.submit(make_job(results, "b", "c", 2, lambda tok: "ok"))
        wait_for(lambda: 2 in results)
        assert results[1].status == "error" and isinstance(results[1].value, ZeroDivisionError)
        assert results[2].value == "ok"
    finally:
        sched.stop()


def test_stop_answers_queued_jobs():
    sched = Scheduler()
    gate = threading.Event()
    results = {}
    sched.submit(make_job(results, "block", "z", 0, lambda tok: gate.wait(0.2)))
    wait_for(lambda: sched.snapshot()["running"])
    sched.submit(make_job(results, "a", "c", 1, lambda tok: None))
    sched.stop()
    assert results[1].status == CANCELLED and results[1].reason == "shutdown"


# --- the Service: documents + scheduler + completion glue, fake engine ---------------------------


async def ready_service(engine: FakeEngine, **kw) -> Service:
    # The fake ignores the healing constraint, so its scripted text is what the user sees.
    cfg, _ = config.merge(config.Config(), {"maxTokens": 16, "tokenHealing": False})
    service = Service(cfg, loader=local(engine), **kw)
    service.start_loading()
    for _ in range(500):
        if service.state == "ready":
            return service
        await asyncio.sleep(0.01)
    raise AssertionError(f"service never ready: {service.state} {service.error}")


async def test_service_completes_with_version():
    service = await ready_service(FakeEngine(continuation="urn a + b\nmore"))
    try:
        text = "def add(a, b):\n    ret"
        service.open(1, "file:///a.py", 3, text)
        result = await service.complete(1, 1, "file:///a.py", 3, len(text))
        assert result["version"] == 3
        assert result["suggestion"]["text"] == "urn a + b"
        assert result["suggestion"]["start"] == result["suggestion"]["end"] == len(text)
    finally:
        service.shutdown()


async def test_service_rejects_stale_version_and_unknown_document():
    service = await ready_service(FakeEngine())
    try:
        service.open(1, "file:///a.py", 1, "x")
        service.change(1, "file:///a.py", 2, [[1, 1, "y"]])
        with pytest.raises(ServiceError) as err:
            await service.complete(1, 1, "file:///a.py", 1, 1)
        assert err.value.code == Code.UNKNOWN_DOCUMENT
        with pytest.raises(ServiceError) as err:
            await service.complete(1, 2, "file:///b.py", 1, 0)
        assert err.value.code == Code.UNKNOWN_DOCUMENT
        # A bad edit desynchronises the document: it is dropped so the client resends it.
        with pytest.raises(ServiceError):
            service.change(1, "file:///a.py", 3, [[5, 9, "z"]])
        assert (1, "file:///a.py") not in service.documents
    finally:
        service.shutdown()


async def test_service_burst_only_last_completes():
    engine = FakeEngine(continuation="abcdefghijklmnopqrstuvwxyz", per_round=1, round_s=0.01)
    service = await ready_service(engine)
    try:
        text = "x = "
        service.open(1, "u", 0, text)
        tasks = []
        for i in range(20):
            text += "a"
            service.change(1, "u", i + 1, [[len(text) - 1, len(text) - 1, "a"]])
            tasks.append(asyncio.ensure_future(service.complete(1, i, "u", i + 1, len(text))))
            await asyncio.sleep(0.002)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert len(results) == 20
        done = [r for r in results if isinstance(r, dict)]
        cancelled = [r for r in results if isinstance(r, ServiceError) and r.code == Code.CANCELLED]
        assert len(done) == 1 and len(cancelled) == 19
        assert done[0]["version"] == 20
        stats = service.stats()
        assert stats["superseded"] == 19
        assert stats["wasted_rounds_per_superseded"] <= 1.0
    finally:
        service.shutdown()


async def test_service_cancel_stops_engine_promptly():
    engine = FakeEngine(continuation="a" * 1000, per_round=1, round_s=0.005)
    service = await ready_service(engine)
    try:
        cfg_tokens = {"maxTokens": 1000}
        service.open(1, "u", 0, "x = ")
        task = asyncio.ensure_future(service.complete(1, 7, "u", 0, 4, cfg_tokens))
        await asyncio.get_running_loop().run_in_executor(None, engine.started.wait, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if not service.scheduler.busy:
                break
            await asyncio.sleep(0.01)
        assert not service.scheduler.busy
        assert engine.calls[-1].rounds < 500
        assert service.stats()["cancelled"] == 1
    finally:
        service.shutdown()


async def test_service_load_failure_reports_error():
    def boom(_cfg, **_hooks):
        raise OSError("no such model: /nope")

    service = Service(config.Config(), loader=boom)
    statuses = []
    service.listeners.append(statuses.append)
    service.start_loading()
    for _ in range(300):
        if service.state == "error":
            break
        await asyncio.sleep(0.01)
    try:
        assert service.state == "error" and "/nope" in service.error
        assert [s["state"] for s in statuses][-1] == "error"
        service.open(1, "u", 0, "x")
        with pytest.raises(ServiceError) as err:
            await service.complete(1, 1, "u", 0, 0)
        assert err.value.code == Code.NOT_READY
    finally:
        service.shutdown()


async def test_service_feeds_workspace_context(tmp_path):
    engine = FakeEngine(continuation="z\n")
    service = await ready_service(engine)
    seen = []
    real_context = service.docs.context

    def spy(client, cfg, path, language, *rest):
        ctx = real_context(client, cfg, path, language, *rest)
        seen.append(ctx)
        return ctx

    service.docs.context = spy
    # The workspace's I/O thread is held busy: the editor's folders are not set up there when it opens a file
    # and asks at once, and the folders it announced count all the same (CI once lost this race).
    io_free = threading.Event()
    service.docs._ws().watcher.submit(io_free.wait, 10)
    try:
        # Only files inside the editor's workspace folders may be context for another file.
        service.notify(1, "workspace", {"folders": [str(tmp_path)]})
        other = tmp_path / "helpers.py"
        service.open(1, other.as_uri(), 1, "def helper_one():\n    return 41\n", "python")
        service.change(1, other.as_uri(), 2, [[29, 31, "42"]])
        current = tmp_path / "main.py"
        service.open(1, current.as_uri(), 1, "x = ", "python")
        await service.complete(1, 1, current.as_uri(), 1, 4, {"contextRetrieval": "off"})
        assert seen and seen[-1], "no context for a file with an open sibling"
        (path, snippet), = seen[-1]
        assert path.endswith("helpers.py") and "return 42" in snippet
        service.close(1, other.as_uri())
    finally:
        io_free.set()
        service.shutdown()


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["submit", "cancel"]), st.integers(0, 2), st.integers(0, 3)),
                min_size=1, max_size=40))
def test_every_job_answered_exactly_once(ops):
    """Whatever the interleaving of submits and cancels, each accepted job gets one answer."""
    sched = Scheduler(max_pending_per_client=3)
    answers: dict[int, list] = {}
    accepted = []
    cancelled_ids = set()
    lock = threading.Lock()

    def make(rid):
        def done(outcome):
            with lock:
                answers.setdefault(rid, []).append(outcome.status)
        return done

    try:
        for rid, (op, client, doc) in enumerate(ops):
            if op == "submit":
                job = Job(key=(client, doc), client=client, request_id=rid,
                          run=lambda tok: time.sleep(0.001) or "ok", done=make(rid))
                try:
                    sched.submit(job)
                    accepted.append(rid)
                except Overloaded:
                    pass
            elif accepted:
                target = accepted[doc % len(accepted)]
                cancelled_ids.add(target)
                sched.cancel(target)
        wait_for(lambda: len(answers) == len(accepted), timeout=10)
    finally:
        sched.stop()
    assert sorted(answers) == sorted(accepted)
    assert all(len(v) == 1 for v in answers.values()), answers
    # The newest job of every document is never superseded (it may only be cancelled explicitly).
    last_per_doc = {}
    for rid, (op, client, doc) in enumerate(ops):
        if rid in accepted:
            last_per_doc[(client, doc)] = rid
    for rid in last_per_doc.values():
        if rid not in cancelled_ids:
            assert answers[rid] == [OK]
