"""How many threads a request's passes use, given what else wants the CPU right now.

A pass split over T threads waits, at each of its many parallel regions, for the slowest of them. On a
machine whose cores other processes also want, one of our threads is often descheduled, and every region
then waits a scheduler time slice for it: a 300-token prefill of the bundled model took 0.8-3.3 s with 2
threads on 2 busy cores, against 0.1-0.2 s with 1 thread and 24 ms with 2 on idle ones (2026-12-06; the
"1 ms/token" prefill and the multi-second first suggestions seen under load). So before each request the
engine counts the runnable tasks other than itself (Linux's /proc/loadavg, an instantaneous count) and uses
no more threads than the cores they leave free, at least one, at most its configured number.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

LOADAVG = "/proc/loadavg"
# The later looks at the runnable count before a request gives up a thread (seconds after the one before):
# a task that wants the cores for real (a build, a test run, another model) is runnable at every one.
LOOKS_S = (0.0002, 0.001)


def runnable_tasks(path: str = LOADAVG) -> int | None:
    """Tasks runnable right now on the whole machine, this one included (None where the kernel does not say)."""
    try:
        with open(path, "rb") as f:
            running = f.read().split()[3]
        return int(running.split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return None


def own_runnable_threads(task_dir: str = "/proc/self/task") -> int:
    """This process's threads runnable right now. After a parallel region torch's pool threads spin for a while
    (OpenMP's wait policy): /proc/loadavg counts them, but they are ours, and leave as soon as we run again."""
    n = 0
    try:
        tasks = os.listdir(task_dir)
    except OSError:
        return 0
    for task in tasks:
        try:
            with open(f"{task_dir}/{task}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        end = stat.rfind(b")")  # the name may hold spaces and parentheses: the state follows the last ")"
        if end >= 0 and stat[end + 2 : end + 3] == b"R":
            n += 1
    return n


def other_runnable_tasks(path: str = LOADAVG, task_dir: str = "/proc/self/task") -> int | None:
    """Tasks runnable right now on the machine that are not this process's threads, plus one for the caller
    (runnable_tasks' convention); None where the kernel does not say."""
    total = runnable_tasks(path)
    if total is None:
        return None
    return max(1, total - own_runnable_threads(task_dir) + 1)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ThreadGovernor:
    """Sets torch's thread count (which the native step reads per call too) for each request.

    `most`: the configured count (Engine.load's threads, else torch's default), never exceeded."""

    def __init__(
        self,
        most: int | None = None,
        cores: int | None = None,
        runnable: Callable[[], int | None] = other_runnable_tasks,
    ):
        self.most = max(1, most or torch.get_num_threads())
        self.cores = max(1, cores or _cores())
        self._runnable = runnable
        self.current = self.most
        self.reduced = 0  # requests that ran on fewer threads than configured (status, tests)

    def _others(self) -> int:
        """Runnable tasks besides the caller (whose pool threads sleep between requests). A task seen runnable
        once may be passing by (the event loop that handed over this request, the editor's language server
        answering): the looks LOOKS_S later must see it too. One look 0.2 ms later was not enough: on a quiet
        machine a quarter of bench --editing's requests at the 0.5B shape still ran on one thread of two; three
        looks over 4 ms cost the bundled model's rested jumps that much (Engine.prefill picks again between
        chunks, so a passer-by the looks miss costs one chunk)."""
        n = self._runnable()
        for delay in LOOKS_S:
            if n is None or n <= 1 or self.cores - (n - 1) >= self.most:
                break
            time.sleep(delay)
            again = self._runnable()
            n = n if again is None else min(n, again)
        return 0 if n is None else max(0, n - 1)

    def pick(self) -> int:
        """The thread count for the next request: the configured one unless other runnable tasks want cores."""
        now = torch.get_num_threads()
        if now != self.current:  # set by someone else since (a test, bench-device): the new ceiling
            self.most = self.current = now
        threads = min(self.most, self.cores - self._others())
        threads = max(1, threads)
        if threads < self.most:
            self.reduced += 1
        if threads != self.current:
            torch.set_num_threads(threads)
            self.current = threads
        return threads
