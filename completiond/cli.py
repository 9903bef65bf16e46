"""`completiond` command line: a thin dispatcher.

Each subcommand lives in the module named here, which provides
`add_arguments(parser)` and `run(args) -> int`. Modules are imported only when
their command runs, so `completiond lsp` does not pay for torch at start-up.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "complete": ("completiond.commands.complete", "print the suggestion for FILE:LINE:COL"),
    "generate": ("completiond.commands.generate", "continue a prompt (the external losslessness check)"),
    "bench": (
        "completiond.commands.bench",
        "speed benchmarks: speculative vs plain vs transformers; --typing for the editor path",
    ),
    "bench-device": (
        "completiond.commands.bench_device",
        "accelerator figures: plain ms/token against the bandwidth bound, verify cost K=1..8, sampling (prepared for a lent GPU)",
    ),
    "bench-syntax": (
        "completiond.commands.bench_syntax",
        "what the syntax layer costs per request on a 5,000-line file (no model)",
    ),
    "pull": ("completiond.commands.pull", "download a hub model (safetensors and tokenizer only) into the local cache"),
    "setup": (
        "completiond.commands.setup",
        "one-time preparation (compile the native CPU step) before the first completion",
    ),
    "calibrate": (
        "completiond.commands.calibrate",
        "measure acceptance and speed per exit layer and K; store the best",
    ),
    "eval": ("completiond.commands.eval", "completion quality on deterministic cursor positions in a directory"),
    "serve": ("completiond.commands.serve", "run the shared daemon in the foreground"),
    "lsp": ("completiond.lsp.server", "LSP server over stdio (what editors run)"),
    "status": ("completiond.commands.status", "show the running daemon's status"),
    "stop": ("completiond.commands.stop", "stop the running daemon"),
    "settings": (
        "completiond.commands.settings",
        "print the settings in effect and where each comes from (--schema: as JSON)",
    ),
    "train-adapter": (
        "completiond.commands.train_adapter",
        "train a model's exit adapter (a draft that reads a shallow layer well)",
    ),
    "train-medusa": ("completiond.commands.train_medusa", "train Medusa heads for a model (token-tree drafts, greedy)"),
    "train-default": ("completiond.models.training.train_default", "retrain the bundled default model"),
    "train-context": (
        "completiond.commands.train_context",
        "continue a model's training on prompts with repository context (the bundled model's last stage)",
    ),
    "stress": ("completiond.commands.stress", "fuzz and load drivers for the daemon and the LSP server (development)"),
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        return dist_version("completiond")
    except PackageNotFoundError:
        return "(not installed: run from a source checkout)"


def main(argv: list[str] | None = None) -> int:
    try:
        rc = _main(argv)
        # Flush here, not at interpreter exit, so a reader that went away is noticed below (the LSP
        # server closes stdout itself when the editor leaves).
        if not sys.stdout.closed:
            sys.stdout.flush()
        return rc
    except BrokenPipeError:
        # `completiond settings | head`: the reader has all it wanted. Point stdout at /dev/null so the
        # interpreter's own final flush does not fail again, and end like a program killed by SIGPIPE.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + 13


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="completiond", description="Local code completion with self-speculative decoding."
    )
    parser.add_argument("--version", action="version", version=f"completiond {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    argv = sys.argv[1:] if argv is None else argv
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # Import only the module of the command being run: --help on the
        # top level stays instant and a broken optional module can't break others.
        if name == wanted:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            modules[name] = module
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(modules[args.command].run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
