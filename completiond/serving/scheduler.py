"""Latest-wins scheduling of completion jobs onto the one engine thread.

The engine can do one thing at a time, and while the user types only the
newest request for a document matters. So:

* each document key holds at most one queued job; a newer job for the same key
  replaces it, and the replaced one is answered "cancelled" without running;
* a running job for that key has its cancel token set, so the engine stops it
  at the next round (the verified tokens stay in the KV cache for the next one);
* the worker serves clients round-robin and, within a client, documents in
  arrival order, so one busy editor cannot starve another;
* each client (editor connection) has its own bounded queue: `submit` raises
  Overloaded at once when that client's own share is full, never because other
  clients filled theirs (how many clients there are is the server's cap);
* queued work has a deadline: a job still waiting `queue_deadline` seconds after
  it was queued is answered "cancelled" with reason "expired" instead of run
  (`expire()`, called by the worker before each job and by the service's timer).
  Time spent behind a control call (the model load) does not count: the first
  requests of a session wait for the model, as they must.

Every job's `done` callback is called exactly once, outside the lock.

Background work runs on the same thread only when nothing else waits: `set_idle(step, slot)` registers
a function that does one bounded piece per call. Each kind has a slot, and the slots run in IDLE_SLOTS
order: prefetches (serving/prefetch.py: the prompt the user waits for next) before the calibration of a
new model. A job or control call that arrives meanwhile cancels the running piece's token, so it waits at
most one engine round or prefill chunk, and the next piece runs only once the queue is empty again.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from completiond.engine.cancel import CancelToken

log = logging.getLogger(__name__)

OK = "ok"
CANCELLED = "cancelled"
ERROR = "error"

IDLE_SLOTS = ("prefetch", "calibration")  # background work, the first slot with work first


class Overloaded(RuntimeError):
    pass


class ShuttingDown(RuntimeError):
    pass


@dataclass
class Outcome:
    status: str  # OK | CANCELLED | ERROR
    value: Any = None  # result for OK, exception for ERROR
    reason: str = ""  # for CANCELLED: "superseded" | "cancelled" | "shutdown"


@dataclass(eq=False)
class Job:
    key: Hashable  # the document: newer jobs with the same key supersede
    client: Hashable  # fairness unit
    request_id: Hashable  # unique across the scheduler
    run: Callable[[Any], Any]  # run(token) on the worker thread
    done: Callable[[Outcome], None]  # exactly once
    token: Any = None
    state: str = "new"  # new | queued | running | finished
    cancel_reason: str = ""
    queued_at: float = 0.0  # scheduler clock when it entered the queue
    _finished: bool = field(default=False, repr=False)


class Scheduler:
    def __init__(
        self,
        token_factory: Callable[[], Any] = CancelToken,
        max_pending_per_client: int = 16,
        queue_deadline: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        name: str = "completiond-engine",
    ):
        self._token_factory = token_factory
        self.max_pending_per_client = max_pending_per_client
        self.queue_deadline = queue_deadline
        self._clock = clock
        self._lock = threading.Condition()
        self._pending: dict[Hashable, Job] = {}  # key -> queued job
        self._by_id: dict[Hashable, Job] = {}  # request id -> queued/running job
        self._order: dict[Hashable, collections.deque] = {}  # client -> keys in arrival order
        self._ring: collections.deque = collections.deque()  # clients with queued work
        self._control: collections.deque = collections.deque()  # (fn, done) run before any job
        self._running: Job | None = None
        self._in_call = False  # a control call (model load) runs
        self._idle: dict[str, Callable[[Any], bool]] = {}  # slot -> background step(token) -> more
        self._idle_token: Any = None  # the running background step's token
        self._idle_slot = ""  # and its slot
        self._stopping = False
        self.counts: collections.Counter[str] = collections.Counter()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # --- submitting -------------------------------------------------------

    def set_token_factory(self, factory: Callable[[], Any]) -> None:
        self._token_factory = factory

    def submit(self, job: Job) -> None:
        """Queue `job`; raises Overloaded or ShuttingDown (its `done` is then not called)."""
        finished: list[tuple[Job, Outcome]] = []
        with self._lock:
            if self._stopping:
                raise ShuttingDown("the daemon is shutting down")
            old = self._pending.get(job.key)
            if old is None:
                client_pending = len(self._order.get(job.client, ()))
                if client_pending >= self.max_pending_per_client:
                    self.counts["rejected"] += 1
                    raise Overloaded(
                        f"this editor's completion queue is full ({client_pending} of its documents waiting, "
                        f"at most {self.max_pending_per_client}); try again"
                    )
            else:
                # Take the old job's place in the queue: it was waiting longer.
                self._by_id.pop(old.request_id, None)
                old.state = "finished"
                self.counts["superseded_queued"] += 1
                finished.append((old, Outcome(CANCELLED, reason="superseded")))
            running = self._running
            if running is not None and running.key == job.key and not running.cancel_reason:
                running.cancel_reason = "superseded"
                running.token.cancel()
            job.token = self._token_factory()
            job.state = "queued"
            self._preempt_idle()
            job.queued_at = self._clock()
            self._pending[job.key] = job
            self._by_id[job.request_id] = job
            self.counts["submitted"] += 1
            if old is None:
                order = self._order.setdefault(job.client, collections.deque())
                order.append(job.key)
                if job.client not in self._ring:
                    self._ring.append(job.client)
            self._lock.notify()
        self._finish_all(finished)

    def cancel(self, request_id: Hashable, reason: str = "cancelled") -> bool:
        """Cancel a queued or running job; False if it is unknown or already finished."""
        finished: list[tuple[Job, Outcome]] = []
        with self._lock:
            job = self._by_id.get(request_id)
            if job is None:
                return False
            if job.state == "queued":
                self._unqueue(job)
                self.counts["cancelled_queued"] += 1
                finished.append((job, Outcome(CANCELLED, reason=reason)))
            elif job.state == "running" and not job.cancel_reason:
                job.cancel_reason = reason
                job.token.cancel()
        self._finish_all(finished)
        return True

    def expire(self) -> int:
        """Answer every job queued longer than queue_deadline with CANCELLED/"expired"; how many."""
        finished: list[tuple[Job, Outcome]] = []
        with self._lock:
            if self._in_call:
                return 0
            now = self._clock()
            for job in [j for j in self._pending.values() if now - j.queued_at >= self.queue_deadline]:
                self._unqueue(job)
                self.counts["expired_queued"] += 1
                finished.append((job, Outcome(CANCELLED, reason="expired")))
        self._finish_all(finished)
        return len(finished)

    def cancel_client(self, client: Hashable, reason: str = "cancelled") -> None:
        with self._lock:
            ids = [rid for rid, job in self._by_id.items() if job.client == client]
        for rid in ids:
            self.cancel(rid, reason)

    def call(self, fn: Callable[[], Any], done: Callable[[Outcome], None]) -> None:
        """Run `fn` on the worker thread ahead of queued jobs (model loading, stats)."""
        with self._lock:
            if self._stopping:
                raise ShuttingDown("the daemon is shutting down")
            self._control.append((fn, done))
            self._preempt_idle()
            self._lock.notify()

    def set_idle(self, step: Callable[[Any], bool] | None, slot: str = "calibration") -> None:
        """Background work for moments with nothing queued, in `slot` (one of IDLE_SLOTS): step(token) does one
        bounded piece and returns whether more remains; it must stop soon once token is cancelled. None
        withdraws the slot's work (and cancels its running piece)."""
        if slot not in IDLE_SLOTS:
            raise ValueError(f"unknown background slot {slot!r}; expected one of {', '.join(IDLE_SLOTS)}")
        with self._lock:
            if step is None:
                self._idle.pop(slot, None)
                if self._idle_slot == slot:
                    self._preempt_idle()
            else:
                self._idle[slot] = step
            self._lock.notify()

    def idle_slots(self) -> list[str]:
        """The slots that have background work registered."""
        with self._lock:
            return [slot for slot in IDLE_SLOTS if slot in self._idle]

    def preempt_idle(self, slot: str) -> None:
        """The running background piece of `slot`, if one runs, stops at its next round or chunk (its work
        changed: the next piece starts from what the slot's step finds then)."""
        with self._lock:
            if self._idle_slot == slot:
                self._preempt_idle()

    def _preempt_idle(self) -> None:
        """Under the lock: a request arrived, so a running background piece stops at its next round."""
        if self._idle_token is not None:
            self._idle_token.cancel()

    # --- introspection ----------------------------------------------------

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._running is not None or bool(self._pending)

    def queued(self) -> int:
        with self._lock:
            return len(self._pending)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.counts, queued=len(self._pending), running=self._running is not None)

    # --- shutting down ----------------------------------------------------

    def stop(self, timeout: float | None = 5.0) -> None:
        finished: list[tuple[Job, Outcome]] = []
        with self._lock:
            self._stopping = True
            for job in list(self._pending.values()):
                self._unqueue(job)
                finished.append((job, Outcome(CANCELLED, reason="shutdown")))
            if self._running is not None and not self._running.cancel_reason:
                self._running.cancel_reason = "shutdown"
                self._running.token.cancel()
            self._idle.clear()
            self._preempt_idle()
            self._lock.notify_all()
        self._finish_all(finished)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # --- internals ---------------------------------------------------------

    def _unqueue(self, job: Job) -> None:
        self._pending.pop(job.key, None)
        self._by_id.pop(job.request_id, None)
        order = self._order.get(job.client)
        if order is not None:
            try:
                order.remove(job.key)
            except ValueError:
                pass
            if not order:
                del self._order[job.client]
                try:
                    self._ring.remove(job.client)
                except ValueError:
                    pass
        job.state = "finished"

    def _next(self) -> tuple[str, Any] | None:
        """Under the lock: the next control call or job, or None when stopping and idle."""
        while True:
            if self._control:
                self._in_call = True
                return "call", self._control.popleft()
            if self._ring:
                client = self._ring.popleft()
                order = self._order[client]
                key = order.popleft()
                if order:
                    self._ring.append(client)
                else:
                    del self._order[client]
                job = self._pending.pop(key)
                job.state = "running"
                self._running = job
                return "job", job
            if self._stopping:
                return None
            slot = next((s for s in IDLE_SLOTS if s in self._idle), None)
            if slot is not None:
                self._idle_token = self._token_factory()
                self._idle_slot = slot
                return "idle", (slot, self._idle[slot], self._idle_token)
            self._lock.wait()

    def _loop(self) -> None:
        while True:
            self.expire()
            with self._lock:
                item = self._next()
            if item is None:
                return
            kind, payload = item
            if kind == "idle":
                slot, step, token = payload
                try:
                    more = bool(step(token))
                except Exception:  # background work must never take the worker down
                    log.exception("background work (%s) failed", slot)
                    more = False
                with self._lock:
                    self._idle_token = None
                    self._idle_slot = ""
                    if not more and self._idle.get(slot) is step:
                        del self._idle[slot]
                continue
            if kind == "call":
                fn, done = payload
                try:
                    outcome = Outcome(OK, fn())
                except Exception as exc:  # the worker must survive anything a call raises
                    log.exception("worker call failed")
                    outcome = Outcome(ERROR, exc)
                with self._lock:
                    # The jobs that waited for this call (the model load) start their deadline now.
                    self._in_call = False
                    now = self._clock()
                    for waiting in self._pending.values():
                        waiting.queued_at = max(waiting.queued_at, now)
                self._safe_done(done, outcome)
                continue
            job: Job = payload
            try:
                value = job.run(job.token)
                outcome = Outcome(OK, value)
            except Exception as exc:  # one bad request never takes the worker down
                log.exception("completion job %r failed", job.request_id)
                outcome = Outcome(ERROR, exc)
            with self._lock:
                self._running = None
                self._by_id.pop(job.request_id, None)
                job.state = "finished"
                if job.cancel_reason and outcome.status == OK:
                    # The value may still be partial output; callers decide. Count what happened.
                    self.counts[f"{job.cancel_reason}_running"] += 1
                elif outcome.status == OK:
                    self.counts["completed"] += 1
            if job.cancel_reason and outcome.status == OK:
                outcome = Outcome(CANCELLED, outcome.value, reason=job.cancel_reason)
            self._finish(job, outcome)

    def _finish_all(self, items: list[tuple[Job, Outcome]]) -> None:
        for job, outcome in items:
            self._finish(job, outcome)

    def _finish(self, job: Job, outcome: Outcome) -> None:
        if job._finished:
            return
        job._finished = True
        self._safe_done(job.done, outcome)

    @staticmethod
    def _safe_done(done: Callable[[Outcome], None], outcome: Outcome) -> None:
        try:
            done(outcome)
        except Exception:
            log.exception("completion callback failed")
