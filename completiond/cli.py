"""`completiond` command line: a thin dispatcher.

Each subcommand lives in the module named here, which provides
`add_arguments(parser)` and `run(args) -> int`. Modules are imported only when
their command runs, so `completiond lsp` does not pay for torch at start-up.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("completiond.generate", "continue a prompt (the external losslessness check)"),
    "bench": ("completiond.bench", "speed benchmarks: speculative vs plain vs transformers; --typing for the editor path"),
    "calibrate": ("completiond.calibrate", "measure acceptance and speed per exit layer and K; store the best"),
    "complete": ("completiond.complete", "print the suggestion for FILE:LINE:COL"),
    "serve": ("completiond.daemon", "run the shared daemon in the foreground"),
    "lsp": ("lsp.server", "LSP server over stdio (what editors run)"),
    "status": ("completiond.control", "show the running daemon's status"),
    "stop": ("completiond.control", "stop the running daemon"),
    "eval": ("completiond.evaluate", "completion quality on deterministic cursor positions in a directory"),
    "train-default": ("models.train_default", "retrain the bundled default model from scratch"),
    "settings": ("completiond.cli", "print the settings schema as JSON"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--toml", action="store_true", help="print a config.toml with every default instead")


def run(args: argparse.Namespace) -> int:
    from completiond import config

    if args.toml:
        for item in config.schema():
            value = json.dumps(item["default"])
            print(f"# {item['description']}\n{item['key']} = {value}\n")
    else:
        print(json.dumps(config.schema(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="completiond", description="Local code completion with self-speculative decoding.")
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
