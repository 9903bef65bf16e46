"""The native library cache is treated like the runtime directory (issue 31 item 2): the directory is
private (0700, ours), the cached .so is ours, not group- or world-writable, and matches the sha256 stored
beside it when it was built; a library that fails any check is never loaded (it is built again, in a
fresh private directory when the cache directory itself is unsafe).

Each case plants a shared object whose constructor writes a marker file, then loads the library in a
fresh process (this one would be handed its already loaded copy by the dynamic loader): the marker must
not appear. A small stand-in source (the same entry points, no kernels) keeps the builds fast.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from completiond.engine import native

ENTRY_POINTS = """
int cd_abi(void) { return %d; }
const char *cd_kernel(void) { return "avx2"; }
int cd_bf16_pairs(void) { return 0; }
int cd_i8_quads(void) { return 0; }
int cd_act_levels(void) { return 0; }
int cd_bf16_dot(void) { return 0; }
int cd_gemm(void) { return 0; }
int cd_arith(void) { return 0; }
int cd_layers(void) { return 0; }
int cd_head(void) { return 0; }
int cd_draft_greedy(void) { return 0; }
int cd_verify_greedy(void) { return 0; }
int cd_amx_ready(void) { return 0; }
""" % native.ABI

PLANTED = """
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("PLANTED_MARK"), "w");
    if (f) { fputs("ran", f); fclose(f); }
}
""" + ENTRY_POINTS

PROBE = """
import sys
from pathlib import Path
from completiond.engine import native
native.build.SOURCE = Path(sys.argv[1])
lib = native.library("avx2")
print("loaded" if lib is not None else "refused", native.reason("avx2"))
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    cc = native.build._compiler()
    if cc is None or "avx2" not in native.supported_kernels():
        pytest.skip("no C compiler or no AVX2 here")
    source = tmp_path / "stand_in.c"
    source.write_text(ENTRY_POINTS)
    planted_src = tmp_path / "planted.c"
    planted_src.write_text(PLANTED)
    planted = tmp_path / "planted.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(planted), str(planted_src)], check=True, timeout=120)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "PLANTED_MARK": str(tmp_path / "marker"),
           "TMPDIR": str(tmp_path / "tmp"), "COMPLETIOND_NATIVE": "1"}
    env.pop("COMPLETIOND_NATIVE_CACHE", None)  # this cache under tmp_path, not the run's shared one (conftest.py)
    (tmp_path / "tmp").mkdir()

    def probe() -> str:
        out = subprocess.run([sys.executable, "-c", PROBE, str(source)], capture_output=True, text=True, timeout=300,
                             env=env)
        assert out.returncode == 0, out.stderr
        return out.stdout + out.stderr

    first = probe()
    assert first.startswith("loaded"), first
    directory = tmp_path / "xdg" / "completiond" / "native"
    (built,) = directory.glob("step-avx2-*.so")
    return dict(dir=directory, so=built, planted=planted, marker=tmp_path / "marker", probe=probe,
                tmp=tmp_path / "tmp")


def _plant(target: Path, planted: Path, with_hash: bool) -> None:
    data = planted.read_bytes()
    fresh = target.with_name(".planting")
    fresh.write_bytes(data)
    os.chmod(fresh, 0o755)
    os.replace(fresh, target)  # a new file (inode) under the expected name
    if with_hash:  # an attacker who can write the directory can write the hash beside it too
        target.with_name(target.name + ".sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")


def test_the_cache_directory_is_private_and_the_hash_is_stored(cache):
    assert stat.S_IMODE(os.stat(cache["dir"]).st_mode) == 0o700
    digest = cache["so"].with_name(cache["so"].name + ".sha256").read_text().strip()
    assert digest == hashlib.sha256(cache["so"].read_bytes()).hexdigest()
    assert not stat.S_IMODE(os.stat(cache["so"]).st_mode) & 0o022


def test_a_library_that_does_not_match_its_hash_is_not_loaded(cache):
    _plant(cache["so"], cache["planted"], with_hash=False)
    out = cache["probe"]()
    assert not cache["marker"].exists(), out
    assert out.startswith("loaded")  # built again in its place
    digest = cache["so"].with_name(cache["so"].name + ".sha256").read_text().strip()
    assert hashlib.sha256(cache["so"].read_bytes()).hexdigest() == digest != hashlib.sha256(
        cache["planted"].read_bytes()).hexdigest()


def test_a_world_writable_cache_directory_is_not_used(cache):
    os.chmod(cache["dir"], 0o777)
    _plant(cache["so"], cache["planted"], with_hash=True)
    out = cache["probe"]()
    assert not cache["marker"].exists(), out
    assert out.startswith("loaded") and "building into" in out  # a fresh private directory instead
    # ... removed once the library was loaded (issue 43: one was left in /tmp on every start)
    fresh = [p for p in cache["tmp"].iterdir() if p.name.startswith("completiond-native-")]
    assert fresh == []


def test_a_group_or_world_writable_library_is_not_loaded(cache):
    _plant(cache["so"], cache["planted"], with_hash=True)
    os.chmod(cache["so"], 0o777)
    out = cache["probe"]()
    assert not cache["marker"].exists(), out
    assert out.startswith("loaded") and "writable" in out


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="changing a file's owner needs root")
def test_a_library_owned_by_another_user_is_not_loaded(cache):
    _plant(cache["so"], cache["planted"], with_hash=True)
    os.chown(cache["so"], 65534, 65534)
    out = cache["probe"]()
    assert not cache["marker"].exists(), out
    assert out.startswith("loaded") and "uid 65534" in out


def test_a_directory_of_another_user_is_not_used(cache):
    if os.geteuid() != 0:
        pytest.skip("changing a directory's owner needs root")
    _plant(cache["so"], cache["planted"], with_hash=True)
    os.chown(cache["dir"], 65534, 65534)
    out = cache["probe"]()
    assert not cache["marker"].exists(), out
    assert out.startswith("loaded") and "building into" in out
