"""The build cache of the native step: step.c compiled once per machine and kernel, cached, checked, loaded.

The shared objects live under ~/.cache/completiond/native/ (a 0700 directory checked for its owner and mode
before use), keyed by the source, the compiler and the kernel, written atomically with their sha256 beside
them, and loaded only after the file's owner, mode and hash are checked.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from completiond.engine.native.abi import ABI, typed
from completiond.fileio import user_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("step.c")
COMPILE_TIMEOUT_S = 300  # one build per kernel, once per machine: ~15 s on an idle 2-core machine, minutes under load
KERNELS = {  # kernel -> (cpu flags it needs, compiler flags)
    "avx2": (("avx2", "fma"), ["-mavx2", "-mfma"]),
    # AVX2 plus AVX-VNNI (vpdpbusd on ymm; Intel since Alder Lake, where AVX-512 is off): int8 as w8a8 on
    # 8-bit activations
    "avx2-vnni": (("avx2", "fma", "avx_vnni"), ["-mavx2", "-mfma", "-mavxvnni"]),
    "avx512": (
        ("avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl"),
        ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl"],
    ),
    # AVX-512 plus vpdpbusd: int8 matrices as w8a8 (activation rows quantised per row), the rest as avx512
    "avx512-vnni": (
        ("avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni"),
        ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
    ),
    # avx512-vnni plus vdpbf16ps: bf16 matrices times bf16-rounded activations (every CPU with AVX512_BF16
    # so far has VNNI too: Cooper Lake, Sapphire Rapids, Zen 4)
    "avx512-bf16": (
        ("avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"),
        ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16"],
    ),
    # avx512-bf16 plus AMX tiles (Sapphire Rapids and later): bf16 and int8 panels multiplied 16 rows at a time,
    # the prefill's matrix products several times faster than one vector at a time; used only where Linux
    # grants the process the tile state (cd_amx_ready)
    "avx512-amx": (
        ("avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16")
        + ("amx_tile", "amx_bf16", "amx_int8"),
        ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16"]
        + ["-mamx-tile", "-mamx-bf16", "-mamx-int8"],
    ),
}
BF16_KERNEL = "avx512-bf16"
# The avx512-bf16 build runs bf16 models only where its vdpbf16ps products are at least this fast against the
# avx512 builds' float32 products of the same panels (step.c's cd_bf16_dot_speed, 16 rows). A 2-core VM of a Xeon
# without AMX measured 0.67 (2026-12-07); there the float32 products prefilled the 0.5B shape 1.6x faster
# (256 tokens: 591-631 against 996-1039 ms) and the bundled model 1.1-1.4x.
BF16_DOT_MIN_SPEED = 1.0

_libs: dict[str, ctypes.CDLL | None] = {}  # kernel -> loaded library (None: failed, _reasons says why)
_reasons: dict[str, str] = {}
_logged: set[str] = set()  # the fallbacks library() has warned about ("": to the PyTorch path)


def cache_dir() -> Path:
    # COMPLETIOND_NATIVE_CACHE puts the builds elsewhere (the test suite shares one directory between its
    # workers, each with its own XDG_CACHE_HOME); it must pass the same private-directory check.
    override = os.environ.get("COMPLETIOND_NATIVE_CACHE")
    return Path(override) if override else user_cache_dir() / "completiond" / "native"


def _cpu_flags() -> str:
    """The flags the kernel choice goes by (tests stand other CPUs' in here; the probe reads the CPU's own)."""
    return _read_cpu_flags()


def _read_cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def supported_kernels() -> list[str]:
    """The kernels this CPU can run, baseline first (AMX only where Linux grants this process the tile state,
    so that kernel_name() never names a build that cannot load)."""
    flags = set(_cpu_flags().split())
    found = [k for k, (need, _) in KERNELS.items() if set(need) <= flags]
    return [k for k in found if "amx" not in k or _os_grants_amx()]


@functools.cache  # the grant is per process: asked once
def _os_grants_amx() -> bool:
    """Whether Linux lets this process use the AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA), as
    the built library's cd_amx_ready asks too; False where the question cannot be asked."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        return bool(ctypes.CDLL(None).syscall(158, 0x1023, 18) == 0)  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA
    except (OSError, AttributeError, TypeError):
        return False


def kernel_name() -> str:
    """The one decision of which kernel runs: the widest this CPU supports, or COMPLETIOND_KERNEL when it
    names one the CPU can run; "none" when the CPU has no AVX2/FMA. The one exception: a CPU whose vdpbf16ps
    is slow (bf16_dot_pays) gets avx512-vnni, whose float32 products of bf16 panels are faster there."""
    usable = supported_kernels()
    if not usable:
        return "none"
    forced = os.environ.get("COMPLETIOND_KERNEL", "").strip().lower()
    if forced in usable:
        return forced
    if usable[-1] == BF16_KERNEL and "avx512-vnni" in usable and not bf16_dot_pays():
        return "avx512-vnni"
    return usable[-1]


