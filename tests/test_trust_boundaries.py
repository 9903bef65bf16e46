"""Issue 43: a request is served only under the backend its editor asked for, and a model name means what
it says (a repository cannot shadow the user's model, nor run its code through trustRemoteCode)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from completiond import config
from completiond.serving.client import daemon_command
from completiond.serving.wire import Code

ROOT = Path(__file__).resolve().parent.parent
SENTINEL = "PRIVATE_PROJECT_SENTINEL = 1\nx = "


# --- 1. one daemon, two editors' settings ------------------------------------------------------------


async def remote_daemon_service(url: str):
    """The Service of a daemon editor A started with a team server (backend openai at `url`)."""
    from completiond.serving.service import Service

    cfg, errors = config.merge(config.Config(), {"backend": "openai", "endpoint": url, "multiline": "never",
                                                 "endpointModel": "qwen2.5-coder", "endpointTimeout": 2.0})
    assert not errors, errors
    service = Service(cfg)
    service.start_loading()
    for _ in range(200):
        if service.state == "ready":
            break
        await asyncio.sleep(0.02)
    assert service.state == "ready", service.error
    return service


def editor_request(cfg, uri: str) -> dict:
    """What an LSP sends for one completion (lsp/server.py: request_settings)."""
    return {"uri": uri, "version": 1, "offset": len(SENTINEL), "settings": config.request_settings(cfg)}


async def test_a_local_editor_never_gets_a_remote_answer_from_a_shared_daemon(tmp_path):
    from remote_servers import FakeServer

    from completiond.serving.service import ServiceError

    server, other = FakeServer(), FakeServer()
    server.plan.pieces = other.plan.pieces = ["42"]
    service = await remote_daemon_service(server.url)
    try:
        uri = (tmp_path / "private.py").as_uri()
        service.notify("editor-b", "workspace", {"folders": [str(tmp_path)]})
        service.open("editor-b", uri, 1, SENTINEL, "python")
        local_editor = config.defaults()                      # backend = local, the default
        elsewhere, _ = config.merge(config.defaults(), {"backend": "openai", "endpoint": other.url})
        for cfg, said in ((local_editor, "backend = local"), (elsewhere, other.url)):
            with pytest.raises(ServiceError) as refused:
                await service.request("editor-b", 1, "complete", editor_request(cfg, uri))
            assert refused.value.code == Code.NOT_READY
            assert said in refused.value.message and server.url in refused.value.message, refused.value.message
        # A request that names no backend at all (an older client) counts as local.
        with pytest.raises(ServiceError):
            await service.request("editor-b", 2, "complete", {"uri": uri, "version": 1, "offset": 3})
        assert server.plan.requests == [] and other.plan.requests == []   # the sentinel went nowhere
        # Editor A, whose settings chose this server, is served by it (trailing slash aside).
        mine, _ = config.merge(config.defaults(), {"backend": "openai", "endpoint": server.url + "/"})
        service.open("editor-a", uri, 1, SENTINEL, "python")
        service.notify("editor-a", "workspace", {"folders": [str(tmp_path)]})
        assert await asyncio.to_thread(service.workspace.flush)
        result = await service.request("editor-a", 3, "complete", editor_request(mine, uri))
        assert result["suggestion"]["text"] == "42" and len(server.plan.requests) == 1
    finally:
        service.shutdown()
        server.close()
        other.close()


def test_the_reverse_mismatch_stays_a_warning():
    """A remote backend asked, the local model serving: nothing leaves the machine, so it is served."""
    asked, _ = config.merge(config.defaults(), {"backend": "openai", "endpoint": "https://gpu-box:8443"})
    assert config.route_refusal(config.request_settings(asked), config.defaults()) == ""


def test_every_request_carries_the_editors_backend_and_endpoint():
    cfg, _ = config.merge(config.defaults(), {"backend": "openai", "endpoint": "https://gpu-box:8443"})
    sent = config.request_settings(cfg)
    assert sent["backend"] == "openai" and sent["endpoint"] == "https://gpu-box:8443"
    assert "model" not in sent and "apiKeyFile" not in sent       # engine settings stay in the hello
    lsp = (ROOT / "lsp" / "server.py").read_text()
    complete = (ROOT / "completiond" / "commands" / "complete.py").read_text()
    assert "config_mod.request_settings(self.cfg)" in lsp and "config_mod.request_settings(cfg)" in complete


# --- 2. a model name means what it says ---------------------------------------------------------------


def plant(repo: Path, name: str) -> Path:
    """A cloned repository holding a folder named like the user's model, with code to run."""
    planted = repo / name
    planted.mkdir(parents=True)
    (planted / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": {"AutoModel": "modeling_evil.X"}}))
    (planted / "modeling_evil.py").write_text("raise SystemExit('ran the repository code')\n")
    return planted


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-Coder-0.5B", "qwen2.5-coder-1.5b"])
def test_a_repository_folder_never_shadows_a_hub_id_or_short_name(tmp_path, monkeypatch, name):
    from completiond.engine import hub
    from completiond.serving.lifecycle import missing_model, resolve_model

    repo = tmp_path / "evilrepo"
    plant(repo, name)
    monkeypatch.chdir(repo)                                    # Neovim's LSP runs in the project
    cmd = daemon_command({"model": name, "draftModel": name, "trustRemoteCode": True})
    assert cmd[cmd.index("--model") + 1] == name and cmd[cmd.index("--draft-model") + 1] == name
    assert resolve_model(name) == name and missing_model(name) == ""
    assert not hub.is_local(name) and not config.is_local_model(name)
    diff = config.engine_differences({"model": name}, {"model": str(repo / name)})
    assert diff, "a hub id and a folder of the same name are different models"


@pytest.mark.parametrize("name", ["org/planted", "qwen2.5-coder-0.5b"])
def test_engine_load_asks_the_hub_cache_not_the_working_directory(tmp_path, monkeypatch, tiny_model_dir, name):
    """The planted folder is a loadable model: were it read, the load would succeed."""
    import shutil

    from completiond.engine.engine import Engine, EngineError

    repo = tmp_path / "evilrepo"
    (repo / name).parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tiny_model_dir, repo / name)
    monkeypatch.chdir(repo)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(EngineError, match="not in the local Hugging Face cache"):
        Engine.load(name, device="cpu")
    # Written as a path, the same folder is a local model.
    assert Path(Engine.load(f"./{name}", device="cpu").model_dir).resolve() == (repo / name).resolve()


