"""Security (issue 7, item 7).

* the real daemon's directory and socket are private even under umask 000, owned by us;
* a second Unix user cannot connect: the 0700 directory stops it, and if an admin loosens
  the permissions, the daemon's peer-credential check still refuses it (created with
  useradd and run with setuid when the tests run as root; otherwise the refusal path is
  driven with a forged peer uid);
* pickle weights are refused, and never unpickled even next to safetensors weights;
* no eval/exec/pickle/marshal/torch.load/jinja2/apply_chat_template/os.system/shell=True in
  completiond/, lsp/, models/ (an AST scan, with a self-test that it catches each pattern);
* chat templates and model marker files are data: a model whose tokenizer_config.json holds
  a Jinja payload is loaded and completes without the payload ever being rendered.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import pickle
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from completiond.serving import paths
from completiond.commands import stress
from completiond.serving import wire
from test_fuzz_wire import InProcDaemon

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ["completiond", "lsp", "models"]


# --- permissions of a real daemon ------------------------------------------------------------------


@pytest.mark.slow
def test_real_daemon_dir_and_socket_private_under_umask_000(tiny_model_dir, tmp_path):
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o755)
    rundir = runtime / "completiond"
    proc = subprocess.Popen([sys.executable, "-m", "completiond.cli", "serve", "--model", str(tiny_model_dir),
                             "--device", "cpu", "--idle-timeout", "60", "--runtime-dir", str(rundir)],
                            env=stress.child_env(runtime), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: os.umask(0))
    try:
        sock = paths.socket_path(rundir)
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        d, s = os.lstat(rundir), os.lstat(sock)
        assert stat.S_ISDIR(d.st_mode) and stat.S_IMODE(d.st_mode) == 0o700 and d.st_uid == os.getuid()
        assert stat.S_ISSOCK(s.st_mode) and stat.S_IMODE(s.st_mode) == 0o600 and s.st_uid == os.getuid()
        lock = os.lstat(rundir / paths.LOCK_NAME)
        assert stat.S_IMODE(lock.st_mode) & 0o077 == 0
    finally:
        proc.kill()
        proc.wait()


def test_daemon_refuses_loose_or_symlinked_directory(tmp_path):
    """A group/world-writable or symlinked runtime dir stops the daemon (never 'fixed' by deleting it)."""
    for setup, why in ((lambda d: (d.mkdir(), os.chmod(d, 0o777)), "writable by group or others"),
                       (lambda d: ((tmp_path / "real").mkdir(mode=0o700), d.symlink_to(tmp_path / "real")), "symlink")):
        d = tmp_path / f"rt-{why[:4]}"
        setup(d)
        with pytest.raises(paths.InsecureDirectoryError) as err:
            _start_in(d)
        assert why in str(err.value)
        if d.is_symlink():
            assert d.resolve() == (tmp_path / "real").resolve()       # left alone
        else:
            assert stat.S_IMODE(os.stat(d).st_mode) == 0o777           # refused, not silently "fixed"
        assert not paths.socket_path(d).exists()


def _start_in(rundir: Path) -> None:
    from completiond.serving.server import DaemonServer
    from completiond.serving.service import Service
    from completiond import config

    async def go():
        server = DaemonServer(Service(config.Config(), loader=lambda _c, **_hooks: None), rundir)
        try:
            await server.start()
        finally:
            server.service.shutdown()

    asyncio.run(go())


# --- a second Unix user -----------------------------------------------------------------------------

OTHER_USER = "cdtest-other"
HELLO = wire.encode({"t": "hello", "v": wire.VERSION, "client": "intruder", "pid": 1})
PROBE = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(5)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("EACCES"); sys.exit(0)
try:
    s.sendall(bytes.fromhex(sys.argv[2]))
    data = s.recv(65536)
except (BrokenPipeError, ConnectionResetError) as exc:
    print("CLOSED", type(exc).__name__); sys.exit(0)
except socket.timeout:
    print("TIMEOUT"); sys.exit(0)
print("WELCOME" if b"welcome" in data else ("CLOSED" if not data else "OTHER " + data[:40].hex()))
"""


@pytest.fixture(scope="module")
def other_user():
    if os.getuid() != 0:
        yield None
        return
    created = False
    try:
        pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
                       check=True, capture_output=True)
        created = True
    yield pwd.getpwnam(OTHER_USER)
    if created:
        subprocess.run(["userdel", OTHER_USER], capture_output=True)


