"""The daemon's last answers (serving/results.py): a request that asks exactly what was answered before (a switch
back to a file, an editor asking again) gets that answer without a model run, and it is the answer a cold run
gives; any change to what an answer depends on (text, cursor, settings, context block, model) asks the model
again, and a cancelled run is never kept."""

from __future__ import annotations

import asyncio
import time

from completiond import config
from completiond.serving.results import Results, key

URI = "file:///work/orders.py"
TEXT = "".join(f"def order_{i}(items, rate):\n    total = sum(items) * {i}\n    return total * rate\n\n" for i in range(40))
SETTINGS = {"device": "cpu", "maxTokens": 8}


def _line_end(text: str, line: int) -> int:
    lines = text.split("\n")
    return sum(len(x) + 1 for x in lines[:line]) + len(lines[line])


class _Owner:
    """A stand-in completer: Results only asks who it is."""


def test_the_key_holds_everything_an_answer_depends_on():
    cfg = config.Config()
    base = key(TEXT, 10, cfg, "a.py", "python", [("b.py", "x = 1")])
    assert base == key(TEXT, 10, cfg, "a.py", "python", [("b.py", "x = 1")])
    changed = [
        key(TEXT + " ", 10, cfg, "a.py", "python", [("b.py", "x = 1")]),
        key(TEXT, 11, cfg, "a.py", "python", [("b.py", "x = 1")]),
        key(TEXT, 10, config.merge(cfg, {"maxTokens": 9})[0], "a.py", "python", [("b.py", "x = 1")]),
        key(TEXT, 10, cfg, "c.py", "python", [("b.py", "x = 1")]),
        key(TEXT, 10, cfg, "a.py", "go", [("b.py", "x = 1")]),
        key(TEXT, 10, cfg, "a.py", "python", [("b.py", "x = 2")]),
        key(TEXT, 10, cfg, "a.py", "python", [("b.p", "yx = 1")]),  # the same characters, cut elsewhere
        key(TEXT, 10, cfg, "a.py", "python", []),
    ]
    assert all(k != base for k in changed) and len(set(changed)) == len(changed)


def test_answers_are_one_completers_and_the_oldest_go_first():
    store, owner = Results(entries=3), _Owner()
    for n in range(4):
        store.put(owner, ("k", n), {"suggestion": n})
    assert store.get(owner, ("k", 0)) is None  # the oldest went
    assert [store.get(owner, ("k", n))["suggestion"] for n in (1, 2, 3)] == [1, 2, 3]
    got = store.get(owner, ("k", 1))
    got["suggestion"] = "changed"  # a copy: the caller's edits do not reach the store
    assert store.get(owner, ("k", 1))["suggestion"] == 1
    assert store.get(_Owner(), ("k", 1)) is None  # another model (a reload): nothing of the old one's
    assert store.get(owner, ("k", 1)) is None


async def _until(predicate, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _service():
    from completiond.serving.service import Service

    service = Service(config.merge(config.Config(), SETTINGS)[0])
    service.prefetch.on = False  # nothing warmed between requests: every run is a cold one or a repeat
    service.start_loading()
    await _until(lambda: service.state not in ("idle", "loading"))
    assert service.state == "ready", service.error
    return service


async def test_asking_again_gets_the_cold_answer_without_a_model_run():
    first, cold = await _service(), await _service()
    try:
        offsets = [_line_end(TEXT, 30), _line_end(TEXT, 5)]
        for s in (first, cold):
            s.open("c", URI, 1, TEXT, "python")
        answers = [await first.complete("c", n, URI, 1, off) for n, off in enumerate(offsets)]
        assert all(not a["stats"].get("result_cache") for a in answers)
        again = [await first.complete("c", 10 + n, URI, 1, off) for n, off in enumerate(offsets)]
        for a, b in zip(answers, again):
            assert b["stats"] == {"result_cache": True}
            assert b["suggestions"] == a["suggestions"] and b["finish_reason"] == a["finish_reason"]
        counts = first.metrics.counts
        assert counts["result_hits"] == 2 and counts["completed"] == 4
        prompt_tokens = counts["prompt_tokens"]  # a repeat runs no prompt: the counters show only the two runs
        assert prompt_tokens == sum(a["stats"]["prompt_tokens"] for a in answers)
        # What a daemon that never saw these questions answers (a cold prefill of each prompt)
        for n, off in enumerate(offsets):
            assert (await cold.complete("c", n, URI, 1, off))["suggestions"] == again[n]["suggestions"]
        # Anything it depends on changed: the model runs again
        changed = await first.complete("c", 20, URI, 1, offsets[0], {"maxTokens": 4})
        assert not changed["stats"].get("result_cache")
        first.change("c", URI, 2, [(0, 0, "# orders\n")])
        edited = await first.complete("c", 21, URI, 2, offsets[0] + len("# orders\n"))
        assert not edited["stats"].get("result_cache") and first.metrics.counts["result_hits"] == 2
    finally:
        first.shutdown()
        cold.shutdown()


async def test_a_cancelled_run_is_not_kept():
    service = await _service()
    try:
        service.open("c", URI, 1, TEXT, "python")

        class Cancelled:
            cancelled = True

        offset = _line_end(TEXT, 12)
        service._run(TEXT, offset, service.cfg, Cancelled(), "/work/orders.py", "python", "c")
        assert not service.results._answers
        got = await service.complete("c", 1, URI, 1, offset)
        assert not got["stats"].get("result_cache")
    finally:
        service.shutdown()



async def test_a_resting_cursor_is_answered_ahead_as_a_cold_run_answers():
    # The warm-up of a rest ends with the answer at that cursor (prefetch.AnswerAhead): the request that comes from
    # there is a repeat, and it is what a daemon that never warmed anything answers.
    warm, cold = await _service(), await _service()
    warm.prefetch.on = True
    try:
        for s in (warm, cold):
            s.open("c", URI, 1, TEXT, "python")
        await warm.complete("c", 1, URI, 1, _line_end(TEXT, 3))  # an editor's request first: its settings, a tree
        await _until(lambda: not warm.prefetch.pending)
        offset = _line_end(TEXT, 25)
        warm.rest("c", URI, 1, offset)
        await _until(lambda: not warm.prefetch.pending and "prefetch" not in warm.scheduler.idle_slots())
        got = await warm.complete("c", 2, URI, 1, offset)
        assert got["stats"] == {"result_cache": True}, got["stats"]
        want = await cold.complete("c", 2, URI, 1, offset)
        assert not want["stats"].get("result_cache")
        assert got["suggestions"] == want["suggestions"] and got["finish_reason"] == want["finish_reason"]
        assert warm.prefetch.counts["failed"] == 0
    finally:
        warm.shutdown()
        cold.shutdown()