def bf16_dot_pays() -> bool:
    """Whether the avx512-bf16 build's bf16 products run at least BF16_DOT_MIN_SPEED of the float32 ones' rate
    on this CPU (measured once: bf16_dot_speed). Yes where it cannot be measured."""
    speed = bf16_dot_speed()
    return speed is None or speed >= BF16_DOT_MIN_SPEED


@functools.cache
def bf16_dot_speed() -> float | None:
    """The avx512-bf16 build's bf16 products' speed over the float32 ones' of the same panels, from its probe
    (a few ms); None where this very CPU lacks AVX512_BF16 (whatever _cpu_flags is told) or that build cannot
    load."""
    if not set(KERNELS[BF16_KERNEL][0]) <= set(_read_cpu_flags().split()) or _unavailable(BF16_KERNEL):
        return None
    lib = _load(BF16_KERNEL)
    if lib is None or not hasattr(lib, "cd_bf16_dot_speed"):
        return None
    lib.cd_bf16_dot_speed.restype = ctypes.c_double
    speed = float(lib.cd_bf16_dot_speed())
    return speed if speed > 0 else None


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    return shutil.which("gcc") or shutil.which("cc")


def _private_dir_ok(path: Path) -> str | None:
    """Why path is not a directory only this user can write into (None: it is)."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to uid {st.st_uid}, not to this user"
    if st.st_mode & 0o077:
        return f"{path} has mode {stat.S_IMODE(st.st_mode):o}, not 700"
    return None


def _tightenable(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _file_ok(path: Path) -> str | None:
    """Why the cached library at path must not be loaded (None: its owner, mode and sha256 check out)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "absent"
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to uid {st.st_uid}, not to this user"
    if st.st_mode & 0o022:
        return f"{path} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):o})"
    digest_path = path.with_name(path.name + ".sha256")
    try:
        want = digest_path.read_text(encoding="ascii").strip()
        got = hashlib.sha256(path.read_bytes()).hexdigest()
    except (OSError, UnicodeDecodeError) as exc:
        return f"no readable content hash beside {path} ({exc})"
    if got != want:
        return f"{path}'s content does not match the sha256 stored when it was built"
    return None


def _cache_for(kernel: str) -> Path:
    """The private cache directory: created 0700; one that fails the owner/mode check is not used, a
    fresh private directory stands in for it (this process only)."""
    d = cache_dir()
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        d.mkdir(mode=0o700, exist_ok=True)
    except OSError:
        pass
    why = _private_dir_ok(d)
    if why is not None and _tightenable(d):
        # ours, and never writable by anyone else (an older version made it 755): nothing can have been
        # planted in it, so taking the read bits away is enough
        try:
            os.chmod(d, 0o700)
        except OSError:
            pass
        why = _private_dir_ok(d)
    if why is None:
        return d
    fresh = Path(tempfile.mkdtemp(prefix=f"completiond-native-{kernel}-"))  # 0700, ours
    _temporary.add(fresh)  # removed by _load once the library is loaded (or failed to build)
    log.warning("native step cache not used (%s); building into %s instead", why, fresh)
    return fresh


# Fresh build directories of this process (_cache_for), removed once their library is loaded: the loader
# has mapped it by then, so nothing needs the file, and one was left in /tmp on every start before.
_temporary: set[Path] = set()


def _remove_temporary() -> None:
    while _temporary:
        shutil.rmtree(_temporary.pop(), ignore_errors=True)


