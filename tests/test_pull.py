"""`completiond pull` and hub models (issue 14, part 1), without network.

A real Hugging Face hub cache is built in a temp dir from the bundled model, in the hub's own
layout (models--org--name/{blobs,refs/main,snapshots/<commit>}), and checked with the hub's own
offline tools before anything of ours reads it. The hub endpoint is always a closed loopback
port, so a test that reached for the network would fail instead of downloading.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from completiond.engine import hub, memory, resumable

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "models" / "completiond-py-mini"
REPO = "completiond/py-mini"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_hub_cache(root: Path, repo: str, source: Path, commit: str = COMMIT, ref: str = "main",
                   skip: tuple[str, ...] = (), config: dict | None = None) -> Path:
    """The hub's cache layout: content-addressed blobs, a snapshot of relative links to them, refs/<ref>."""
    folder = root / ("models--" + repo.replace("/", "--"))
    blobs, snapshot = folder / "blobs", folder / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(source.iterdir()):
        if not f.is_file() or f.name in skip:
            continue
        data = f.read_bytes()
        if f.name == "config.json" and config is not None:
            data = json.dumps({**json.loads(data), **config}).encode()
        # LFS files are named by their sha256, regular git files by their git blob sha1, as the hub does.
        digest = (hashlib.sha256(data).hexdigest() if f.suffix == ".safetensors"
                  else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())
        (blobs / digest).write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blobs / digest, snapshot))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    snapshot = make_hub_cache(root, REPO, BUNDLED)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    return root, snapshot


class FakeHub:
    """The hub's HTTP API as far as a pull uses it, on a loopback port: a model's file list
    (/api/models/<repo>) and its files by commit (HEAD and GET /<repo>/resolve/<commit>/<file>).
    Every request is recorded, so a test can tell what was fetched."""

    def __init__(self):
        self.repos: dict[str, tuple[str, dict[str, bytes]]] = {}
        self.requests: list[tuple[str, str]] = []
        self.gated: set[str] = set()  # repos whose files need an accepted licence (403, as the hub answers)
        self.wrong: set[str] = set()  # files whose metadata gives another hash than their contents have
        # file -> bytes sent before the connection stalls, on its first whole-file GET (an interrupted download)
        self.stall: dict[str, int] = {}
        self.release = threading.Event()  # ends the stalled responses
        self.ranges: list[tuple[str, str | None]] = []  # (file, Range header) of each GET of a file
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._route(body=True)

            def do_HEAD(self):
                self._route(body=False)

            def _route(self, body: bool) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"]:
                    repo = "/".join(parts[2:4])
                    if repo not in hub.repos:
                        return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
                    commit, files = hub.repos[repo]
                    info = {"id": repo, "sha": commit, "private": False, "gated": False,
                            "siblings": [hub.sibling(f, d) for f, d in files.items()]}
                    return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
                if len(parts) >= 5 and parts[2] == "resolve":
                    if "/".join(parts[:2]) in hub.gated:
                        return self._send(403, b'{"error": "Access to model is restricted"}',
                                          {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model is restricted"})
                    commit, files = hub.repos.get("/".join(parts[:2]), ("", {}))
                    data = files.get("/".join(parts[4:]))
                    if data is None:
                        return self._send(404, b"", {"X-Error-Code": "EntryNotFound"})
                    etag = hashlib.sha256(data).hexdigest()
                    name = "/".join(parts[4:])
                    wanted = self.headers.get("Range")
                    if body:
                        hub.ranges.append((name, wanted))
                    start = int(m.group(1)) if wanted and (m := re.fullmatch(r"bytes=(\d+)-", wanted)) else 0
                    headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"'}
                    if start:
                        headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                        return self._send(206, data[start:] if body else b"", headers, length=len(data) - start)
                    cut = hub.stall.pop(name, None) if body else None
                    if cut is not None:  # send the first `cut` bytes, then hang until released: a dead download
                        self.send_response(200)
                        for key, value in headers.items():
                            self.send_header(key, value)
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        self.wfile.write(data[:cut])
                        self.wfile.flush()
                        hub.release.wait(120)
                        self.close_connection = True
                        return None
                    return self._send(200, data if body else b"", headers, length=len(data))
                self._send(404, b"")

            def _send(self, code: int, data: bytes, headers: dict | None = None, length: int | None = None) -> None:
                self.send_response(code)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data) if length is None else length))
                self.end_headers()
                if data:
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, repo: str, source: Path, commit: str = COMMIT, extra: dict[str, bytes] | None = None,
            skip: tuple[str, ...] = (), config: dict | None = None) -> None:
        files = {f.name: f.read_bytes() for f in sorted(source.iterdir()) if f.is_file() and f.name not in skip}
        if config is not None:
            files["config.json"] = json.dumps({**json.loads(files["config.json"]), **config}).encode()
        files.update(extra or {})
        self.repos[repo] = (commit, files)

    def sibling(self, name: str, data: bytes) -> dict:
        """A file's entry in the model info, with the hashes the hub gives: sha256 for LFS files (weights),
        the git blob id for the others."""
        if name in self.wrong:
            data = data + b"tampered"
        if name.endswith(".safetensors"):
            return {"rfilename": name, "size": len(data), "lfs": {"size": len(data), "pointerSize": 134,
                                                                   "sha256": hashlib.sha256(data).hexdigest()}}
        blob = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
        return {"rfilename": name, "size": len(data), "blobId": blob}

    def fetched(self) -> list[str]:
        """Files whose contents were downloaded (GET)."""
        return [p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p in self.requests if m == "GET" and "/resolve/" in p]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_hub():
    server = FakeHub()
    yield server
    server.close()


