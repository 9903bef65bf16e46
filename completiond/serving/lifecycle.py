"""The daemon's lifecycle: what completes (a Completer) is loaded, reported while loading, calibrated in the
background, and restarted; the service's state (idle | loading | ready | busy | error) lives here.

`load_completer` is the Service's default loader: an exhaustive match on the `Backend` enum picks the
local engine (`load_engine`: Engine.load, then a warm-up) or a team server.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

from completiond import config as config_mod
from completiond.config import Config
from completiond.completion.completer import Backend, Completer
from completiond.errors import CompletionError
from completiond.serving.scheduler import OK, Outcome, Scheduler

log = logging.getLogger(__name__)

# Load phases: the share of the load done when each starts (about, for the bundled model on a CPU) and
# what users read. Engine.load reports up to "engine"; the warm-up is ours. Editors show them as
# `$/progress` percentages, `completiond complete` as lines.
LOAD_PHASES = {
    "starting": (0, "starting"),
    "download": (0, "downloading the model"),
    "compile": (0, "compiling the native CPU step (once per machine and version, about 10-30 s)"),
    "tokenizer": (2, "loading the tokenizer"),
    "weights": (10, "loading the weights"),
    "device": (70, "moving the weights to the device"),
    "engine": (80, "preparing the engine"),
    "draft model": (85, "loading the draft model"),
    "warm-up": (90, "warming up"),
    "ready": (100, "ready"),
}

ProgressFn = Callable[..., None]  # (phase, percentage, message=None)


class Loader(Protocol):
    """Makes the Completer for the settings, on the worker thread, reporting load phases as it goes."""

    def __call__(
        self, cfg: Config, *, progress: ProgressFn | None = None, warn: Callable[[str], None] | None = None
    ) -> Completer: ...


# Of the progress bar, when the model is downloaded first (a hub model not yet in the cache): the
# download dominates then, and the load phases share the rest, so the percentage only rises.
DOWNLOAD_SHARE = 80
# Status bars say "generating" for work that has run this long (Lifecycle.job_started).
BUSY_AFTER_S = 0.15


def progress_report(phase: str, percentage: int, message: str | None = None) -> dict[str, Any]:
    """How status() shows a load phase."""
    return {"phase": phase, "percentage": percentage, "message": message or LOAD_PHASES.get(phase, (0, phase))[1]}


def load_completer(
    cfg: Config, progress: ProgressFn | None = None, warn: Callable[[str], None] | None = None
) -> Completer:
    """What completes for the settings `cfg`, ready to serve (the Service's loader; call off the event loop).

    A team server replaces the engine: it loads nothing and imports no torch; the server is first asked
    with the first completion."""
    backend = Backend.of(cfg.backend)
    match backend:
        case Backend.LOCAL:
            from completiond.completion.suggest import LocalCompleter

            return LocalCompleter(load_engine(cfg, progress, warn))
        case Backend.OPENAI | Backend.LLAMACPP_INFILL:
            from completiond.backends.team_server import TeamServer
            from completiond.completion.team import TeamCompleter

            completer = TeamCompleter(TeamServer(cfg))
            if progress is not None:
                progress("ready", LOAD_PHASES["ready"][0])
            return completer
        case _:
            _unhandled(backend)


def _unhandled(backend: NoReturn) -> NoReturn:
    """The type checker proves every Backend has its case above (a new member without one fails mypy)."""
    raise AssertionError(f"no completer for backend {backend!r}")


def load_engine(cfg: Config, progress: ProgressFn | None = None, warn: Callable[[str], None] | None = None) -> Any:
    """Engine.load with the settings of `cfg`, then one tiny generation so that the first real request
    does not pay for lazy initialisation (kernels, allocator). Imports torch: call off the event loop."""
    for what, value in (("model", cfg.model), ("draft model", cfg.draft_model)):
        problem = missing_model(value, what)
        if problem:  # said before torch loads, and with the path as the user wrote it
            raise MissingModel(problem)
    from completiond.engine.engine import Engine, SamplingParams

    cache = cfg.cache_megabytes * 1024 * 1024 if cfg.cache_megabytes else None

    downloaded = [False]
    last = [-1]

    def phase(name: str) -> None:
        if progress is not None:
            pct = LOAD_PHASES[name][0]
            progress(name, DOWNLOAD_SHARE + pct * (100 - DOWNLOAD_SHARE) // 100 if downloaded[0] else pct)

    def download(done: int, total: int) -> None:
        downloaded[0] = True
        pct = DOWNLOAD_SHARE * done // total if total else 0
        if progress is not None and pct != last[0]:  # a report per percent, not per network chunk
            last[0] = pct
            progress("download", pct, f"downloading {cfg.model}: {done / 1e6:.0f} of {total / 1e6:.0f} MB")

    prepare_native(cfg, phase if progress is not None else None)
    engine = Engine.load(
        model=cfg.model or None,
        device=cfg.device,
        dtype=cfg.dtype,
        weights=cfg.weights,
        trust_remote_code=cfg.trust_remote_code,
        cache_bytes=cache,
        draft_model=cfg.draft_model or None,
        progress=phase if progress is not None else None,
        download_progress=download,
        warn=warn,
    )
    phase("warm-up")
    engine.generate([0], SamplingParams(max_tokens=2, speculative=True), history=None)
    engine.cache.clear()  # the warm-up's sequence is no prefix of anything real
    try:  # the prompt builder's token tables (about 0.1 s for the bundled model), not the first request's
        from completiond.completion.suggest import builder_for

        builder_for(engine, cfg)
    except CompletionError:
        pass  # a setting no prompt fits: the first request says so
    phase("ready")
    return engine


def prepare_native(cfg: Config, phase: Callable[[str], None] | None = None) -> bool:
    """Compile the native CPU step now, as a phase of its own, where the engine would otherwise compile it
    silently inside "preparing the engine" (seconds on the first run). True when it compiled."""
    if cfg.device not in ("auto", "cpu"):
        return False
    import torch

    if cfg.device == "auto" and (
        torch.cuda.is_available()
        or getattr(torch.backends, "mps", None) is not None
        and torch.backends.mps.is_available()
    ):
        return False
    from completiond.engine import native

    if not native.build_pending():
        return False
    log.info("compiling the native CPU step (once per machine and version)")
    if phase is not None:
        phase("compile")
    native.library()
    return True


class MissingModel(CompletionError):
    """A model setting names a local directory that is not there."""


def missing_model(value: str, what: str = "model") -> str:
    """Why `value` cannot be a model, when that is plain without importing torch: a path (it starts with
    `.`, `/` or `~`, as Engine.load reads it) to nothing. Empty when it may be fine. The path is named as
    given and, when that differs, as resolved here (a daemon resolves a relative one in its own folder)."""
    if value and config_mod.is_local_model(value) and not os.path.exists(os.path.expanduser(value)):
        resolved = os.path.abspath(os.path.expanduser(value))
        return f"{what} directory {value} does not exist" + (f" ({resolved})" if resolved != value else "")
    return ""


def resolve_model(value: str) -> str:
    """Local directories (written as paths: config.is_local_model) by absolute path, so a daemon started
    elsewhere finds them; hub ids and short names as they are."""
    return config_mod.resolve_local_model(value)


class Lifecycle:
    """Loads the Completer on the worker thread and keeps the state editors see. Runs on the event loop
    thread (`call_soon` brings worker-side news there); `changed` is told after every change worth a
    status broadcast, `loaded` after each successful load."""

    def __init__(
        self,
        cfg: Callable[[], Config],
        loader: Loader,
        scheduler: Scheduler,
        changed: Callable[[], None],
        loaded: Callable[[], None],
        calibrate_min_params: int | None = None,
    ):
        self._cfg = cfg
        self._loader = loader
        self.scheduler = scheduler
        self._changed = changed
        self._on_loaded = loaded
        self.loop: asyncio.AbstractEventLoop | None = None
        self.completer: Completer | None = None
        self.state = "idle"  # idle | loading | ready | busy | error
        self.error = ""
        self.model_id = ""
        self.model_name = ""  # what users read: directory, or hub id@revision (engine.name)
        self.load_warnings: list[str] = []  # told before the load went on (a model that may not fit)
        self.load_progress: dict[str, Any] | None = None  # progress_report() while loading
        # A team server that failed the last request: the status says "error" with its words until a request
        # succeeds (requests still go to it, within the backend's backoff), never "ready" while all fail.
        self.remote_down = False
        # A model loaded without a calibration is calibrated between requests (engine/autocalibrate.py);
        # below this many parameters (test models) there is too little to gain. None: the module's default.
        self.calibrate_min_params = calibrate_min_params
        self.calibration_job: Any = None
        self.calibration_message = ""
        self._busy_timer: asyncio.TimerHandle | None = None

    def start_loading(self) -> None:
        """Load the completer on the worker thread (queued jobs wait behind it)."""
        self.loop = self.loop or asyncio.get_running_loop()
        self.load_progress = progress_report("starting", 0)
        self.load_warnings = []
        self.remote_down = False
        self._cancel_calibration()
        self.set_state("loading")

        def progress(phase: str, percentage: int, message: str | None = None) -> None:
            self.call_soon(self._set_progress, phase, percentage, message)

        def warn(message: str) -> None:
            self.call_soon(self._add_warning, message)

        def load() -> Completer:
            completer = self._loader(self._cfg(), progress=progress, warn=warn)
            # Set here, on the worker, not in _loaded: jobs queued behind the load run before the loop gets to it.
            self.completer = completer
            return completer

        def done(outcome: Outcome) -> None:
            self.call_soon(self._loaded, outcome)

        self.scheduler.call(load, done)

    def _set_progress(self, phase: str, percentage: int, message: str | None = None) -> None:
        if self.state == "loading":
            self.load_progress = progress_report(phase, percentage, message)
            self._changed()

    def _add_warning(self, message: str) -> None:
        if message not in self.load_warnings:
            self.load_warnings.append(message)
            self._changed()

    def _loaded(self, outcome: Outcome) -> None:
        self.load_progress = None
        cfg = self._cfg()
        if outcome.status == OK:
            completer: Completer = outcome.value
            self.completer = completer
            self.model_id = completer.model_id or str(cfg.model)
            self.model_name = completer.name or self.model_id
            self._on_loaded()
            self.error = ""
            log.info("model %s ready on %s", self.model_name, completer.device)
            self.set_state("ready")
            self._maybe_calibrate()
        else:
            what = (
                f"backend {cfg.backend} ({cfg.endpoint or 'no endpoint'})"
                if cfg.backend != "local"
                else f"model {config_mod.model_label(cfg.model)}"
            )
            self.error = f"cannot load {what}: {outcome.value}"
            log.error("%s", self.error)
            self.set_state("error")

    def set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self._changed()

    def mark_busy(self) -> None:
        if self.state in ("ready", "busy"):  # a failing team server stays "error" until it answers
            self.set_state("busy")

    def job_started(self) -> None:
        """A request (or an answer ahead) began on the worker: the state says "busy" once work has run
        BUSY_AFTER_S. Most answers come sooner, and a busy broadcast then (a status frame to every editor,
        its LSP process decoding it) ran beside the request it announced, on the same cores."""
        if self._busy_timer is None and self.loop is not None and not self.loop.is_closed():
            self._busy_timer = self.loop.call_later(BUSY_AFTER_S, self._still_busy)

    def _still_busy(self) -> None:
        self._busy_timer = None
        if self.scheduler.busy:
            self.mark_busy()

    def remote_failed(self, message: str) -> None:
        """The team server failed a request: the status says so (once per failure, the editors show it),
        instead of "ready" while every request fails."""
        if self.state in ("loading", "idle"):
            return
        changed = not self.remote_down or self.error != message
        self.remote_down = True
        self.error = message
        if self.state != "error":
            self.set_state("error")
        elif changed:
            self._changed()

    def remote_answered(self) -> None:
        if self.remote_down:
            log.info("the completion server answers again")
            self.remote_down = False
            self.error = ""
            self.set_state("busy" if self.scheduler.busy else "ready")

    def call_soon(self, fn: Callable, *args: Any) -> None:
        """Run fn(*args) on the event loop (from any thread); dropped once the loop has closed."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed while shutting down
            pass

    # --- background calibration ------------------------------------------------

    def _maybe_calibrate(self) -> None:
        """On the loop, after a load: calibrate a model that has neither a user record nor shipped defaults,
        on the engine thread whenever no request waits (a request preempts it within one round)."""
        if self.completer is None:
            return
        job = self.completer.background_calibration(
            self.calibrate_min_params, on_done=lambda message: self.call_soon(self._calibrated, job, message)
        )
        if job is None:
            return
        self.calibration_job = job
        self.calibration_message = f"calibrating {self.model_name} in the background (suggestions are served meanwhile)"
        log.info("%s", self.calibration_message)
        self.scheduler.set_idle(job.step)

    def calibration_status(self) -> dict | None:
        job = self.calibration_job
        if job is None:
            return None
        state = job.state  # read first: a job that has ended has its message already (it is set before)
        ended = state not in ("pending", "running")
        return {"state": state, "message": job.message if ended and job.message else self.calibration_message}

    def _calibrated(self, job: Any, message: str) -> None:
        if job is self.calibration_job:
            self.calibration_message = message
            self._changed()

    def _cancel_calibration(self) -> None:
        job, self.calibration_job = self.calibration_job, None
        if job is not None:
            job.cancel()
            self.scheduler.set_idle(None)
            self.calibration_message = ""

    def shutdown(self) -> None:
        if self._busy_timer is not None:
            self._busy_timer.cancel()
        if self.calibration_job is not None:
            self.calibration_job.cancel()
