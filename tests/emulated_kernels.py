"""The native step's kernels for the tests: every build this CPU runs, and the AVX-512 and AVX-VNNI builds
it cannot run (avx2-vnni, avx512, avx512-vnni, avx512-bf16) compiled with those intrinsics emulated by
SIMDe (the simde-py package, a test dependency) over AVX2, so that their code (layouts, row blocking, tails,
masks, offset corrections, the one-row exactness of every pass) is run by every machine the suite runs
on, not only by the rare one that has the instructions. An emulated build runs the code, not the silicon:
its speed means nothing, and its vpdpbusd / vdpbf16ps are SIMDe's and isa_emulation.h's reading of the
instruction set reference.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from completiond.engine import native

SHIM = Path(__file__).with_name("isa_emulation.h")
DEFINES = {"avx2-vnni": ["-DEMULATE_AVXVNNI"], "avx512": [], "avx512-vnni": ["-DEMULATE_VNNI"],
           "avx512-bf16": ["-DEMULATE_VNNI", "-DEMULATE_BF16"]}
_built: dict[str, ctypes.CDLL | str | RuntimeError] = {}  # kernel -> library, or why there is none
_real: tuple | None = None  # under emulate_cpu: native's own _cpu_flags and library


def _build_all() -> None:
    """Compile every emulated build at once (one process each: a few seconds apiece on 2 cores)."""
    try:
        import simde_py
    except ImportError:
        for kernel in DEFINES:
            _built[kernel] = "simde-py is not installed (pip install -e '.[test]')"
        return
    cc = native.build._compiler()
    if cc is None or "avx2" not in native.supported_kernels():
        for kernel in DEFINES:
            _built[kernel] = "no C compiler, or no AVX2/FMA to emulate AVX-512 on"
        return
    out_dir = Path(tempfile.mkdtemp(prefix="completiond-emulated-"))
    jobs = {}
    for kernel, defines in DEFINES.items():
        out = out_dir / f"step-{kernel}.so"
        cmd = [cc, "-O2", "-mavx2", "-mfma", "-Wno-psabi", "-I", simde_py.get_include(), "-include", str(SHIM),
               *defines, "-fopenmp", "-fPIC", "-shared", "-o", str(out), str(native.build.SOURCE), "-lm"]
        jobs[kernel] = (out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for kernel, (out, proc) in jobs.items():
        try:
            _, err = proc.communicate(timeout=native.COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            _built[kernel] = f"compiling the emulated {kernel} build took over {native.COMPILE_TIMEOUT_S} s"
            continue
        if proc.returncode != 0:
            # a failure to compile is the code's fault, not the machine's: the tests fail with it
            _built[kernel] = RuntimeError(f"the emulated {kernel} build does not compile:\n{err[-3000:]}")
            continue
        lib = native.typed(ctypes.CDLL(str(out)))
        assert lib.cd_abi() == native.ABI and lib.cd_kernel().decode() == kernel
        _built[kernel] = lib
    shutil.rmtree(out_dir, ignore_errors=True)  # loaded libraries stay mapped


def emulated(kernel: str) -> ctypes.CDLL:
    """The emulated build of an AVX-512 kernel, or a skip saying why there is none here."""
    if kernel not in DEFINES:  # AMX: SIMDe has no tiles, so only a CPU with them runs its tests
        pytest.skip(f"this CPU cannot run the {kernel} build, and it cannot be emulated")
    if not _built:
        _build_all()
    got = _built[kernel]
    if isinstance(got, RuntimeError):
        raise got
    if isinstance(got, str):
        pytest.skip(got)
    return got


def kernels() -> list[str]:
    """Every kernel the tests run: this CPU's builds, then the AVX-512 ones it lacks, emulated where SIMDe
    and a compiler are at hand (a build that does not compile stays in: its tests fail with the error)."""
    here = native.supported_kernels()
    missing = [k for k in DEFINES if k not in here]
    if missing and not _built:
        _build_all()
    return here + [k for k in missing if not isinstance(_built[k], str)]


def library(kernel: str, monkeypatch: pytest.MonkeyPatch | None = None) -> ctypes.CDLL:
    """kernel's build: this CPU's own where it runs it, else the emulated one. With monkeypatch, the engine
    picks it too for the test (COMPLETIOND_KERNEL, as a user would, and the build registered as available)."""
    if kernel in native.supported_kernels():
        lib = native.library(kernel)
        if lib is None:
            pytest.skip(f"the {kernel} build is unavailable here: {native.reason(kernel)}")
    else:
        lib = emulated(kernel)
        if monkeypatch is not None:
            here = native.supported_kernels()
            for owner in (native, native.build):  # the package re-exports it; build.py's own callers read build's
                monkeypatch.setattr(owner, "supported_kernels", lambda: here + [kernel])
            monkeypatch.setitem(native.build._libs, kernel, lib)
    if monkeypatch is not None:
        monkeypatch.setenv("COMPLETIOND_KERNEL", kernel)
    return lib


def emulate_cpu(kernel: str) -> None:
    """The suite as on a CPU whose widest build is kernel (COMPLETIOND_TEST_CPU, read by conftest.py): its
    flags added to this CPU's, and every AVX-512 build up to kernel served emulated, in this process
    (subprocesses the tests start run this CPU's own builds). For finding, on a machine without AVX-512,
    what would fail on one with it; slower than a native run."""
    if kernel not in DEFINES:
        raise pytest.UsageError(f"COMPLETIOND_TEST_CPU={kernel!r}: choose one of {', '.join(DEFINES)}")
    real_flags, real_load = native.build._cpu_flags, native.build._load
    if set(native.KERNELS[kernel][0]) <= set(real_flags().split()):
        return  # this CPU runs it: nothing to emulate
    served = [k for k in DEFINES if set(native.KERNELS[k][0]) <= set(native.KERNELS[kernel][0])]
    _build_all()
    for k in served:
        if not isinstance(_built[k], ctypes.CDLL):
            raise pytest.UsageError(f"COMPLETIOND_TEST_CPU={kernel}: no emulated {k} build: {_built[k]}")
    flags = " ".join(dict.fromkeys(real_flags().split() + list(native.KERNELS[kernel][0])))

    def load(k: str) -> ctypes.CDLL | None:
        # native.library() keeps its choice and fallbacks; only what it loads for a served build changes.
        # An unavailable one (COMPLETIOND_NATIVE=0 and the rest) goes to the real _load for its reason.
        if k in served and native.build._unavailable(k) is None:
            return _built[k]
        return real_load(k)

    global _real
    _real = (real_flags, real_load)
    native.build._cpu_flags = lambda: flags
    native.build._load = load


def real_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """For a test of building, caching and choosing the library itself: under emulate_cpu, this CPU's own
    flags and builds again for the test (an emulated build is never compiled by native.build._build), and
    the builds go where the test's XDG_CACHE_HOME says, not into the run's shared directory (conftest.py)."""
    monkeypatch.delenv("COMPLETIOND_NATIVE_CACHE", raising=False)
    if _real is not None:
        monkeypatch.setattr(native.build, "_cpu_flags", _real[0])
        monkeypatch.setattr(native.build, "_load", _real[1])
