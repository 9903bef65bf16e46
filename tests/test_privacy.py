"""Prompt privacy and the workspace's robustness (issue 16, items 1-5 and 8).

Nothing outside the project reaches the model: no file through a symlink leading out of a
workspace folder, no other editor's files, no hidden or secret-bearing files, no closed
ignored file. And nothing local wedges the daemon: FIFOs are never opened blocking, shutdown
is bounded, folder watches are bounded, removed with their folders and set up off the caller.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path

import pytest

from completiond import config
from completiond.completion import workspace as ws_mod
from completiond.completion.workspace import Unreadable, Workspace, read_regular, secret_match


def names(ws: Workspace) -> set[str]:
    return {os.path.basename(p) for p in ws.paths()}


def context_names(ws: Workspace, current: Path, owner=ws_mod.LOCAL, **kw) -> set[str]:
    return {os.path.basename(p) for p, _ in ws.context(current, None, 10_000, owner=owner, **kw)}


def release_fifo(path: Path) -> None:
    """Unblock anything stuck opening `path` for reading (the pre-fix behaviour), so a failing test ends."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


# --- 1. symlinks are checked at read time --------------------------------------------------------


def test_symlink_out_of_the_folder_created_while_watched_is_never_read(tmp_path):
    project, outside = tmp_path / "ws", tmp_path / "home"
    project.mkdir()
    outside.mkdir()
    (outside / "id_key.py").write_text("PRIVATE_KEY = 'begin rsa'\n")
    (project / "inner.py").write_text("VALUE = 1\n")
    w = Workspace([project], scan=False).start()
    try:
        (project / "key.py").symlink_to(outside / "id_key.py")          # what a git pull or an archive can do
        (project / "alias.py").symlink_to(project / "inner.py")          # a link inside the folder is fine
        (project / "last.py").write_text("LAST = 1\n")
        assert w.wait_for(lambda: {"last.py", "alias.py"} <= names(w))
        assert w.flush()
        assert "key.py" not in names(w)
        # Re-read after the editor closes it: still refused, even though the editor had it open.
        w.did_open(project / "key.py", "PRIVATE_KEY = 'begin rsa'\n", "python")
        w.did_close(project / "key.py")
        assert w.flush()
        texts = [w.get(p) for p in w.paths()]
        assert not any("PRIVATE_KEY" in (t or "") for t in texts)
        assert "PRIVATE_KEY" not in str(w.context(project / "main.py", "python", 10_000))
    finally:
        w.stop()


def test_read_regular_refuses_what_is_not_a_regular_file_inside(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "secret.txt").write_text("s")
    (tmp_path / "ws" / "out.py").symlink_to(tmp_path / "secret.txt")
    os.mkfifo(tmp_path / "ws" / "pipe.py")
    (tmp_path / "ws" / "dev.py").symlink_to("/dev/zero")
    real = os.path.realpath(tmp_path / "ws")
    for name, why in (("out.py", "outside the workspace"), ("pipe.py", "not a regular file"),
                      ("dev.py", "outside the workspace")):
        with pytest.raises(Unreadable, match=why):
            read_regular(str(tmp_path / "ws" / name), 1000, inside=real)
    with pytest.raises(Unreadable, match="not a regular file"):
        read_regular("/dev/zero", 1000)


# --- 2. context per editor, dropped when it leaves -------------------------------------------------