def run_as(user, socket_path: Path) -> str:
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    out = subprocess.run([python, "-c", PROBE, str(socket_path), HELLO.hex()], user=user.pw_uid,
                         group=user.pw_gid, extra_groups=[], capture_output=True, text=True, timeout=30, cwd="/")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_second_user_cannot_connect(other_user, caplog):
    parent = Path(tempfile.mkdtemp(prefix="cd-sec-", dir="/tmp"))
    os.chmod(parent, 0o711)                      # others may traverse to the runtime dir, not list it
    daemon = InProcDaemon(parent)
    try:
        assert stat.S_IMODE(os.stat(daemon.rundir).st_mode) == 0o700
        if other_user is not None:
            # 1. The private directory keeps the other user away from the socket altogether.
            assert run_as(other_user, daemon.socket_path) == "EACCES"
            # 2. An admin loosens it: the socket is reachable, the daemon still refuses the peer's uid.
            os.chmod(daemon.rundir, 0o755)
            os.chmod(daemon.socket_path, 0o666)
            assert run_as(other_user, daemon.socket_path).startswith("CLOSED")
            assert f"refused connection from uid {other_user.pw_uid}" in caplog.text
        else:
            # Not root: forge the peer uid the kernel reports, to drive the same refusal.
            import completiond.serving.service as daemon_mod

            real = daemon_mod.paths.peer_uid
            daemon_mod.paths.peer_uid = lambda _s: os.getuid() + 4242
            try:
                probe = stress.WireProbe(daemon.socket_path, hello=False)
                probe.send(HELLO)
                assert probe.closed_by_peer(5)
            finally:
                daemon_mod.paths.peer_uid = real
            assert "refused connection from uid" in caplog.text
        # We (the owner) still get in.
        assert stress.WireProbe(daemon.socket_path).request("ping", {})["r"] == "pong"
    finally:
        daemon.stop()
        shutil.rmtree(parent, ignore_errors=True)


# --- pickle weights ----------------------------------------------------------------------------------


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))   # unpickling creates the marker file


def test_pickle_weights_refused_and_never_unpickled(tiny_model_dir, tmp_path):
    from completiond.engine.engine import Engine, EngineError

    marker = tmp_path / "UNPICKLED"
    payload = pickle.dumps({"model.embed_tokens.weight": _Payload(marker)})
    # (a) only pickle weights: refused, with the reason.
    only = tmp_path / "pickle-only"
    only.mkdir()
    shutil.copy(tiny_model_dir / "config.json", only)
    for name in ("pytorch_model.bin", "model.pt", "weights.ckpt"):
        (only / name).write_bytes(payload)
    with pytest.raises(EngineError, match="pickle weights"):
        Engine.load(only, device="cpu")
    # (b) safetensors next to a pickle: the safetensors load, the pickle is never touched.
    both = tmp_path / "both"
    shutil.copytree(tiny_model_dir, both)
    (both / "pytorch_model.bin").write_bytes(payload)
    engine = Engine.load(both, device="cpu")
    assert engine.generate(engine.tokenizer("def f(").input_ids).tokens is not None
    assert not marker.exists(), "a pickle was unpickled"
    # (c) through the daemon: the state is an error naming the reason; nothing unpickled.
    from completiond import config as config_mod
    from completiond.serving.lifecycle import load_completer

    daemon = InProcDaemon(tmp_path / "rt", loader=lambda _c, **_hooks: load_completer(
        config_mod.merge(config_mod.Config(), {"model": str(only), "device": "cpu"})[0]))
    try:
        probe = stress.WireProbe(daemon.socket_path)
        for _ in range(200):
            status = probe.request("status", {})["r"]
            if status["state"] == "error":
                break
            time.sleep(0.02)
        assert status["state"] == "error" and "pickle" in status["error"], status
        probe.close()
    finally:
        daemon.stop()
    assert not marker.exists()


# --- dangerous calls -----------------------------------------------------------------------------------

DANGEROUS_NAMES = {"eval", "exec", "compile", "__import__", "execfile"}
DANGEROUS_ATTRS = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("torch", "load"),
                   ("marshal", "load"), ("marshal", "loads"), ("yaml", "load"), ("yaml", "unsafe_load"),
                   ("os", "system"), ("os", "popen"), ("dill", "load"), ("dill", "loads"), ("joblib", "load"),
                   ("shelve", "open"), ("cloudpickle", "loads"), ("jinja2", "Template")}
DANGEROUS_METHODS = {"apply_chat_template", "from_string", "render"}
DANGEROUS_MODULES = {"pickle", "marshal", "dill", "shelve", "jinja2", "cloudpickle", "_pickle"}

# (file, what): why it is fine. Every entry must still match something, so stale ones fail the test.
ALLOWED: dict[tuple[str, str], str] = {
    # The training command resumes from its own checkpoint, written by itself into the user's run
    # directory (never a downloaded file); it holds numpy RNG state, which weights_only refuses.
    ("models/training/train_default.py", "torch.load()"): "own training checkpoint",
    ("models/training/train_default.py", "weights_only=False"): "own training checkpoint",
    # train-context's own checkpoint, in the user's run directory; plain containers only, read with
    # weights_only=True (no code is unpickled)
    ("completiond/commands/train_context.py", "torch.load()"): "own checkpoint, weights_only=True",
}


