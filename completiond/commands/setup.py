"""`completiond setup`: the one-time preparation, done now instead of during the first completion.

Today that is the native CPU step (engine/native/step.c), which the engine otherwise compiles on first use:
seconds of "preparing the engine" in the editor. `completiond pull` runs it too.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quiet", action="store_true", help="print only problems")


def prepare(quiet: bool = False, stream=sys.stderr) -> int:
    """Build the native step if it is not built yet; 0 when it is ready or not applicable here."""
    from completiond.engine import native

    if not native.build_pending():
        why = native.reason() if native.library() is None else None
        if not quiet:
            print(
                f"completiond setup: native CPU step {'not available: ' + why if why else 'ready'} "
                f"({native.kernel_name()} kernels)",
                file=stream,
            )
        return 0
    print(
        f"completiond setup: compiling the native CPU step ({native.kernel_name()} kernels; once per machine "
        "and version, about 10-30 s)...",
        file=stream,
        flush=True,
    )
    t0 = time.perf_counter()
    lib = native.library()
    if lib is None:
        print(f"completiond setup: {native.reason()}; completions use the PyTorch path (slower)", file=stream)
        return 1
    if not quiet:
        print(f"completiond setup: native CPU step ready ({time.perf_counter() - t0:.1f} s)", file=stream)
    return 0


def run(args: argparse.Namespace) -> int:
    return prepare(args.quiet)
