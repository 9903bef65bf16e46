"""Prefetch: the daemon prefills the prompts a document's next requests start with while the engine has
nothing else to do (completion/warmup.py does the warming, through the Completer's `warmup`).

When a document is noted, and where:
* opened (didOpen): at once, from its top;
* the cursor rests (`rest`, the plugins' `completiond/cursorRest` through the LSP server): at once, there;
* edited or asked about: REST_S after the last edit or request in it, where that was. A plain LSP client
  thus gets prefetches too, and while the user types nothing is warmed between keystrokes.
The newest note goes first: a walk under way for another document steps aside at its next prefill chunk
(it waits in the queue and resumes later), so a rest is warmed at once. A quiet spell's note (edit or request)
goes behind the notes of opens and rests: as the newest it pushed back the walk of a file opened just after a
request elsewhere. A document's older note is replaced, and its running walk dropped when it is edited or noted
elsewhere. The prefix cache is one LRU within cacheMegabytes: a walk may evict only when its
note is newer than every walk before it; an older note's walk (the rest of a burst of opens) fills free room and
stops there, so the newest document's prefixes stay.

The scheduler runs `step` in its "prefetch" slot, before a new model's calibration, only when no request
waits (serving/scheduler.py). A request that arrives cancels the running piece's token; the warm-up checks
it between its small prefill chunks (Engine.warm), so the request waits at most one chunk, and it then
reuses whatever the warm-up finished: the same KV a cold prefill computes, so the same suggestion.
Around a cursor, once the whole prompt there is cached, the piece after is the answer at that cursor
(AnswerAhead), kept in the daemon's last answers for the request that comes from there; a request that
preempts it waits for one decoding round.
A failing warm-up is logged and dropped; it never fails a request or the worker.

COMPLETIOND_PREFETCH=0 turns it off (to measure what it brings: `completiond bench --editing --prefetch off`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from completiond.completion.completer import Backend, Completer
from completiond.config import Config
from completiond.serving.documents import Documents, gate_path, uri_path
from completiond.serving.scheduler import Scheduler

log = logging.getLogger(__name__)

MAX_DOCUMENTS = 8  # documents waiting for a warm-up; the oldest note is dropped first
REST_S = 0.3  # quiet time after an edit or a request in a document before it is warmed there

Key = tuple[Hashable, str]  # (client, uri)
# make(key, offset) on the worker: the document's warm-up (an object with step(cancel) -> more to do and a
# `warmed` token count), or None where it may not or cannot be warmed. offset None: from the top.
MakeWarmup = Callable[[Key, "int | None"], Any]


def make_warmup(
    docs: Documents,
    completer: Completer | None,
    cfg: Config,
    key: Key,
    offset: int | None,
    unserved: Callable[[Completer, str | None, str | None], str],
    run: Callable[..., Any] | None = None,
) -> Any:
    """Worker thread: the warm-up of `key` (completion/warmup.py) for the settings `cfg`, with the context block a
    request there would get; None where it may not (the privacy gate; a language the model does not serve:
    `unserved` says why) or cannot run (a team server keeps its own cache). Around a cursor, with `run` (the
    Service's completion, Service._run): the answer there too, once its prompt is warm (AnswerAhead)."""
    client, uri = key
    doc = docs.get(client, uri)
    if doc is None or completer is None or completer.backend is not Backend.LOCAL:
        return None
    text, path, language = doc.text, uri_path(uri), doc.language_id or None
    if not docs.admission(client, cfg, gate_path(uri) or path).local_ok or unserved(completer, language, path):
        return None
    at = None if offset is None else min(offset, len(text))
    context = docs.context(
        client, cfg, path, language, text, at or 0, completer.budgets(cfg), completer.token_counter()
    )
    warmup = completer.warmup(text, at, cfg, path=path, language=language, context=context)
    if warmup is None or at is None or run is None:
        return warmup
    version = doc.version

    def answer(token: Any) -> None:
        if docs.get(client, uri) is not doc or doc.version != version:
            return  # edited or closed since: the walk is dropped anyway
        tree = doc.tree if getattr(cfg, "syntax_check", True) else None
        run(text, at, cfg, token, path, language, client, gate_path=gate_path(uri), tree=tree)

    return AnswerAhead(warmup, answer)


class AnswerAhead:
    """A warm-up around a cursor, then, once the whole prompt at that cursor is cached, the answer there,
    computed as a request computes it and kept in the daemon's last answers (serving/results.py): the request
    that comes from a resting cursor asks that very question and is answered without a run. `answer(cancel)`
    runs once; preempted, it keeps nothing (Service._run keeps no cancelled run) and is not tried again."""

    def __init__(self, warmup: Any, answer: Callable[[Any], Any]):
        self.warmup = warmup
        self._answer = answer
        self.answered = False

    @property
    def warmed(self) -> int:
        return int(self.warmup.warmed)

    @property
    def may_evict(self) -> bool:
        return bool(getattr(self.warmup, "may_evict", True))

    @may_evict.setter
    def may_evict(self, value: bool) -> None:
        if hasattr(self.warmup, "may_evict"):
            self.warmup.may_evict = value

    def _due(self) -> bool:
        return not self.answered and bool(getattr(self.warmup, "cursor_warm", False))

    def step(self, cancel: Any = None) -> bool:
        if self._due():
            self.answered = True
            self._answer(cancel)
            return True  # the walk's rest, if any, in the next piece
        more = bool(self.warmup.step(cancel))
        return more or self._due()


def enabled() -> bool:
    return os.environ.get("COMPLETIOND_PREFETCH", "1").strip().lower() not in ("0", "false", "no", "off")


class Prefetcher:
    """Notes documents and warms the newest. `note`, `touch`, `forget` run on the event loop thread (`note`
    and `forget` from any thread); `step` runs on the engine's worker thread."""

    def __init__(
        self,
        scheduler: Scheduler,
        make: MakeWarmup,
        loop: Callable[[], asyncio.AbstractEventLoop | None],
        on: bool | None = None,
    ):
        self.scheduler = scheduler
        self._make = make
        self._loop = loop
        self.on = enabled() if on is None else on
        self._lock = threading.Lock()
        self._queue: OrderedDict[Key, int | None] = OrderedDict()
        self._current: tuple[Key, int | None, Any] | None = None
        # The note whose warm-up the worker is making (outside the lock: the context block may take a while).
        # It counts as running: between the note leaving the queue and its walk starting, nothing looked under
        # way, and a caller that waited for the prefetch to settle read the counters before the walk began.
        self._making: tuple[Key, int | None] | None = None
        # Each note's serial: a walk may make room in the KV cache (evict) only when its note is newer than every
        # walk before it. Notes walked newest first would otherwise evict the newest document's prefixes for
        # older ones' (20 files opened at once kept the oldest few).
        self._serial = 0
        self._serials: dict[Key, int] = {}
        self._walked = 0  # the newest serial walked
        self._current_serial = 0  # the running walk's note's serial (it keeps it when a newer note sets it aside)
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        self.counts = {
            "notes": 0,
            "started": 0,
            "finished": 0,
            "preempted": 0,
            "failed": 0,
            "dropped": 0,
            "set_aside": 0,
            "warmed_tokens": 0,
        }

    # --- what is noted (event loop) ------------------------------------------------

    def note(self, key: Key, offset: int | None = None, *, quiet: bool = False) -> None:
        """Warm `key` next: from its top (offset None: just opened) or around `offset` (the cursor rests).
        quiet: noted by a quiet spell after an edit or a request (`touch`), not by the user's move."""
        if not self.on:
            return
        with self._lock:
            current = self._current
            under_way = (current[0], current[1]) if current is not None else self._making
            if under_way == (key, offset) and key not in self._queue:
                return  # that very walk is under way
            self.counts["notes"] += 1
            self._drop(key)
            preempt = False
            if quiet and (self._queue or (under_way is not None and under_way[0] != key)):
                # A quiet spell's note waits behind what the user opened or rests in: as the newest it pushed
                # back the walk of a file opened just after a request elsewhere (nothing warmed by its first
                # request). It goes first among the queued notes' turns only once they are done.
                self._queue[key] = offset
                self._queue.move_to_end(key, last=False)
                self._serial += 1
                self._serials[key] = self._serial
                self._trim()
                return
            if current is not None and current[0] != key:
                # The newest note goes first (a resting cursor is where the next request comes from): the walk
                # under way steps aside at its next chunk and waits in the queue, just older than this note.
                self._current = None
                self._queue[current[0]] = current[1]
                self._serials[current[0]] = self._current_serial
                self.counts["set_aside"] += 1
                preempt = True
            elif self._making is not None and self._making[0] != key:
                self._queue[self._making[0]] = self._making[1]  # as above, for a walk still being made
                self._serials[self._making[0]] = self._current_serial
                self._making = None
                self.counts["set_aside"] += 1
            preempt = preempt or under_way is not None
            self._queue[key] = offset
            self._serial += 1
            self._serials[key] = self._serial
            self._trim()
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        # A fresh bound method each time: the worker drops the slot only if it still holds the step that
        # found nothing left, never one registered after it.
        self.scheduler.set_idle(self.step, "prefetch")
        if preempt:
            # A piece of the older (or stale) walk may be running: it lets go at its next prefill chunk.
            self.scheduler.preempt_idle("prefetch")

    def touch(self, key: Key, offset: int) -> None:
        """The document was edited or asked about at `offset`: warm there once it has been quiet for REST_S
        (what was queued or running for it is stale now). Without an event loop: at once."""
        if not self.on:
            return
        with self._lock:
            self._drop(key)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        loop = self._loop()
        if loop is None or loop.is_closed():
            self.note(key, offset, quiet=True)
            return
        self._timers[key] = loop.call_later(REST_S, self._rested, key, offset)

    def _rested(self, key: Key, offset: int) -> None:
        self._timers.pop(key, None)
        self.note(key, offset, quiet=True)

    def forget(self, key: Key) -> None:
        """The document closed (or its editor left): nothing more for it."""
        with self._lock:
            self._drop(key)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def forget_client(self, client: Hashable) -> None:
        with self._lock:
            keys = {k for k in self._queue if k[0] == client} | set(k for k in self._timers if k[0] == client)
            if self._current is not None and self._current[0][0] == client:
                keys.add(self._current[0])
        for key in keys:
            self.forget(key)

    def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    def _trim(self) -> None:
        """Under the lock: the oldest notes beyond MAX_DOCUMENTS go."""
        while len(self._queue) > MAX_DOCUMENTS:
            old, _ = self._queue.popitem(last=False)
            self._serials.pop(old, None)
            self.counts["dropped"] += 1

    def _drop(self, key: Key) -> None:
        """Under the lock: `key`'s queued note and running walk go (the worker finishes its piece)."""
        self._queue.pop(key, None)
        self._serials.pop(key, None)
        if self._current is not None and self._current[0] == key:
            self._current = None
        if self._making is not None and self._making[0] == key:
            self._making = None

    @property
    def pending(self) -> bool:
        with self._lock:
            return self._current is not None or self._making is not None or bool(self._queue)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(
                self.counts,
                on=self.on,
                queued=len(self._queue),
                running=self._current is not None or self._making is not None,
                resting=len(self._timers),
            )

    # --- the warming (worker thread) ------------------------------------------------

    def step(self, token: Any) -> bool:
        """One bounded piece of warming (a few of the engine's small prefill chunks); whether more remains."""
        with self._lock:
            current = self._current
            if current is None:
                if not self._queue:
                    return False
                key, offset = self._queue.popitem(last=True)  # the newest note first
                making = self._making = (key, offset)
                serial = self._current_serial = self._serials.pop(key, 0)
                newest = serial > self._walked
                self._walked = max(self._walked, serial)
        if current is None:
            try:
                warmup = self._make(key, offset)
            except Exception:  # a warm-up is a nicety: it never takes the worker down
                log.exception("prefetch of %s failed", key[1])
                warmup = None
                with self._lock:
                    self.counts["failed"] += 1
            with self._lock:
                still = self._making is making  # not noted again, edited or closed meanwhile
                if still:
                    self._making = None
                if warmup is None:
                    return self._current is not None or bool(self._queue)
                self.counts["started"] += 1
                if not still:  # a newer note's walk replaces this one; a closed document has none
                    return self._current is not None or bool(self._queue)
                current = self._current = (key, offset, warmup)
            if hasattr(warmup, "may_evict"):
                warmup.may_evict = newest  # an older note's walk only fills the cache's free room
        warmup = current[2]
        before = int(warmup.warmed)
        failed = False
        try:
            more = bool(warmup.step(token))
        except Exception:
            log.exception("prefetch of %s failed", current[0][1])
            more, failed = False, True
        with self._lock:
            self.counts["failed"] += failed
            self.counts["warmed_tokens"] += int(warmup.warmed) - before
            if token is not None and token.cancelled:
                self.counts["preempted"] += 1
            if not more:
                self.counts["finished"] += 1
                if self._current is current:
                    self._current = None
            return self._current is not None or bool(self._queue)