def test_context_is_scoped_to_the_editor_and_dropped_when_it_leaves(tmp_path):
    a, b = tmp_path / "project-a", tmp_path / "project-b"
    for d, body in ((a, "A_SECRET_ALGORITHM = 1\n"), (b, "B_CODE = 2\n")):
        d.mkdir()
        (d / "lib.py").write_text(body)
    w = Workspace(scan=True)
    w.add_folder(a, owner="A")
    w.add_folder(b, owner="B")
    w.start()
    try:
        assert w.wait_for(lambda: w.get(a / "lib.py", owner=None) and w.get(b / "lib.py", owner=None))
        w.did_open(tmp_path / "notes" / "draft.py", "A_UNSAVED_DRAFT = 3\n", "python", owner="A")
        ctx_b = str(w.context(b / "main.py", "python", 10_000, owner="B"))
        assert "B_CODE" in ctx_b and "A_SECRET" not in ctx_b and "A_UNSAVED" not in ctx_b
        ctx_a = str(w.context(a / "main.py", "python", 10_000, owner="A"))
        assert "A_SECRET" in ctx_a and "A_UNSAVED" in ctx_a and "B_CODE" not in ctx_a
        w.drop_owner("A")                                   # A's editor quit
        assert w.flush()
        assert w.folders("A") == [] and str(a) not in str(w._watches)
        assert not any("A_" in (w.get(p, owner=None) or "") + (w.get(p, owner="A") or "") for p in w.paths())
        assert "A_SECRET" not in str(w.context(b / "main.py", "python", 10_000, owner="B"))
    finally:
        w.stop()


def test_closed_documents_outside_every_folder_leave(tmp_path):
    w = Workspace(scan=False)
    for i in range(500):
        path = tmp_path / "elsewhere" / f"f{i}.py"
        w.did_open(path, f"x{i} = {i}\n", "python")
        w.did_close(path)
    assert w.flush()
    assert len(w) == 0 and w.memory_bytes == 0


async def test_service_scopes_context_per_connection(tmp_path):
    from test_scheduler import FakeEngine, ready_service

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
    (a / "mine.py").write_text("A_ONLY = 1\n")
    service = await ready_service(FakeEngine(continuation="z\n"))
    seen: dict = {}
    real_context = service._context

    def spy(client, cfg, path, language):
        seen[client] = real_context(client, cfg, path, language)
        return seen[client]

    service._context = spy
    try:
        service.notify(1, "workspace", {"folders": [str(a)]})
        service.notify(2, "workspace", {"folders": [str(b)]})
        assert await asyncio.to_thread(service.workspace.flush)
        assert await asyncio.to_thread(service.workspace.wait_for, lambda: service.workspace.get(a / "mine.py", owner=None))
        service.open(1, (a / "open_a.py").as_uri(), 1, "A_OPEN = 2\n", "python")
        service.open(2, (b / "main.py").as_uri(), 1, "x = ", "python")
        service.open(1, (a / "main.py").as_uri(), 1, "x = ", "python")
        await service.complete(2, 1, (b / "main.py").as_uri(), 1, 4)
        await service.complete(1, 1, (a / "main.py").as_uri(), 1, 4)
        assert "A_" not in str(seen[2])
        assert "A_ONLY" in str(seen[1]) and "A_OPEN" in str(seen[1])
        service.drop_client(1)
        assert await asyncio.to_thread(service.workspace.flush)
        assert service.workspace.folders(1) == []
        assert [os.path.basename(p) for p in service.workspace.paths()] == ["main.py"]   # editor 2's
        service.notify(2, "workspace", {"folders": [], "removed": [str(b)]})
        assert await asyncio.to_thread(service.workspace.flush)
        assert service.workspace.folders(2) == []
    finally:
        service.shutdown()


# --- 3. hidden directories and secret-bearing names --------------------------------------------------