def _target(cc: str, kernel: str) -> Path:
    """Where the build of this source, compiler and kernel is cached."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"C compiler {cc!r} does not run: {exc}") from None
    source = SOURCE.read_bytes()
    flags = KERNELS[kernel][1]
    key = hashlib.sha256(
        b"\0".join([source, cc.encode(), version.encode(), " ".join(flags).encode(), platform.machine().encode()])
    ).hexdigest()[:16]
    return _cache_for(kernel) / f"step-{kernel}-{key}.so"


def build_pending() -> bool:
    """Whether library() would compile first (the one-time build, seconds long): no checked build of the
    kernel it tries first is cached yet. False where the native step is unavailable or already loaded."""
    kernel = _order()[0]
    if kernel in _libs or _unavailable(kernel) is not None:
        return False
    try:
        return _file_ok(_target(_compiler() or "cc", kernel)) is not None
    except RuntimeError:
        return False
    finally:
        _remove_temporary()  # a fresh directory _target made holds nothing yet


def _build(cc: str, kernel: str) -> Path:
    """The checked cached shared object for this source, compiler and kernel, compiled if absent or if
    the cached one fails its checks."""
    out = _target(cc, kernel)
    why = _file_ok(out)
    if why is None:
        return out
    with _build_lock(out):
        # Another process (a second daemon, a parallel test worker) may have built it while we waited.
        why = _file_ok(out)
        if why is None:
            return out
        return _compile(cc, kernel, out, why)


def _build_lock(out: Path):
    """Held while one process compiles `out`, so processes starting together build it once. Where there
    is no fcntl (Windows), each builds its own and the atomic replace keeps the cache whole."""
    import contextlib

    try:
        import fcntl
    except ImportError:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def held():
        fd = os.open(out.with_name(out.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    return held()


def _compile(cc: str, kernel: str, out: Path, why: str) -> Path:
    directory = out.parent
    flags = KERNELS[kernel][1]
    if why != "absent":
        log.warning("native step: not loading the cached library (%s); building it again", why)
    fd, tmp = tempfile.mkstemp(prefix=".step-", suffix=".so", dir=directory)
    os.close(fd)
    cmd = [cc, "-O3", *flags, "-fopenmp", "-fPIC", "-shared", "-o", tmp, str(SOURCE), "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"{' '.join(cmd[:2])} ... failed (exit {done.returncode}): {first}")
        os.chmod(tmp, 0o755)
        digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
        fd, tmp_hash = tempfile.mkstemp(prefix=".step-", suffix=".sha256", dir=directory)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(digest + "\n")
        os.replace(tmp_hash, out.with_name(out.name + ".sha256"))
        os.replace(tmp, out)  # atomic: another process sees the whole file or none
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"compiling {SOURCE.name} took over {COMPILE_TIMEOUT_S} s") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fresh = _file_ok(out)  # what is loaded is what was checked (a concurrent build may have replaced it)
    if fresh is not None:
        raise RuntimeError(f"the freshly built library fails its check: {fresh}")
    return out


def library(kernel: str | None = None) -> ctypes.CDLL | None:
    """The loaded native library for kernel, built on first use; None (and reason() says why) when
    unavailable. Without a kernel: kernel_name()'s build, or where that one cannot be built or loaded (a
    compiler or assembler older than the CPU: no -mavx512bf16, no vpdpbusd) the next narrower build this
    CPU runs, down to avx2, with a warning naming what failed."""
    if kernel is not None:
        return _load(kernel)
    order = _order()
    for k in order:
        lib = _load(k)
        if lib is not None:
            if k != order[0] and k not in _logged:
                _logged.add(k)
                log.warning("native step: using the %s kernels, not %s (%s)", k, order[0], reason())
            return lib
    if "" not in _logged and _unavailable(order[0]) is None:  # it should have worked: say so, once
        _logged.add("")
        log.warning("%s; using the PyTorch path", reason())
    return None


def _order() -> list[str]:
    """The builds library() tries: kernel_name()'s, then the narrower ones this CPU runs, widest first."""
    chosen, usable = kernel_name(), supported_kernels()
    return [chosen] + (usable[: usable.index(chosen)][::-1] if chosen in usable else [])


def _load(kernel: str) -> ctypes.CDLL | None:
    """library(kernel): this one build or None."""
    if kernel in _libs:
        return _libs[kernel]
    _libs[kernel] = None
    why = _unavailable(kernel)
    if why is not None:
        _reasons[kernel] = why
        return None
    cc = _compiler()
    assert cc is not None  # _unavailable checked it
    try:
        path = _build(cc, kernel)
        lib = ctypes.CDLL(str(path))
        if lib.cd_abi() != ABI:
            raise RuntimeError(f"{path} has ABI {lib.cd_abi()}, expected {ABI}")
        if "amx" in kernel and not lib.cd_amx_ready():
            raise RuntimeError("the operating system does not grant this process the AMX tile state")
    except (OSError, RuntimeError) as exc:
        _reasons[kernel] = f"cannot build or load the native step: {exc}"
        return None
    finally:
        _remove_temporary()
    _libs[kernel] = typed(lib)
    return lib


def _unavailable(kernel: str) -> str | None:
    if os.environ.get("COMPLETIOND_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return "turned off by COMPLETIOND_NATIVE=0"
    if platform.system() == "Windows" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the native step is written for x86-64 with AVX2/FMA, not {platform.machine()}"
    if kernel not in supported_kernels():
        return "this CPU lacks AVX2 or FMA" if kernel in ("avx2", "none") else f"this CPU cannot run {kernel} kernels"
    if _compiler() is None:
        return "no C compiler (gcc or cc, or $CC) on PATH"
    return None


def reason(kernel: str | None = None) -> str | None:
    """Why kernel's build is unavailable; without a kernel, why kernel_name()'s is (and, where every
    narrower one failed too, why each did)."""
    if kernel is not None:
        return _reasons.get(kernel)
    order = _order()
    failed = [k for k in order if k in _reasons]
    if len(order) > 1 and len(failed) == len(order):
        return "; ".join(f"{k}: {_reasons[k]}" for k in order)
    return _reasons.get(order[0])


def _reset_for_tests() -> None:
    _libs.clear()
    _reasons.clear()
    _logged.clear()
