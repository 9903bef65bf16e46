"""`completiond serve`: run the per-user daemon in the foreground (editors start it on demand)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any

from completiond import config as config_mod
from completiond.serving.paths import daemon_unsupported
from completiond.serving.lifecycle import resolve_model

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory or hub id (default: the bundled model)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "mps"))
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument(
        "--weights",
        choices=config_mod.SETTINGS_BY_KEY["weights"].enum,
        help="weight format of the native CPU step: auto, bf16 or int8 (default: the weights setting)",
    )
    parser.add_argument("--draft-model", help="separate draft model: directory or hub id (default: none)")
    parser.add_argument("--trust-remote-code", action="store_true", default=None)
    parser.add_argument("--cache-mb", type=int, help="prefix KV cache budget in MiB")
    parser.add_argument("--idle-timeout", type=float, help="seconds to stay up with no client connected")
    parser.add_argument(
        "--runtime-dir", type=Path, help="directory for the socket (default: $XDG_RUNTIME_DIR/completiond)"
    )
    parser.add_argument("--config", type=Path, help="config.toml to read (default: ~/.config/completiond/config.toml)")
    parser.add_argument("--log-level", choices=("error", "warning", "info", "debug"))
    team = parser.add_argument_group("team backend (see README, For teams)")
    team.add_argument("--backend", choices=("local", "openai", "llamacpp-infill"))
    team.add_argument("--endpoint", help="base URL of the completion server")
    team.add_argument("--endpoint-model", help="model name the server serves")
    team.add_argument("--api-key-env", help="environment variable holding the API key")
    team.add_argument("--api-key-file", help="file holding the API key (mode 600)")
    team.add_argument("--endpoint-ca-file", help="CA certificate (PEM) for a private CA")
    team.add_argument("--endpoint-timeout", type=float, help="seconds to wait for the server")
    team.add_argument("--api-key-over-http", help="endpoints to which the API key may go over plain http://")


def config_from_args(args: argparse.Namespace) -> tuple[Any, list[str]]:
    cfg, errors = config_mod.load_file(getattr(args, "config", None))
    overrides = {
        "model": resolve_model(args.model) if args.model else None,
        "device": args.device,
        "dtype": args.dtype,
        "trustRemoteCode": args.trust_remote_code,
        "cacheMegabytes": args.cache_mb,
        "idleTimeout": int(args.idle_timeout) if args.idle_timeout is not None and args.idle_timeout >= 5 else None,
        "logLevel": args.log_level,
        "backend": args.backend,
        "endpoint": args.endpoint,
        "endpointModel": args.endpoint_model,
        "apiKeyEnv": args.api_key_env,
        "apiKeyFile": args.api_key_file,
        "endpointCaFile": args.endpoint_ca_file,
        "endpointTimeout": args.endpoint_timeout,
        "apiKeyOverHttp": args.api_key_over_http,
        "draftModel": resolve_model(args.draft_model) if args.draft_model else None,
    }
    if args.weights is not None:
        overrides["weights"] = args.weights
    cfg, more = config_mod.merge(cfg, overrides)
    return cfg, errors + more


def run(args: argparse.Namespace) -> int:
    unsupported = daemon_unsupported()
    if unsupported:
        print(
            f"completiond serve: {unsupported}. Editors run the model in their language server here "
            "(`completiond lsp --no-daemon`, chosen automatically).",
            file=sys.stderr,
        )
        return 2
    # The socket server needs fcntl and AF_UNIX: imported only where they exist.
    from completiond.serving.server import install_log_rate_limit, serve

    cfg, errors = config_from_args(args)
    logging.basicConfig(
        level=cfg.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s completiond[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    install_log_rate_limit()  # daemon.log lives in the runtime directory: a flood must not fill it
    for error in errors:
        log.warning("%s", error)
    idle = args.idle_timeout if args.idle_timeout is not None else None
    code = asyncio.run(serve(cfg, args.runtime_dir, idle))
    # The socket, pid file and lock are cleaned up by now. The engine's worker thread may still be
    # inside torch or transformers (a model load cannot be interrupted); letting the interpreter
    # finalise around it aborted the process ("terminate called without an active exception",
    # exit -6) in about one stop in ten. Leave without finalising instead.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
