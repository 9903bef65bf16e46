"""Load (issue 7, item 6): 4 editors typing 20 keystrokes/s each (a didChange and an
inlineCompletion per keystroke). Every request gets a response, the daemon never holds more
than one queued request per document, nothing is rejected, and the p99 latency of the latest
request is reported. CI runs 10 s; `completiond stress load --duration 60` is the
long run (figures in docs/RELIABILITY.md).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest

from completiond.commands import stress
from test_fuzz_wire import InProcDaemon
from test_scheduler import FakeEngine

pytestmark = pytest.mark.slow


async def test_four_editors_typing_real_daemon(tiny_model_dir, tmp_path):
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    report = await stress.run_load(str(tiny_model_dir), runtime, clients=4, rate=20.0, duration=10.0)
    print("load (10 s, tiny model):", report)
    assert report["requests"] == 4 * 200
    assert report["responses"] == report["requests"], report
    assert report["errors"] == 0 and report["daemon_errors"] == 0 and report["daemon_rejected"] == 0, report
    assert report["max_queued"] <= report["documents"], report        # at most one queued request per document
    assert report["queue_samples"] >= 20
    # The daemon saw each request at most once (the LSP answers some itself: a suggestion the user is
    # typing through). Whether latest-wins had anything to drop depends on the engine's speed: with the
    # native step the tiny model keeps up with 20 keys/s, so the slow-engine case is its own test below.
    handled = report["daemon_completed"] + report["daemon_superseded"] + report["daemon_cancelled"]
    assert 0 < handled <= report["requests"], report
    assert report["latest_requests"] > 0 and report["latest_p99_ms"] is not None
    assert report["latest_p99_ms"] < 5000, report                      # generous: shared 2-core CI machine


async def test_engine_slower_than_typing_keeps_one_job_per_document(tmp_path):
    """The engine takes ~0.2 s per request while each editor types 20 keys/s: the queue must stay at
    one job per document (latest wins), sampled directly in the daemon's scheduler."""
    engine = FakeEngine(continuation="x" * 4000, per_round=1, round_s=0.01)
    daemon = InProcDaemon(tmp_path, engine=engine)
    lsps = []
    samples: list[list] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            samples.append(daemon.call(lambda: [job.key for job in daemon.service.scheduler._pending.values()]))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        lsps = list(await asyncio.gather(*(stress.RawLsp.start({"maxTokens": 20, "tokenHealing": False}, tmp_path) for _ in range(4))))
        base = "def f(x):\n"
        for i, lsp in enumerate(lsps):
            lsp.notify("textDocument/didOpen", stress.did_open(f"file:///slow/c{i}.py", base))
        sampler.start()
        record: list[dict] = []
        deadline = time.monotonic() + 30
        await asyncio.gather(*(stress.type_into(lsp, f"file:///slow/c{i}.py", base, 60, 20.0, deadline, record)
                               for i, lsp in enumerate(lsps)))
        stop.set()
        sampler.join(5)
        assert len(record) == 240 and all(e["result"] is not None for e in record)   # responses == requests
        assert sum(1 for e in record if e["result"] == "error") == 0
        assert samples and max(len(s) for s in samples) <= 4
        assert all(max(Counter(s).values(), default=0) <= 1 for s in samples)          # one per document
        stats = await lsps[0].stats()
        assert stats["superseded"] > 100, stats        # the engine could not keep up: older requests dropped
        assert stats["rejected"] == 0 and stats["errors"] == 0
    finally:
        stop.set()
        for lsp in lsps:
            await lsp.close()
        daemon.stop()
    assert not daemon.errors
