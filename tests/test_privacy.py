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
from completiond.completion.privacy import secret_match
from completiond.completion.workspace import LOCAL, Workspace
from completiond.completion.workspace import watcher as watcher_mod
from completiond.completion.workspace.diskread import Unreadable, read_regular
from completiond.completion.workspace.gitignore import IgnoreRules


def names(ws: Workspace) -> set[str]:
    return {os.path.basename(p) for p in ws.paths()}


def context_names(ws: Workspace, current: Path, owner=LOCAL, **kw) -> set[str]:
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
        w.did_open(a / "notes" / "draft.py", "A_UNSAVED_DRAFT = 3\n", "python", owner="A")
        ctx_b = str(w.context(b / "main.py", "python", 10_000, owner="B"))
        assert "B_CODE" in ctx_b and "A_SECRET" not in ctx_b and "A_UNSAVED" not in ctx_b
        ctx_a = str(w.context(a / "main.py", "python", 10_000, owner="A"))
        assert "A_SECRET" in ctx_a and "A_UNSAVED" in ctx_a and "B_CODE" not in ctx_a
        w.drop_owner("A")                                   # A's editor quit
        assert w.flush()
        assert w.folders("A") == [] and str(a) not in str(w.watcher.watches)
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
    real_context = service.docs.context

    def spy(client, cfg, path, language, *rest):
        # Per (editor, current file): the daemon's prefetch also builds contexts (for open_a.py, say) in the
        # background, which must not be taken for the completion's.
        seen[client, path] = real_context(client, cfg, path, language, *rest)
        return seen[client, path]

    service.docs.context = spy
    try:
        service.notify(1, "workspace", {"folders": [str(a)]})
        service.notify(2, "workspace", {"folders": [str(b)]})
        assert await asyncio.to_thread(service.workspace.flush)
        assert await asyncio.to_thread(service.workspace.wait_for, lambda: service.workspace.get(a / "mine.py", owner=None))
        service.open(1, (a / "open_a.py").as_uri(), 1, "A_OPEN = 2\n", "python")
        service.open(2, (b / "main.py").as_uri(), 1, "x = ", "python")
        service.open(1, (a / "main.py").as_uri(), 1, "x = ", "python")
        recent = {"contextRetrieval": "off"}  # snippets of recent files, whatever the cursor's code names
        await service.complete(2, 1, (b / "main.py").as_uri(), 1, 4, recent)
        await service.complete(1, 1, (a / "main.py").as_uri(), 1, 4, recent)
        assert not any("A_" in str(ctx) for (client, _), ctx in seen.items() if client == 2)
        mine = seen[1, str(a / "main.py")]
        assert "A_ONLY" in str(mine) and "A_OPEN" in str(mine)
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
    assert "local_settings.py" not in context_names(w, tmp_path / "main.py")   # open or not: never context (issue 31)
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

    monkeypatch.setattr(w.disk, "changed", wedged)
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
        assert set(w.watcher.watches) == {str(small)}
        assert "not watching workspace folder" in caplog.text and str(big) in caplog.text
        assert w.wait_for(lambda: "code.py" in names(w))          # scanned all the same
        emitters = len(w.watcher.observer.emitters)
        w.remove_folder(small, owner="A")
        assert w.watcher.watches == {} and len(w.watcher.observer.emitters) == emitters - 1
    finally:
        w.stop()


def test_folder_setup_runs_off_the_callers_thread(tmp_path, monkeypatch):
    gate, counting = threading.Event(), threading.Event()
    real_count = watcher_mod._count_dirs

    def slow_count(root, limit):                         # a huge tree (e.g. /usr) being walked
        counting.set()
        gate.wait(30)
        return real_count(root, limit)

    monkeypatch.setattr(watcher_mod, "_count_dirs", slow_count)
    w = Workspace(scan=False).start()
    try:
        w.add_folder(tmp_path, owner="A", wait=False)    # returns while the walk is still going
        assert counting.wait(10) and not gate.is_set()
        gate.set()
        assert w.flush()
        assert str(tmp_path) in w.watcher.watches
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


# --- issue 31, item 1: one gate for everything that enters a prompt, the current document included --------