def scan_source(source: str, filename: str = "<src>") -> list[str]:
    """Dangerous constructs in Python source: calls that execute or unpickle data, template rendering,
    shells, trust_remote_code=True, torch.load without weights_only."""
    found = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in DANGEROUS_MODULES:
                    found.append(f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in DANGEROUS_MODULES:
            found.append(f"from {node.module} import")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in DANGEROUS_NAMES:
                literal = node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                if not (f.id == "__import__" and literal):   # __import__("torch") imports a fixed module: fine
                    found.append(f"{f.id}()")
            elif isinstance(f, ast.Attribute):
                base = f.value.id if isinstance(f.value, ast.Name) else None
                if (base, f.attr) in DANGEROUS_ATTRS:
                    found.append(f"{base}.{f.attr}()")
                elif f.attr in DANGEROUS_METHODS:
                    found.append(f".{f.attr}()")
                elif f.attr in ("load",) and base in ("np", "numpy") and any(
                        k.arg == "allow_pickle" for k in node.keywords):
                    found.append("numpy.load(allow_pickle=...)")
            for kw in node.keywords:
                if kw.arg in ("shell", "trust_remote_code", "allow_pickle") and isinstance(kw.value, ast.Constant) \
                        and kw.value.value is True:
                    found.append(f"{kw.arg}=True")
                if kw.arg == "weights_only" and isinstance(kw.value, ast.Constant) and kw.value.value is False:
                    found.append("weights_only=False")
    return found


def test_scanner_catches_each_pattern():
    snippets = {
        "eval(x)": "eval()", "exec(code)": "exec()", "__import__(name)": "__import__()", "compile(s, 'f', 'exec')": "compile()",
        "import pickle": "import pickle", "from pickle import loads": "from pickle import",
        "pickle.loads(b)": "pickle.loads()", "torch.load(p)": "torch.load()", "marshal.loads(b)": "marshal.loads()",
        "yaml.load(s)": "yaml.load()", "os.system('ls')": "os.system()", "import jinja2": "import jinja2",
        "jinja2.Template(t)": "jinja2.Template()", "tok.apply_chat_template(m)": ".apply_chat_template()",
        "env.from_string(t).render()": ".from_string()", "subprocess.run(c, shell=True)": "shell=True",
        "f(trust_remote_code=True)": "trust_remote_code=True", "np.load(p, allow_pickle=True)": "allow_pickle=True",
        "torch.serialization.load(p, weights_only=False)": "weights_only=False",
    }
    for src, want in snippets.items():
        assert want in scan_source(src), (src, scan_source(src))
    # Look-alikes that are fine: a model's .eval(), re.compile, json.loads, safetensors.
    assert scan_source("model.eval()\nre.compile('x')\njson.loads(s)\nsafe_open(p)\n__import__('torch')\n"
                       "f(trust_remote_code=cfg.trust_remote_code)") == []


def test_no_dangerous_calls_in_the_code():
    findings = {}
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            for what in scan_source(path.read_text(encoding="utf-8"), rel):
                findings[(rel, what)] = True
    unexplained = sorted(k for k in findings if k not in ALLOWED)
    assert not unexplained, f"dangerous constructs (add to ALLOWED with a reason if legitimate): {unexplained}"
    stale = sorted(k for k in ALLOWED if k not in findings)
    assert not stale, f"ALLOWED entries that match nothing any more: {stale}"
    assert sum(1 for top in SCANNED for _ in (ROOT / top).rglob("*.py")) > 20   # the scan saw the code


# --- templates from model files are data ---------------------------------------------------------------

TEMPLATE_PROBE = r"""
import json, sys, pathlib
model, marker = sys.argv[1], pathlib.Path(sys.argv[2])
rendered = []
try:
    import jinja2, jinja2.environment
    real = jinja2.environment.Environment.from_string
    def spy(self, source, *a, **k):
        rendered.append(source[:60])
        return real(self, source, *a, **k)
    jinja2.environment.Environment.from_string = spy
except ImportError:
    pass
from completiond import config
from completiond.completion.completer import suggest
from completiond.completion.suggest import LocalCompleter
from completiond.engine.engine import Engine, CancelToken
engine = Engine.load(model, device="cpu")
cfg, _ = config.merge(config.Config(), {"model": model, "maxTokens": 4})
text = "def add(a, b):\n    return "
gen = suggest(LocalCompleter(engine), text, len(text), cfg, cancel=CancelToken(), path="/w/a.py", language="python").generation
print(json.dumps({"rendered": rendered, "marker": marker.exists(), "generated": gen is not None and len(gen.tokens)}))
"""


def test_chat_template_and_marker_files_are_never_executed(tiny_model_dir, tmp_path):
    model = tmp_path / "hostile-model"
    shutil.copytree(tiny_model_dir, model)
    marker = tmp_path / "TEMPLATE_RAN"
    payload = "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
    cfg_path = model / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["chat_template"] = payload
    cfg_path.write_text(json.dumps(tok_cfg))
    (model / "chat_template.jinja").write_text(payload)
    # The FIM marker file is read for its presence only; hostile content in it is inert.
    (model / "completiond.json").write_text(json.dumps({"fim_template": payload, "family": "__import__('os')"}))
    out = subprocess.run([sys.executable, "-c", TEMPLATE_PROBE, str(model), str(marker)], capture_output=True,
                         text=True, timeout=300, env=stress.child_env(tmp_path), cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["generated"], result                  # the model was really used for a completion
    assert result["rendered"] == [], f"a template from the model files was compiled: {result['rendered']}"
    assert not result["marker"] and not marker.exists()