def pull_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    return subprocess.run([sys.executable, "-m", "completiond.cli", "pull", *args], capture_output=True, text=True,
                          env=full, timeout=120, cwd=ROOT)


# --- the cache layout, as the hub itself reads it --------------------------------------------------


@pytest.mark.torch_free
def test_the_built_cache_is_one_the_hub_library_resolves_offline(cache):
    from huggingface_hub import scan_cache_dir, snapshot_download, try_to_load_from_cache

    root, snapshot = cache
    assert Path(snapshot_download(REPO, cache_dir=root, local_files_only=True)) == snapshot
    assert Path(try_to_load_from_cache(REPO, "model.safetensors", cache_dir=root)).resolve() == \
        (snapshot / "model.safetensors").resolve()
    (info,) = scan_cache_dir(root).repos
    assert info.repo_id == REPO and [r.commit_hash for r in info.revisions] == [COMMIT]
    assert hub.cached_snapshot(REPO) == snapshot and hub.cached_snapshot(REPO, "main") == snapshot
    assert hub.cached_snapshot(REPO, COMMIT) == snapshot
    assert hub.cached_snapshot(REPO, "v2") is None


@pytest.mark.torch_free
def test_an_incomplete_snapshot_is_not_taken_for_the_model(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    snapshot = make_hub_cache(root, REPO, BUNDLED)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    (snapshot / "model.safetensors").resolve().unlink()  # an interrupted download: the link dangles
    assert hub.missing_files(snapshot) == ["*.safetensors weights"]
    assert hub.cached_snapshot(REPO) is None


# --- completiond pull ------------------------------------------------------------------------------


@pytest.mark.torch_free
def test_pull_of_a_cached_model_downloads_nothing_and_says_so(cache):
    root, snapshot = cache
    env = {"HF_HUB_CACHE": str(root), "HF_ENDPOINT": os.environ["HF_ENDPOINT"]}
    out = pull_cli(REPO, env=env)
    assert out.returncode == 0, out.stderr
    assert f"{REPO}@{COMMIT[:12]} is already in the cache" in out.stdout and "nothing downloaded" in out.stdout
    assert out.stderr == ""  # no progress bar for a model that is there
    out = pull_cli(f"{REPO}@main", "--json", env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["cached"] is True and result["downloaded_bytes"] == 0
    assert result["model"] == f"{REPO}@{COMMIT[:12]}" and Path(result["path"]) == snapshot
    assert 5_000_000 < result["parameters"] < 7_000_000  # the bundled model: 6.0M parameters


@pytest.mark.torch_free
def test_pull_from_an_unreachable_hub_fails_at_once_with_what_to_do(tmp_path):
    port = closed_port()
    out = pull_cli("qwen2.5-coder-0.5b", env={"HF_HUB_CACHE": str(tmp_path / "empty"),
                                              "HF_ENDPOINT": f"http://127.0.0.1:{port}"})
    assert out.returncode == 1
    err = out.stderr
    assert f"cannot reach the Hugging Face hub (http://127.0.0.1:{port}) for Qwen/Qwen2.5-Coder-0.5B" in err
    assert "local model directory" in err and "on a connected machine and copy" in err
    assert "models--Qwen--Qwen2.5-Coder-0.5B" in err
    assert "Retrying" not in err and "Traceback" not in err
    assert not (tmp_path / "empty" / "models--Qwen--Qwen2.5-Coder-0.5B" / "blobs").exists()


@pytest.mark.torch_free
def test_pull_offline_says_the_model_is_not_cached_and_what_to_do(tmp_path):
    out = pull_cli("org/absent@v1", env={"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1",
                                         "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}"})
    assert out.returncode == 1
    assert "org/absent@v1 is not in the local Hugging Face cache" in out.stderr and "HF_HUB_OFFLINE" in out.stderr
    assert "copy its models--org--absent folder" in out.stderr


@pytest.mark.torch_free
def test_pull_refuses_a_cached_remote_code_model_unless_trusted(tmp_path):
    root = tmp_path / "hub"
    make_hub_cache(root, "org/custom", BUNDLED, config={"auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}})
    env = {"HF_HUB_CACHE": str(root), "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}"}
    out = pull_cli("org/custom", env=env)
    assert out.returncode == 1
    assert "its config names its own Python code (modeling_x.XForCausalLM)" in out.stderr
    assert "trustRemoteCode" in out.stderr
    out = pull_cli("org/custom", "--trust-remote-code", env=env)
    assert out.returncode == 0, out.stderr


@pytest.mark.torch_free
def test_pull_needs_a_model_and_lists_the_short_names():
    out = subprocess.run([sys.executable, "-m", "completiond.cli", "pull"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and "completiond pull --list" in out.stderr
    out = subprocess.run([sys.executable, "-c", "import sys; from completiond.cli import main; rc = main(['pull', "
                          "'--list']); assert 'torch' not in sys.modules, 'pull imported torch'; sys.exit(rc)"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("short name") and "\nqwen2.5-coder-0.5b " in out.stdout
    assert "Qwen/Qwen2.5-Coder-0.5B" in out.stdout


@pytest.mark.torch_free
def test_pull_list_is_a_terminal_table_of_loadable_models():
    """Issue 30: `pull --list` printed Markdown rows up to 251 characters and listed starcoder2-3b as if it
    could load. Now: aligned rows within 100 columns, loadable models only, the others with the reason."""
    from completiond.commands.pull import catalog_text

    text = catalog_text()
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    assert not any(line.startswith("|") for line in lines)
    table, _, rest = text.partition("not loadable yet")
    for e in hub.CATALOG:
        if e.supported:
            assert re.search(rf"^{re.escape(e.name)}  ", table, re.M), e.name
            assert e.repo in table
        else:
            assert e.name not in table and f"{e.name} ({e.repo}): the engine has no `{e.family}` layout" in rest
    # The rows line up: every row's parameter count ends in the same column as the header's.
    header = lines[0]
    end = header.index("params") + len("params")
    rows = [line for line in lines[1:] if line and not line.startswith(" ") and " B " in line]
    assert rows and all(row[:end].endswith(" B") for row in rows), rows


@pytest.mark.torch_free
def test_readme_shows_the_catalog_as_the_code_has_it():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert hub.catalog_table() in readme, "README's model table is stale: paste `completiond pull --list`"
    assert "| `completiond pull MODEL" in readme


# --- what a download would fetch, decided before it starts -------------------------------------------


@pytest.mark.torch_free
def test_only_safetensors_config_and_tokenizer_are_chosen():
    files = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "merges.txt",
             "vocab.json", "model.safetensors", "pytorch_model.bin", "README.md", "onnx/model.onnx",
             "original/consolidated.pth", "flax_model.msgpack", "modeling_x.py", ".gitattributes"]
    chosen = hub.choose_files("org/m", files)
    assert sorted(chosen) == sorted(["config.json", "generation_config.json", "tokenizer.json",
                                     "tokenizer_config.json", "merges.txt", "vocab.json", "model.safetensors"])
    assert "modeling_x.py" in hub.choose_files("org/m", files, trust_remote_code=True)
    sharded = ["config.json", "tokenizer.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "consolidated.safetensors"]
    assert sorted(hub.choose_files("org/m", sharded)) == ["config.json", "model.safetensors.index.json", "tokenizer.json"]
    assert hub.choose_files("org/m", ["config.json", "tokenizer.json", "model.safetensors",
                                      "consolidated.safetensors"])[-1:] == ["model.safetensors"]


@pytest.mark.torch_free
def test_a_pickle_only_repository_is_refused_before_any_download():
    with pytest.raises(hub.HubError, match=r"only pickle weights \(pytorch_model.bin\).*safetensors"):
        hub.choose_files("org/old", ["config.json", "tokenizer.json", "pytorch_model.bin"])
    with pytest.raises(hub.HubError, match="no \\*.safetensors weights"):
        hub.choose_files("org/empty", ["config.json", "README.md"])


@pytest.mark.torch_free
def test_remote_code_and_unsupported_families_are_refused_from_the_config():
    with pytest.raises(hub.HubError, match="its own Python code"):
        hub.check_config("org/x", {"model_type": "llama", "auto_map": {"AutoConfig": "c.C"}})
    hub.check_config("org/x", {"model_type": "llama", "auto_map": {"AutoConfig": "c.C"}}, trust_remote_code=True)
    with pytest.raises(hub.HubError, match="'starcoder2' model, which the engine cannot run yet"):
        hub.check_config("bigcode/starcoder2-3b", {"model_type": "starcoder2"})
    for family in ("llama", "qwen2", "qwen3", "mistral"):
        hub.check_config("org/x", {"model_type": family})


@pytest.mark.torch_free
def test_names_short_names_and_revisions():
    assert hub.parse("qwen2.5-coder-7b") == ("Qwen/Qwen2.5-Coder-7B", None)
    assert hub.parse("Qwen/Qwen2.5-Coder-7B@v1.0") == ("Qwen/Qwen2.5-Coder-7B", "v1.0")
    for bad in ("gpt2", "a/b/c", "../x/y", "org/na me"):
        with pytest.raises(hub.HubError, match="neither a local directory"):
            hub.parse(bad)
    assert hub.display_name("org/m", None, COMMIT) == f"org/m@{COMMIT[:12]}"
    assert hub.display_name("org/m", "v1", COMMIT) == f"org/m@v1 ({COMMIT[:12]})"
    assert hub.name_for_path(Path("/c/models--org--m/snapshots") / COMMIT) == f"org/m@{COMMIT[:12]}"
    assert hub.name_for_path(Path("/home/me/models/m")) is None


@pytest.mark.torch_free
def test_revisions_must_match_a_strict_pattern(tmp_path, monkeypatch):
    """A revision is joined into the cache's refs/ path, for reading and for writing (issue 31, item 5)."""
    for good in ("main", "v1.0", "refs/pr/1", "release_2024-01", COMMIT, "v2+build"):
        assert hub.parse(f"org/m@{good}") == ("org/m", good)
    for bad in ("../../../../tmp/x", "../x", "a/../b", "/etc/passwd", "x//y", ".hidden", "a/.b", "main.lock", "a.",
                "v1 0", "x\\y", "a\x00b", "~user", "a" * 200):
        with pytest.raises(hub.HubError, match="is not a revision"):
            hub.parse(f"a/b@{bad}")
    # Nor does the cache lookup read a file outside refs/ for one that slipped past parse.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    (tmp_path / "x").write_text(COMMIT)
    (tmp_path / "models--a--b" / "refs").mkdir(parents=True)
    assert hub._ref(tmp_path / "models--a--b", "../../x") is None  # noqa: SLF001


@pytest.mark.torch_free
def test_parameters_are_counted_from_the_headers_alone(tmp_path):
    header = json.dumps({"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
                         "b": {"dtype": "BF16", "shape": [5], "data_offsets": [48, 58]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 58)
    assert memory.parameter_count(tmp_path) == 17
    (tmp_path / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little"))
    with pytest.raises(ValueError, match="header"):
        memory.parameter_count(tmp_path)


# --- loading by hub id, offline --------------------------------------------------------------------


def test_a_hub_id_loads_offline_from_the_cache_under_its_human_name(cache, monkeypatch):
    from transformers import AutoTokenizer

    from completiond.engine.engine import Engine, SamplingParams

    root, snapshot = cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # transformers' own offline path reads the same cache by hub id
    assert len(AutoTokenizer.from_pretrained(REPO, cache_dir=root, local_files_only=True)) > 1000
    engine = Engine.load(REPO, device="cpu")
    assert engine.name == f"{REPO}@{COMMIT[:12]}"
    direct = Engine.load(BUNDLED, device="cpu")
    assert direct.name == str(BUNDLED.resolve())  # a directory is shown as its path
    # the same weights: the same identity (so the same calibration record), template and output
    assert engine.model_id == direct.model_id
    assert engine.info.fim_template == "completiond" and engine.calibration.source.startswith("model default")
    ids = engine.tokenizer("def parse(text):\n    ").input_ids
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    assert engine.generate(ids, params).tokens == direct.generate(ids, params).tokens


def test_a_hub_id_missing_offline_is_a_clear_engine_error(tmp_path, monkeypatch):
    from completiond.engine.engine import Engine, EngineError

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(EngineError, match="not in the local Hugging Face cache.*local model directory"):
        Engine.load("org/absent", device="cpu")


def test_the_bundled_model_is_named_not_hashed():
    from completiond.engine.engine import Engine

    engine = Engine.load(None, device="cpu")
    assert engine.name == "completiond-py-mini (bundled)"
    assert engine.model_id not in engine.name


# --- downloads, from a loopback stand-in for the hub -------------------------------------------------


@pytest.mark.torch_free
def test_pull_downloads_safetensors_config_and_tokenizer_with_a_progress_bar(fake_hub, tmp_path):
    fake_hub.add("org/mini", BUNDLED, extra={"pytorch_model.bin": b"\x80" * 64, "onnx/model.onnx": b"o" * 64,
                                             "modeling_mini.py": b"raise SystemExit\n"})
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_ENDPOINT": fake_hub.url}
    out = pull_cli("org/mini", env=env)
    assert out.returncode == 0, out.stderr
    fetched = fake_hub.fetched()
    assert fetched[0] == "config.json" and fetched[-1] == "model.safetensors"
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "completiond.json"} <= set(fetched)
    assert not {"pytorch_model.bin", "onnx/model.onnx", "modeling_mini.py", "MODEL_CARD.md", "loss_curves.png"} & set(fetched)
    assert "100%" in out.stderr and "org/mini" in out.stderr  # the terminal's progress bar
    assert f"org/mini@{COMMIT[:12]}: downloaded" in out.stdout
    snapshot = tmp_path / "hub" / "models--org--mini" / "snapshots" / COMMIT
    assert (tmp_path / "hub" / "models--org--mini" / "refs" / "main").read_text() == COMMIT
    assert hub.missing_files(snapshot) == []
    # the second time: from the cache, without a single request
    before = len(fake_hub.requests)
    out = pull_cli("org/mini", env=env)
    assert out.returncode == 0 and "already in the cache" in out.stdout
    assert len(fake_hub.requests) == before


def test_an_interrupted_pull_resumes_where_it_stopped(fake_hub, tmp_path):
    """A pull killed half-way through the weights (the editor closed, the network dropped) leaves what it
    had; the next pull asks the hub only for the rest (an HTTP Range request), and the file it assembles
    passes the hub's sha256."""
    fake_hub.add("org/mini", BUNDLED)
    weights = (BUNDLED / "model.safetensors").read_bytes()
    fake_hub.stall["model.safetensors"] = len(weights) - 1000
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_ENDPOINT": fake_hub.url}
    first = subprocess.Popen([sys.executable, "-m", "completiond.cli", "pull", "org/mini"], env=env, cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    blobs = tmp_path / "hub" / "models--org--mini" / "blobs"
    deadline = time.monotonic() + 120

    def partial() -> int:
        return max([f.stat().st_size for f in blobs.glob("*" + resumable.PARTIAL_SUFFIX)] or [0]) if blobs.is_dir() else 0

    while time.monotonic() < deadline and first.poll() is None and partial() < len(weights) // 2:
        time.sleep(0.1)
    first.kill()
    first.wait()
    fake_hub.release.set()
    partial = partial()
    assert partial > 0, "the first pull wrote nothing before it was interrupted"
    out = pull_cli("org/mini", env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_ENDPOINT": fake_hub.url})
    assert out.returncode == 0, out.stderr
    asked = [r for f, r in fake_hub.ranges if f == "model.safetensors"]
    assert asked[0] is None and asked[-1] == f"bytes={partial}-", asked  # only the rest, the second time
    snapshot = tmp_path / "hub" / "models--org--mini" / "snapshots" / COMMIT
    assert (snapshot / "model.safetensors").read_bytes() == weights


@pytest.mark.torch_free
@pytest.mark.parametrize("what, files, message", [
    ("pickle-only", {"skip": ("model.safetensors",), "extra": {"pytorch_model.bin": b"\x80" * 64}},
     "only pickle weights (pytorch_model.bin)"),
    ("remote code", {"config": {"auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}}, "its own Python code"),
    ("unsupported family", {"config": {"model_type": "starcoder2"}}, "'starcoder2' model, which the engine cannot run"),
])
def test_refused_repositories_cost_no_weights(fake_hub, tmp_path, what, files, message):
    fake_hub.add("org/bad", BUNDLED, **files)
    out = pull_cli("org/bad", env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_ENDPOINT": fake_hub.url})
    assert out.returncode == 1 and message in out.stderr, (what, out.stderr)
    assert not [f for f in fake_hub.fetched() if f.endswith((".safetensors", ".bin"))], what
    assert fake_hub.fetched() in ([], ["config.json"]), what


@pytest.mark.torch_free
def test_pull_of_an_unknown_repository_says_so(fake_hub, tmp_path):
    out = pull_cli("org/nothing", env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_ENDPOINT": fake_hub.url})
    assert out.returncode == 1 and "org/nothing is not on the hub" in out.stderr and "pull --list" in out.stderr


async def test_the_daemon_pulls_on_first_use_with_progress_percentages(fake_hub, tmp_path, monkeypatch):
    from completiond import config
    from completiond.serving.lifecycle import load_completer
    from completiond.serving.service import Service

    fake_hub.add("org/mini", BUNDLED)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cfg = config.merge(config.Config(), {"model": "org/mini", "device": "cpu"})[0]
    service = Service(cfg, loader=load_completer)
    seen: list[dict] = []
    service.listeners.append(lambda status: seen.append(status["progress"]) if status["progress"] else None)
    try:
        service.start_loading()
        for _ in range(3000):
            if service.state not in ("idle", "loading"):
                break
            await asyncio.sleep(0.02)
        assert service.state == "ready", service.error
        assert service.status()["model"] == f"org/mini@{COMMIT[:12]}"
    finally:
        service.shutdown()
    downloads = [p for p in seen if p["phase"] == "download"]
    assert downloads and downloads[-1]["percentage"] == 80
    assert downloads[-1]["message"].startswith("downloading org/mini: 13 of 13 MB")
    percentages = [p["percentage"] for p in seen]
    assert percentages == sorted(percentages), percentages  # $/progress only rises
    after = [p for p in seen[seen.index(downloads[-1]) + 1:]]
    assert {"tokenizer", "weights", "warm-up"} <= {p["phase"] for p in after}
    assert all(p["percentage"] >= 80 for p in after)  # the load phases share what the download left


def test_complete_by_hub_id_in_offline_mode_names_the_model(cache, tmp_path):
    root, _snapshot = cache
    source = tmp_path / "m.py"
    source.write_text("def add(a, b):\n    return \n")
    env = {**os.environ, "HF_HUB_CACHE": str(root), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": os.environ["HF_ENDPOINT"],
           "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    out = subprocess.run([sys.executable, "-m", "completiond.cli", "complete", f"{source}:2:12", "--model", REPO,
                          "--device", "cpu", "--max-tokens", "8", "--json"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["model"] == f"{REPO}@{COMMIT[:12]}" and result["device"] == "cpu"
    assert "Retrying" not in out.stderr


@pytest.mark.torch_free
def test_status_shows_load_warnings_and_the_background_calibration():
    from completiond.commands.status import describe

    st = {"pid": 1, "state": "ready", "error": "", "model": f"org/m@{COMMIT[:12]}", "device": "cpu", "uptime_s": 3,
          "warnings": ["org/m will probably not fit"],
          "calibration": {"state": "running", "message": "calibrating org/m in the background"}}
    lines = describe({"status": st, "requests": 0, "completed": 0, "superseded": 0, "cancelled": 0, "errors": 0,
                      "clients": 1, "editors": 0}, Path("/run/x"))
    assert f"  model    org/m@{COMMIT[:12]} on cpu" in lines
    assert "  warning  org/m will probably not fit" in lines
    assert "  calibration  calibrating org/m in the background" in lines


@pytest.mark.torch_free
def test_a_branch_with_slashes_is_pulled_and_found_again_offline(fake_hub, tmp_path, monkeypatch):
    fake_hub.add("org/mini", BUNDLED)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url)
    seen = []
    pulled = hub.pull("org/mini@refs/pr/1", progress=lambda done, total: seen.append((done, total)))
    assert pulled.name == f"org/mini@refs/pr/1 ({COMMIT[:12]})" and pulled.downloaded == pulled.total
    assert seen[-1] == (pulled.total, pulled.total) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.pull("org/mini@refs/pr/1").path == pulled.path


@pytest.mark.torch_free
def test_pull_notes_when_the_model_will_not_fit_this_machine_in_float32(cache, monkeypatch, capsys):
    import argparse

    from completiond.commands import pull
    from completiond.engine import memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 << 20)
    assert pull.run(argparse.Namespace(model=REPO, list=False, trust_remote_code=False, json=False)) == 0
    out = capsys.readouterr().out
    assert "already in the cache" in out and "this machine has 0.0 GiB available" in out and "bfloat16" in out
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 << 40)
    assert pull.run(argparse.Namespace(model=REPO, list=False, trust_remote_code=False, json=False)) == 0
    assert "note:" not in capsys.readouterr().out


@pytest.mark.torch_free
def test_draft_files_trained_here_are_not_taken_for_model_weights(tmp_path):
    # an exit adapter or Medusa heads beside the weights are this machine's, keyed to the model
    with pytest.raises(hub.HubError, match="only pickle weights"):
        hub.choose_files("org/m", ["config.json", "tokenizer.json", "pytorch_model.bin", "exit_adapter.safetensors"])
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "medusa_heads.safetensors").write_bytes(b"\0" * 8)
    assert hub.missing_files(tmp_path) == ["*.safetensors weights"]


@pytest.mark.torch_free
def test_a_gated_model_says_to_accept_its_licence_and_log_in(fake_hub, tmp_path):
    fake_hub.add("facebook/gated", BUNDLED)
    fake_hub.gated.add("facebook/gated")
    out = pull_cli("facebook/gated", env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_ENDPOINT": fake_hub.url})
    assert out.returncode == 1, out.stderr
    assert f"facebook/gated is gated: accept its licence at {fake_hub.url}/facebook/gated" in out.stderr
    assert "hf auth login" in out.stderr and "Traceback" not in out.stderr
