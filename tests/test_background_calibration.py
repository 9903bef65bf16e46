"""Background calibration of a newly loaded model (issue 14, part 1): the daemon measures the draft
between requests, never in their way.

* the scheduler runs idle work only when nothing waits, and a request cancels the running piece;
* BackgroundCalibration leaves the engine as it found it after every step (the user's prefix KV
  cache, its draft vocabulary), redoes a preempted pair, stores the record at the end and switches
  the engine to it; it stops without storing anything when its time budget is spent or it is
  cancelled;
* through the Service: the model loads, the calibration starts by itself, completions are served
  while it runs and are the same afterwards (greedy decoding is exact whatever the draft).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from completiond import config
from completiond.engine.autocalibrate import BackgroundCalibration
from completiond.engine.calibration import record_path
from completiond.engine.cancel import CancelToken
from completiond.serving.scheduler import OK, Job, Scheduler


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def peaked_dir(tmp_path_factory):
    from completiond.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("bg-model"), layers=4, peaked=True, seed=3)


def _prompts(engine):
    return [engine.tokenizer("def add(a, b):\n    return a + b\n\n\nfor i in range(10):\n").input_ids,
            engine.tokenizer("class Point:\n    def __init__(self, x, y):\n        self.x = x\n").input_ids]


def _run(job: BackgroundCalibration, limit: int = 500) -> int:
    steps = 0
    while steps < limit and job.step(CancelToken()):
        steps += 1
    return steps


# --- the scheduler ---------------------------------------------------------------------------------


def _wait(predicate, limit_s: float = 60.0) -> bool:
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_idle_work_yields_to_a_request_and_resumes_after_it():
    sched = Scheduler()
    tokens: list = []

    def step(token) -> bool:
        tokens.append(token)
        # Holds the engine thread until cancelled: the request below can only run if it preempts this.
        _wait(lambda: token.cancelled)
        return len(tokens) < 3

    try:
        sched.set_idle(step)
        assert _wait(lambda: len(tokens) == 1)
        done = threading.Event()
        outcomes = []
        sched.submit(Job(key="doc", client="c", request_id=1, run=lambda token: "served",
                         done=lambda outcome: (outcomes.append(outcome), done.set())))
        assert done.wait(60)
        assert outcomes[0].status == OK and outcomes[0].value == "served"
        assert tokens[0].cancelled
        # it resumes once the queue is empty, and is dropped when a step says it is finished
        assert _wait(lambda: len(tokens) == 2)
        tokens[-1].cancel()
        assert _wait(lambda: len(tokens) == 3)
        tokens[-1].cancel()
        assert _wait(lambda: not sched.idle_slots())
        assert len(tokens) == 3
    finally:
        sched.stop()


def test_withdrawn_idle_work_is_cancelled_and_not_run_again():
    sched = Scheduler()
    tokens: list = []

    def step(token) -> bool:
        tokens.append(token)
        _wait(lambda: token.cancelled)
        return True

    try:
        sched.set_idle(step)
        assert _wait(lambda: len(tokens) == 1)
        sched.set_idle(None)
        assert _wait(lambda: tokens[0].cancelled)
        # a control call after it runs, and no further step starts
        ran = threading.Event()
        sched.call(lambda: "x", lambda outcome: ran.set())
        assert ran.wait(60)
        assert len(tokens) == 1
    finally:
        sched.stop()


# --- the calibration steps ---------------------------------------------------------------------------


def test_background_calibration_leaves_the_engine_as_it_was_and_stores_its_record(peaked_dir, private_cache):
    from completiond.engine.engine import Engine, SamplingParams

    engine = Engine.load(peaked_dir, device="cpu")
    assert engine.calibration.source == "heuristic"
    user = engine.tokenizer("print(add(1, 2))\n").input_ids
    before = engine.generate(user, SamplingParams(max_tokens=12, ignore_eos=True)).tokens
    cache, cached = engine.cache, len(engine.cache)
    assert cached == 1
    job = BackgroundCalibration(engine, prompts=_prompts(engine), max_tokens=8, repeats=1)
    steps = 0
    while steps < 500:
        more = job.step(CancelToken())
        steps += 1
        # between steps the engine is the user's: the same cache with the same entries
        assert engine.cache is cache and len(engine.cache) == cached
        if not more:
            break
    assert job.state == "done" and steps > 2
    assert record_path(engine.model_id).is_file()
    assert engine.calibration is job.result and engine.calibration.source == "calibrate"
    after = engine.generate(user, SamplingParams(max_tokens=12, ignore_eos=True))
    assert after.tokens == before and after.stats.reused_tokens > 0  # the user's cached prompt survived
    reloaded = Engine.load(peaked_dir, device="cpu")
    assert reloaded.calibration.source.startswith("user calibration")


def test_a_preempted_step_is_measured_again(peaked_dir, private_cache):
    from completiond.engine.engine import Engine

    engine = Engine.load(peaked_dir, device="cpu")
    job = BackgroundCalibration(engine, prompts=_prompts(engine), max_tokens=8, repeats=1)
    cancelled = CancelToken()
    cancelled.cancel()  # a request arrived: the first timed run stops at once
    assert job.step(cancelled) is True
    assert job.preempted == 1 and not record_path(engine.model_id).exists()
    _run(job)
    assert job.state == "done" and record_path(engine.model_id).is_file()


def test_background_calibration_gives_up_after_its_budget_and_can_be_cancelled(peaked_dir, private_cache):
    from completiond.engine.engine import Engine

    engine = Engine.load(peaked_dir, device="cpu")
    job = BackgroundCalibration(engine, prompts=_prompts(engine), max_tokens=8, repeats=1, budget_s=0.0,
                                on_done=lambda message: messages.append(message))
    messages: list[str] = []
    assert job.step(CancelToken()) is False
    assert job.state == "gave up" and "run `completiond calibrate`" in messages[0]
    assert engine.calibration.source == "heuristic" and not record_path(engine.model_id).exists()
    job = BackgroundCalibration(engine, prompts=_prompts(engine), max_tokens=8, repeats=1)
    assert job.step(CancelToken()) is True
    job.cancel()
    assert job.step(CancelToken()) is False and job.state == "cancelled"
    assert engine.calibration.source == "heuristic"


# --- through the service ---------------------------------------------------------------------------------


async def test_the_daemon_calibrates_a_new_model_while_serving_completions(peaked_dir, private_cache):
    from completiond.serving.lifecycle import load_completer
    from completiond.serving.service import Service

    cfg = config.merge(config.Config(), {"model": str(peaked_dir), "device": "cpu", "maxTokens": 8})[0]
    service = Service(cfg, loader=load_completer, calibrate_min_params=0)
    try:
        service.start_loading()
        for _ in range(3000):
            if service.state not in ("idle", "loading"):
                break
            await asyncio.sleep(0.02)
        assert service.state == "ready", service.error
        status = service.status()
        # the model by name, not by its identity hash
        assert status["model"] == str(peaked_dir.resolve()) and status["model_id"] not in status["model"]
        assert status["calibration"]["state"] in ("pending", "running")
        text = "def add(a, b):\n    return "
        service.open("c", "file:///t.py", 1, text, "python")
        first = await service.complete("c", 1, "file:///t.py", 1, len(text))
        for _ in range(6000):
            if service.status()["calibration"]["state"] not in ("pending", "running"):
                break
            await asyncio.sleep(0.02)
        status = service.status()
        assert status["calibration"]["state"] == "done", status["calibration"]
        assert status["calibration"]["message"].startswith(f"calibrated {peaked_dir.resolve()} in the background")
        again = await service.complete("c", 2, "file:///t.py", 1, len(text))
        assert again["suggestion"] == first["suggestion"]
    finally:
        service.shutdown()


async def test_small_models_are_not_calibrated_in_the_background(peaked_dir, private_cache):
    from completiond.serving.lifecycle import load_completer
    from completiond.serving.service import Service

    cfg = config.merge(config.Config(), {"model": str(peaked_dir), "device": "cpu"})[0]
    service = Service(cfg, loader=load_completer)  # the default threshold: 100M parameters
    try:
        service.start_loading()
        for _ in range(3000):
            if service.state not in ("idle", "loading"):
                break
            await asyncio.sleep(0.02)
        assert service.state == "ready", service.error
        assert service.status()["calibration"] is None and not service.scheduler.idle_slots()
    finally:
        service.shutdown()