def test_home_folder_hidden_dirs_and_secret_files_never_become_context(tmp_path):
    home = tmp_path / "home"
    files = {
        ".config/gh/hosts.yml": "github.com:\n  oauth_token: gho_TOKEN\n",
        ".local/lib/mod.py": "HIDDEN_DIR = 1\n",
        "config/secrets.yaml": "db_password: hunter2\n",
        "deploy/credentials.py": "AWS_KEY = 'AKIA'\n",
        ".env.py": "API_TOKEN = 'x'\n",
        "keys/id_ed25519.py": "KEY = 1\n",
        "project/app.yaml": "name: app\n",
        "project/util.py": "def util(): pass\n",
    }
    for rel, body in files.items():
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text(body)
    w = Workspace([home], scan=False)
    w.scan()
    assert names(w) == {"app.yaml", "util.py"}
    w.start()
    try:  # and the same for files appearing while watched
        (home / ".config" / "gh" / "new.yml").write_text("oauth_token: gho_NEW\n")
        (home / "project" / "prod.secret.yaml").write_text("k: v\n")
        (home / "project" / "later.yaml").write_text("ok: 1\n")
        assert w.wait_for(lambda: "later.yaml" in names(w))
        assert w.flush()
        assert names(w) == {"app.yaml", "util.py", "later.yaml"}
        assert "oauth_token" not in str(w.context(home / "project" / "x.yaml", "yaml", 10_000))
    finally:
        w.stop()


def test_deny_list_applies_to_open_documents_and_is_extended_by_the_setting(tmp_path):
    w = Workspace([tmp_path], scan=False)
    w.did_open(tmp_path / "credentials.py", "PASSWORD = 'x'\n", "python")
    w.did_open(tmp_path / "schema.sql", "create table t (x int);\n", "sql")
    w.did_open(tmp_path / "query.sql", "select 1;\n", "sql")
    w.did_open(tmp_path / "fixtures" / "data.py", "ROWS = []\n", "python")
    w.did_open(tmp_path / "models.py", "class M: pass\n", "python")
    assert context_names(w, tmp_path / "main.py") == {"data.py", "models.py"}
    assert context_names(w, tmp_path / "main.py", exclude=["fixtures/*"]) == {"models.py"}
    assert context_names(w, tmp_path / "x.sql", exclude=["schema.*"]) == {"query.sql"}
    # The built-ins, case-insensitively; a project merely named like a secret is not matched above its folder.
    for rel in (".env", ".env.local", "prod.env", "id_ed25519", "ID_RSA.pub", "server.PEM", "tls.key", ".netrc",
                ".npmrc", ".pypirc", "AWS_Credentials", "client_secret.json", "config/secrets/db.yaml"):
        assert secret_match(str(tmp_path / rel), str(tmp_path)) is not None, rel
    for rel in ("main.py", "tokenizer.py", "keyboard.py", "environment.py"):
        assert secret_match(str(tmp_path / rel), str(tmp_path)) is None, rel
    assert secret_match(str(tmp_path / "my-secret-project" / "a.py"), str(tmp_path / "my-secret-project")) is None
    assert secret_match("/home/u/.ssh/config.py") == ".ssh/"
    assert secret_match("/home/u/.aws/cli/alias.py", "/home/u/.aws") == ".aws/"


def test_every_context_file_is_logged_at_debug(tmp_path, caplog):
    w = Workspace([tmp_path], scan=False)
    w.did_open(tmp_path / "helper.py", "def helper(): pass\n", "python")
    with caplog.at_level(logging.DEBUG, logger="completiond.completion.workspace"):
        assert w.context(tmp_path / "main.py", "python", 1000)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("context for")]
    assert len(lines) == 1 and str(tmp_path / "helper.py") in lines[0] and "editor's copy" in lines[0]


# --- 4. a closed ignored file leaves ---------------------------------------------------------------------


def test_closed_gitignored_file_leaves_the_context(tmp_path):
    (tmp_path / ".gitignore").write_text("local_settings.py\n")
    (tmp_path / "local_settings.py").write_text("DB_PASSWORD = 'x'\n")
    w = Workspace([tmp_path], scan=False)
    w.did_open(tmp_path / "local_settings.py", "DB_PASSWORD = 'x'\n", "python")
    assert "local_settings.py" in context_names(w, tmp_path / "main.py")    # open: the user works on it
    w.did_close(tmp_path / "local_settings.py")
    assert w.flush()
    assert "local_settings.py" not in context_names(w, tmp_path / "main.py")
    assert w.get(tmp_path / "local_settings.py") is None


# --- 5. FIFOs, blocking reads and bounded shutdown -----------------------------------------------------


