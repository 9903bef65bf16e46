"""The thread governor: a request's passes use no more threads than the cores other runnable tasks leave."""

from __future__ import annotations

import torch

from completiond.engine.threads import ThreadGovernor, runnable_tasks


def test_fewer_threads_when_other_tasks_want_the_cores():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    counts = iter([1, 3, 3, 3, 2, 2, 2, 9, 9, 9, 1])
    try:
        gov = ThreadGovernor(cores=2, runnable=lambda: next(counts))
        assert gov.most == 2
        assert gov.pick() == 2 and torch.get_num_threads() == 2       # alone: every core
        assert gov.pick() == 1 and torch.get_num_threads() == 1       # two others, seen at every look
        assert gov.pick() == 1                                         # one other, seen at every look
        assert gov.pick() == 1                                         # many: still one
        assert gov.pick() == 2 and torch.get_num_threads() == 2       # alone again
        assert gov.reduced == 3
    finally:
        torch.set_num_threads(saved)


def test_a_task_passing_by_does_not_cost_a_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    counts = iter([2, 1])   # the event loop that handed the request over, gone 0.2 ms later
    try:
        gov = ThreadGovernor(cores=2, runnable=lambda: next(counts))
        assert gov.pick() == 2 and gov.reduced == 0
        # the language server answering the editor, gone only at the third look
        counts = iter([2, 2, 1])
        gov = ThreadGovernor(cores=2, runnable=lambda: next(counts))
        assert gov.pick() == 2 and gov.reduced == 0
        # and a task runnable at every look takes a core
        gov = ThreadGovernor(cores=2, runnable=lambda: 2)
        assert gov.pick() == 1 and gov.reduced == 1
    finally:
        torch.set_num_threads(saved)


def test_a_count_set_by_someone_else_is_the_new_ceiling():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gov = ThreadGovernor(cores=4, runnable=lambda: 1)
        torch.set_num_threads(1)   # a test or bench-device asks for one thread
        assert gov.pick() == 1 and gov.most == 1
    finally:
        torch.set_num_threads(saved)


def test_no_count_where_the_kernel_gives_none(tmp_path):
    assert runnable_tasks(str(tmp_path / "missing")) is None
    (tmp_path / "loadavg").write_text("0.50 0.40 0.30 3/120 4567\n")
    assert runnable_tasks(str(tmp_path / "loadavg")) == 3
    gov = ThreadGovernor(most=2, cores=2, runnable=lambda: None)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        gov.current = 2
        assert gov.pick() == 2
    finally:
        torch.set_num_threads(saved)


def test_our_own_spinning_pool_threads_are_not_other_tasks(tmp_path):
    """After a parallel region torch's pool threads spin (OpenMP's wait policy) and /proc/loadavg counts them:
    taken for other tasks, they cut every request after the first to one thread on an idle machine (decode
    0.63 -> 0.82 ms/token on the bundled model, 2026-12-06). Only other processes' tasks count."""
    from completiond.engine.threads import other_runnable_tasks, own_runnable_threads

    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.50 0.40 0.30 3/200 999\n")
    tasks = tmp_path / "task"
    for tid, stat in {"1": "1 (python) R 0 1", "2": "2 (OMP ) R( worker) R 0 1", "3": "3 (io) S 0 1"}.items():
        (tasks / tid).mkdir(parents=True)
        (tasks / tid / "stat").write_text(stat)
    assert own_runnable_threads(str(tasks)) == 2
    assert other_runnable_tasks(str(loadavg), str(tasks)) == 2  # the caller + one task of another process
    loadavg.write_text("0.50 0.40 0.30 2/200 999\n")
    assert other_runnable_tasks(str(loadavg), str(tasks)) == 1  # only ours: the machine is idle
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gov = ThreadGovernor(cores=2, runnable=lambda: other_runnable_tasks(str(loadavg), str(tasks)))
        assert gov.pick() == 2 and gov.reduced == 0
    finally:
        torch.set_num_threads(saved)


def test_a_request_on_fewer_threads_is_counted(tiny_model_dir):
    """bench --editing and `completiond status` read it: a request the governor cut to fewer threads than
    configured says so in its stats, and the daemon's counters add it up."""
    from completiond.engine.engine import Engine, SamplingParams
    from completiond.serving.metrics import Metrics
    from completiond.serving.scheduler import OK, Outcome

    saved = torch.get_num_threads()
    try:
        engine = Engine.load(tiny_model_dir, device="cpu", dtype="float32", threads=2)
        metrics = Metrics()
        for others, reduced in ((1, False), (64, True)):
            engine.threads = ThreadGovernor(most=2, cores=2, runnable=lambda n=others: n)
            gen = engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=2))
            assert gen.stats.threads_reduced is reduced
            metrics.account(Outcome(OK, {"stats": gen.stats.to_dict(), "suggestion": "x"}))
        assert metrics.counts["reduced_threads"] == 1
    finally:
        torch.set_num_threads(saved)


def test_prefill_picks_again_between_chunks(tiny_model_dir):
    """A task passing by when the request came costs its first chunk at most: the next chunk has the cores."""
    from completiond.engine.engine import Engine

    saved = torch.get_num_threads()
    try:
        engine = Engine.load(tiny_model_dir, device="cpu", dtype="float32", threads=2)
        looks = iter([3, 3, 3] + [1] * 100)  # busy at the request's looks, quiet from the next chunk on
        seen = []
        engine.threads = ThreadGovernor(most=2, cores=2, runnable=lambda: next(looks))
        real = engine.run_layers

        def spy(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return real(*args, **kwargs)

        engine.run_layers = spy
        engine.threads.pick()
        seq = engine.new_sequence(64)
        with torch.inference_mode():
            assert engine.prefill(seq, list(range(3, 43)), None, chunk_size=16)
        assert seen == [1, 2, 2]
    finally:
        torch.set_num_threads(saved)