# (relative path, text, what the user must be told) for each kind of file; "outside" paths lie beside the
# workspace folder, in a home folder of their own.
GATED = {
    ".env": ("project/.env", "AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI\nDB_", "deny-list"),
    "secrets.py": ("project/app/secrets.py", "DB_PASSWORD = 'hunter2'\nAPI_", "deny-list"),
    "gitignored": ("project/private.py", "PRIVATE_NOTE = 'gitignored text'\nx = ", ".gitignore"),
    "hidden": ("project/.hidden/h.py", "HIDDEN_MARK = 'in a hidden folder'\nx = ", "hidden"),
    "aws credentials": ("home/.aws/credentials", "[default]\naws_secret_access_key = wJalrXUtnFEMI\n", "deny-list"),
    "outside": ("home/notes/todo.py", "OUTSIDE_MARK = 'beside the workspace'\nx = ", "outside the workspace"),
}


def gated_tree(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    (project / "app").mkdir(parents=True)
    (project / ".gitignore").write_text("private.py\n")
    for rel, text, _ in GATED.values():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (project / "ordinary.py").write_text("ORDINARY_MARK = 1\n")
    return project


async def remote_service(url: str, backend: str, project: Path):
    from completiond.serving.service import Service

    cfg, errors = config.merge(config.Config(), {"backend": backend, "endpoint": url, "multiline": "never",
                                                 "endpointModel": "qwen2.5-coder", "endpointTimeout": 2.0})
    assert not errors, errors
    service = Service(cfg)
    service.start_loading()
    for _ in range(200):
        if service.state == "ready":
            break
        await asyncio.sleep(0.02)
    assert service.state == "ready", service.error
    service.notify("ed", "workspace", {"folders": [str(project)]})
    assert await asyncio.to_thread(service.workspace.flush)
    return service


def all_sent(server) -> str:
    return str([r["body"] for r in server.plan.requests])


@pytest.mark.parametrize("backend", ["openai", "llamacpp-infill"])
@pytest.mark.parametrize("kind", sorted(GATED))
async def test_current_document_of_each_kind_never_reaches_the_server(tmp_path, backend, kind):
    from remote_servers import FakeServer

    project = gated_tree(tmp_path)
    rel, text, why = GATED[kind]
    server = FakeServer()
    server.plan.pieces = ["42"]
    service = await remote_service(server.url, backend, project)
    try:
        uri = (tmp_path / rel).as_uri()
        service.open("ed", uri, 1, text, "python")
        result = await service.complete("ed", 1, uri, 1, len(text))
        assert result["suggestion"] is None and result["finish_reason"] == "excluded"
        assert any(why in w for w in result["warnings"]), result["warnings"]
        assert server.plan.requests == [], all_sent(server)
        # The same daemon, the same server: an ordinary file of the folder is served (the server works).
        ok = (project / "ordinary.py").as_uri()
        service.open("ed", ok, 1, "ORDINARY_MARK = 1\nx = ", "python")
        assert (await service.complete("ed", 2, ok, 1, 22))["suggestion"]["text"] == "42"
        sent = all_sent(server)
        assert len(server.plan.requests) == 1 and "ORDINARY_MARK" in sent
        for secret in ("wJalrXUtnFEMI", "hunter2", "PRIVATE_NOTE", "HIDDEN_MARK", "OUTSIDE_MARK"):
            assert secret not in sent, (secret, sent)   # nor as context for the ordinary file
    finally:
        service.shutdown()
        server.close()


@pytest.mark.parametrize("retrieval", ["off", "on"])
@pytest.mark.parametrize("backend", ["openai", "llamacpp-infill"])
async def test_open_restricted_documents_are_never_context_for_another_file(tmp_path, backend, retrieval):
    from remote_servers import FakeServer

    project = gated_tree(tmp_path)
    (project / "data.py").write_text("EXCLUDED_MARK = 1\n")
    (project / "helper.py").write_text("HELPER_MARK = 1\n")
    server = FakeServer()
    server.plan.pieces = ["1"]
    service = await remote_service(server.url, backend, project)
    try:
        for rel, text, _ in GATED.values():   # open in the editor, with unsaved text
            service.open("ed", (tmp_path / rel).as_uri(), 1, text + "  # unsaved", "python")
        service.open("ed", (project / "data.py").as_uri(), 1, "EXCLUDED_MARK = 2\n", "python")
        service.open("ed", (project / "helper.py").as_uri(), 1, "HELPER_MARK = 2\n", "python")
        uri = (project / "main.py").as_uri()
        # The cursor's code names every mark, so retrieval would pick each file that defines one.
        text = "total = HELPER_MARK + PRIVATE_NOTE + HIDDEN_MARK + OUTSIDE_MARK + EXCLUDED_MARK + DB_PASSWORD\nx = "
        service.open("ed", uri, 1, text, "python")
        result = await service.complete("ed", 1, uri, 1, len(text),
                                        {"contextExclude": "data.py", "contextRetrieval": retrieval})
        assert result["suggestion"]["text"] == "1"
        sent = all_sent(server).replace(text.replace("\n", "\\n"), "")   # the cursor's own line aside
        assert "HELPER_MARK = 2" in sent                                # ordinary open files are context
        for mark in ("wJalrXUtnFEMI", "hunter2", "PRIVATE_NOTE =", "HIDDEN_MARK =", "OUTSIDE_MARK =", "EXCLUDED_MARK ="):
            assert mark not in sent, (mark, sent)
    finally:
        service.shutdown()
        server.close()


async def test_the_local_engine_gets_no_secret_file_and_keeps_the_others(tmp_path):
    from test_scheduler import FakeEngine, ready_service

    project = gated_tree(tmp_path)
    engine = FakeEngine(continuation="z\n")
    service = await ready_service(engine)
    try:
        service.notify("ed", "workspace", {"folders": [str(project)]})
        assert await asyncio.to_thread(service.workspace.flush)
        for kind, (rel, text, why) in sorted(GATED.items()):
            uri = (tmp_path / rel).as_uri()
            service.open("ed", uri, 1, text, "python")
            calls = len(engine.calls)
            result = await service.complete("ed", 1, uri, 1, len(text))
            if why == "deny-list":   # no completion at all, locally too, and the editor is told why
                assert len(engine.calls) == calls and result["finish_reason"] == "excluded", kind
                assert "deny-list" in result["warnings"][0], kind
            else:                    # hidden, ignored, outside: the local model completes as ever
                assert len(engine.calls) == calls + 1 and result["suggestion"]["text"] == "z", kind
        # A deny-listed file seen through another scheme (a git diff view) is the same file.
        service.open("ed", "git:/x/project/.env?ref=HEAD", 1, "KEY=", "")
        result = await service.complete("ed", 1, "git:/x/project/.env?ref=HEAD", 1, 4)
        assert result["finish_reason"] == "excluded"
    finally:
        service.shutdown()


def test_classify_names_each_rule(tmp_path):
    from completiond.completion.privacy import Admission, classify

    project = gated_tree(tmp_path)
    (project / "link.py").symlink_to(tmp_path / "home" / "notes" / "todo.py")
    rules = IgnoreRules(str(project))
    roots = [str(project)]

    def verdict(rel, **kw):
        return classify(str(tmp_path / rel), roots, ignored=lambda root, p: rules.ignored(p), **kw)

    assert verdict("project/ordinary.py").admission is Admission.LOCAL_AND_REMOTE
    assert classify(None, roots).admission is Admission.LOCAL_AND_REMOTE             # an untitled buffer
    for rel in ("project/.env", "project/app/secrets.py", "home/.aws/credentials", "project/id_rsa"):
        assert verdict(rel).admission is Admission.DENIED, rel
    for rel in ("project/private.py", "project/.hidden/h.py", "project/.eslintrc.js", "home/notes/todo.py",
                "project/node_modules/x/index.js", "project/link.py"):
        assert verdict(rel).admission is Admission.LOCAL_ONLY, rel
    assert verdict("project/data.py", exclude=["data.py"]).admission is Admission.LOCAL_ONLY
    assert "outside" in verdict("project/link.py").reason