def test_fifo_in_a_watched_folder_blocks_nothing(tmp_path):
    w = Workspace([tmp_path], scan=True).start()
    fifo = tmp_path / "pipe.py"
    try:
        os.mkfifo(fifo)                                      # the watcher sees it created
        w.did_open(fifo, "x = 1\n", "python")                # and the editor opens and closes it
        w.did_close(fifo)
        (tmp_path / "after.py").write_text("AFTER = 1\n")
        assert w.wait_for(lambda: "after.py" in names(w)), "the watcher thread is stuck"
        assert w.flush(10), "the I/O thread is stuck"
        assert "pipe.py" not in names(w)
    finally:
        release_fifo(fifo)
        stopper = threading.Thread(target=w.stop, daemon=True)
        stopper.start()
        stopper.join(30)
        release_fifo(fifo)
    assert not stopper.is_alive(), "stop() hung"


def test_stop_is_bounded_even_when_a_watcher_callback_is_stuck(tmp_path, monkeypatch):
    w = Workspace([tmp_path], scan=False).start()
    stuck, release = threading.Event(), threading.Event()

    def wedged(path):
        stuck.set()
        release.wait(60)

    monkeypatch.setattr(w, "_disk_changed", wedged)
    try:
        (tmp_path / "a.py").write_text("a = 1\n")
        assert stuck.wait(10)
        stopper = threading.Thread(target=w.stop, kwargs={"timeout": 0.5}, daemon=True)
        stopper.start()
        stopper.join(30)
        assert not stopper.is_alive(), "stop() waited for the stuck watcher"
    finally:
        release.set()


# --- 8. folder watches: bounded, removed with their folders, set up off the caller's thread ------------


def test_watches_are_bounded_and_removed_with_their_folders(tmp_path, caplog):
    small, big = tmp_path / "small", tmp_path / "big"
    small.mkdir()
    for i in range(30):
        (big / f"d{i}").mkdir(parents=True)
    (big / "code.py").write_text("BIG = 1\n")
    w = Workspace(scan=True, max_watched_dirs=10)
    w.start()
    try:
        w.add_folder(small, owner="A")
        with caplog.at_level(logging.WARNING, logger="completiond.completion.workspace"):
            w.add_folder(big, owner="A")
        assert set(w._watches) == {str(small)}
        assert "not watching workspace folder" in caplog.text and str(big) in caplog.text
        assert w.wait_for(lambda: "code.py" in names(w))          # scanned all the same
        emitters = len(w._observer.emitters)
        w.remove_folder(small, owner="A")
        assert w._watches == {} and len(w._observer.emitters) == emitters - 1
    finally:
        w.stop()


def test_folder_setup_runs_off_the_callers_thread(tmp_path, monkeypatch):
    gate, counting = threading.Event(), threading.Event()
    real_count = ws_mod._count_dirs

    def slow_count(root, limit):                         # a huge tree (e.g. /usr) being walked
        counting.set()
        gate.wait(30)
        return real_count(root, limit)

    monkeypatch.setattr(ws_mod, "_count_dirs", slow_count)
    w = Workspace(scan=False).start()
    try:
        w.add_folder(tmp_path, owner="A", wait=False)    # returns while the walk is still going
        assert counting.wait(10) and not gate.is_set()
        gate.set()
        assert w.flush()
        assert str(tmp_path) in w._watches
    finally:
        gate.set()
        w.stop()


def test_context_exclude_setting_reaches_the_workspace(tmp_path):
    cfg, errors = config.merge(config.defaults(), {"contextExclude": "*.generated.py"})
    assert errors == []
    w = Workspace([tmp_path], scan=False)
    w.did_open(tmp_path / "api.generated.py", "GEN = 1\n", "python")
    w.did_open(tmp_path / "api.py", "API = 1\n", "python")
    patterns = [p for p in cfg.context_exclude.split(",") if p.strip()]
    assert context_names(w, tmp_path / "main.py", exclude=patterns) == {"api.py"}
