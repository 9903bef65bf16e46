"""config.toml is watched (watchdog, not polling) and re-read off the LSP's event loop (issue 15
item 9, issue 16 item 7)."""

from __future__ import annotations

import asyncio
import os
import threading

from completiond import config
from completiond.lsp.config_watch import ConfigWatcher


class Calls:
    def __init__(self):
        self.n = 0
        self.changed = threading.Condition()

    def __call__(self):
        with self.changed:
            self.n += 1
            self.changed.notify_all()

    def wait_more_than(self, n: int, timeout: float = 10.0) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.n > n, timeout)

    def after(self, action, timeout: float = 10.0) -> bool:
        """Run `action` once the events of earlier steps are all in; whether a new call followed."""
        while self.wait_more_than(self.n, 0.3):
            pass
        n = self.n
        action()
        return self.wait_more_than(n, timeout)


def test_watcher_follows_creation_edits_renames_and_symlink_targets(tmp_path):
    path = tmp_path / "xdg" / "completiond" / "config.toml"   # neither directory exists yet
    calls = Calls()
    watcher = ConfigWatcher(path, calls).start()
    try:
        assert calls.after(lambda: path.parent.mkdir(parents=True)), "the directory's creation went unnoticed"
        assert calls.after(lambda: path.write_text("maxTokens = 3\n")), "creating the file went unnoticed"
        assert calls.after(lambda: path.write_text("maxTokens = 4\n")), "an edit went unnoticed"

        def atomic_save():                                      # how editors save: write, then rename over
            tmp = path.with_name("config.toml.tmp")
            tmp.write_text("maxTokens = 5\n")
            os.replace(tmp, path)

        assert calls.after(atomic_save), "an atomic replace went unnoticed"
        # A dotfile manager's symlink: editing the target counts.
        dotfiles = tmp_path / "dotfiles"
        dotfiles.mkdir()
        (dotfiles / "completiond.toml").write_text("maxTokens = 6\n")
        assert calls.after(lambda: (path.unlink(), path.symlink_to(dotfiles / "completiond.toml")))
        assert calls.after(lambda: (dotfiles / "completiond.toml").write_text("maxTokens = 7\n")), \
            "an edit of the symlink's target went unnoticed"
        # Reading it (as the LSP does on every change) is not a change: no feedback loop.
        assert not calls.after(lambda: config.load_file(path), timeout=1.0)
    finally:
        watcher.stop()


async def test_lsp_reloads_on_change_and_survives_a_broken_file(tmp_path, monkeypatch):
    """Mid-session, a config nested 100,000 deep killed the (polling) watch with RecursionError:
    later edits were ignored. Now it is reported and the next edit applies."""
    from completiond.lsp.server import CompletionServer

    path = tmp_path / "config.toml"
    path.write_text("maxTokens = 9\n")
    server = CompletionServer(no_daemon=True, config_file=path)
    applied: list = []
    monkeypatch.setattr(server, "apply_settings", lambda: applied.append((server.file_cfg, list(server.file_errors))))
    watch = asyncio.ensure_future(server.watch_config_file(settle=0.05))
    try:
        await asyncio.sleep(0.5)   # the watch is set up on a worker thread
        path.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
        for _ in range(200):
            if applied and applied[-1][1]:
                break
            await asyncio.sleep(0.05)
        assert applied and "nested too deeply" in applied[-1][1][0]
        path.write_text("maxTokens = 5\n")
        for _ in range(200):
            if applied[-1][0].max_tokens == 5:
                break
            await asyncio.sleep(0.05)
        assert applied[-1] == (config.merge(config.defaults(), {"maxTokens": 5})[0], [])
        assert not watch.done()
    finally:
        watch.cancel()


async def test_an_edit_before_the_watch_is_armed_is_applied(tmp_path, monkeypatch):
    """The file is read at start-up, the watch is armed later on a worker thread (in --no-daemon mode
    while the model is importing): an edit in between raised no event and was lost (a CI run saw it)."""
    from completiond.lsp.server import CompletionServer

    path = tmp_path / "config.toml"
    path.write_text("maxTokens = 9\n")
    server = CompletionServer(no_daemon=True, config_file=path)
    path.write_text("maxTokens = 7\n")   # before any watch exists
    applied: list = []
    monkeypatch.setattr(server, "apply_settings", lambda: applied.append(server.file_cfg))
    watch = asyncio.ensure_future(server.watch_config_file(settle=0.05))
    try:
        for _ in range(200):
            if applied:
                break
            await asyncio.sleep(0.05)
        assert applied and applied[-1].max_tokens == 7
    finally:
        watch.cancel()