def test_explicit_paths_are_local_and_relative_ones_follow_their_config_file(tmp_path, monkeypatch):
    for value in ("./m", "../m", "/abs/m", "~/m", ".", ".."):
        assert config.is_local_model(value), value
    for value in ("m", "org/m", "qwen2.5-coder-1.5b", ".hidden", "org/m@v1"):
        assert not config.is_local_model(value), value
    folder = tmp_path / "dotfiles" / "completiond"
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text('model = "./models/mine"\ndraftModel = "org/draft"\n'
                                        'apiKeyFile = "team.key"\nendpointCaFile = "~/ca.pem"\n')
    elsewhere = tmp_path / "project"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg, errors = config.load_file(folder / "config.toml")
    assert not errors, errors
    assert cfg.model == str(folder / "models" / "mine")         # the file's folder, never the working directory
    assert cfg.draft_model == "org/draft"
    assert cfg.api_key_file == str(folder / "team.key")
    assert cfg.endpoint_ca_file == "~/ca.pem"                   # the daemon expands ~ itself


def test_editor_settings_refuse_relative_directories():
    base = config.defaults()
    cfg, errors = config.merge(base, {"model": "./models/mine", "draftModel": "../draft", "apiKeyFile": "key"},
                               source="editor settings")
    assert cfg.model == "" and cfg.draft_model == "" and cfg.api_key_file == ""
    assert len(errors) == 3 and all("relative path" in e and "editor settings" in e for e in errors), errors
    cfg, errors = config.merge(base, {"model": "/opt/models/mine", "draftModel": "~/draft",
                                      "apiKeyFile": "/etc/key"}, source="editor settings")
    assert not errors and cfg.model == "/opt/models/mine" and cfg.draft_model == "~/draft"
    lsp = (ROOT / "lsp" / "server.py").read_text()
    assert 'source="editor settings"' in lsp


def test_trust_remote_code_is_a_machine_setting_in_vscode():
    schema = {s["key"]: s for s in config.schema()}
    assert schema["trustRemoteCode"].get("scope") == "machine"
    pkg = json.loads((ROOT / "editors" / "vscode" / "package.json").read_text())
    sections = pkg["contributes"]["configuration"]
    props = {k: v for section in (sections if isinstance(sections, list) else [sections])
             for k, v in section["properties"].items()}
    assert props["completiond.trustRemoteCode"]["scope"] == "machine"


def test_the_daemon_runs_in_root_so_paths_go_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cmd = daemon_command({"model": "./here", "draftModel": "~/there"})
    assert cmd[cmd.index("--model") + 1] == str(tmp_path / "here")
    assert cmd[cmd.index("--draft-model") + 1] == os.path.expanduser("~/there")
