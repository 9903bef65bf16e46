"""The one typed, fully defaulted settings object.

Every setting the server understands is declared once, as a field of `Config`
with its default and its metadata (description, range, enum, scope, group,
restricted). SETTINGS is derived from those fields; the editor plugins (VS Code
`contributes.configuration`, the Neovim defaults table) and the README table are
checked against / generated from it, so a setting is added here first. Editors
send the `completiond` section with camelCase keys; Python code reads the
snake_case attributes of `Config`.

Layering (later wins): defaults < config.toml < initializationOptions <
workspace/configuration. Invalid values are reported and replaced by the
default; they never raise.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (still supported): the same parser, published as tomli
    import tomli as tomllib

from completiond.fileio import UnsafeFile, read_file


@dataclass(frozen=True)
class Setting:
    """One setting as editors and validation see it: a field of Config, its camelCase key and its metadata."""

    key: str  # camelCase, as editors send it
    type: type
    default: Any
    description: str
    enum: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    # optional: check(value) raises ValueError with the reason (beyond type, enum and range)
    check: Callable[[Any], object] | None = None
    scope: str = "window"  # VS Code's configuration scope; "machine": user settings only, never a workspace's
    # Where editors list it (a key of GROUPS): everyday settings first, decoding internals under "advanced".
    group: str = "advanced"
    # One line per enum value, in enum order (VS Code shows them in the setting's dropdown).
    enum_descriptions: tuple[str, ...] | None = None
    # It names a model, a draft model, a path, an endpoint or code to run: an untrusted workspace must not
    # choose it. VS Code lists it in restrictedConfigurations unless it is machine-scoped already; the
    # Neovim doc says which settings to keep out of project-local config (exrc).
    restricted: bool = False

    @property
    def attr(self) -> str:
        return _snake_case(self.key)


@functools.lru_cache(maxsize=None)
def _snake_case(key: str) -> str:
    # Cached: every status notification and request reads all settings by attribute (to_settings), and the
    # regular expression was the daemon's and the LSP's largest cost per request.
    return re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()


# Editors' sections, in display order: (key, title). VS Code shows each as a titled part of the settings.
GROUPS: tuple[tuple[str, str], ...] = (
    ("general", "General"),
    ("prompt", "Prompt and context"),
    ("team", "Team server"),
    ("advanced", "Advanced: model and decoding"),
)


def _check_url(value: str) -> None:
    """An endpoint is an http(s) base URL without credentials (those belong in apiKeyEnv / apiKeyFile)."""
    if not value:
        return
    from urllib.parse import urlsplit

    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL with a host, got {value!r}")
    if parts.username or parts.password:
        raise ValueError("credentials in the URL are not accepted; use apiKeyEnv or apiKeyFile")


def _check_exclude(value: str) -> None:
    """contextExclude only adds patterns: a negation would quietly re-include secret files."""
    patterns = [p.strip() for p in value.split(",") if p.strip()]
    if len(value) > 4096 or len(patterns) > 64:
        raise ValueError("at most 64 patterns and 4096 characters")
    negated = [p for p in patterns if p.startswith("!")]
    if negated:
        raise ValueError(
            f"{', '.join(negated)}: patterns can only add to the built-in deny-list of secret files, "
            "not re-include files ('!' is not accepted)"
        )


def _check_languages(value: str) -> None:
    ids = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in ids if not re.fullmatch(r"[A-Za-z0-9_.+#-]{1,64}", v)]
    if bad:
        raise ValueError(
            f"expected comma-separated language ids (letters, digits, _ . + # -), got {', '.join(bad[:3])!r}"
        )
    if len(ids) > 256:
        raise ValueError("at most 256 language ids")


def disabled_languages(cfg: Config) -> frozenset[str]:
    """The language ids (lower case) whose documents get no suggestions (disabledLanguages)."""
    return frozenset(v.strip().lower() for v in cfg.disabled_languages.split(",") if v.strip())


def _check_urls(value: str) -> None:
    """apiKeyOverHttp: comma-separated endpoints, each as _check_url accepts it."""
    for url in value.split(","):
        if url.strip():
            _check_url(url)


T = TypeVar("T")


def setting(
    default: T,
    description: str,
    *,
    enum: tuple[str, ...] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    check: Callable[[Any], object] | None = None,
    scope: str = "window",
    group: str = "advanced",
    enum_descriptions: tuple[str, ...] | None = None,
    restricted: bool = False,
) -> T:
    """A Config field: its default, plus the metadata the Setting derived from it carries (see Setting)."""
    meta = {
        "description": description,
        "enum": enum,
        "minimum": minimum,
        "maximum": maximum,
        "check": check,
        "scope": scope,
        "group": group,
        "enum_descriptions": enum_descriptions,
        "restricted": restricted,
    }
    return field(default=default, metadata={"setting": meta})


@dataclass(frozen=True)
class Config:
    """All completiond settings, each with its default; editors send them by camelCase key (SETTINGS)."""

    enable: bool = setting(True, "Show inline completions.", group="general")
    model: str = setting(
        "",
        "Model: a local directory written as a path (./, ../, / or ~; a relative one only in "
        "config.toml, relative to that file), a Hugging Face hub id (org/name, optionally @revision) or a short "
        "name from `completiond pull --list`; a hub model not yet in the cache is downloaded on first use. Empty "
        "means the bundled default model.",
        group="general",
        restricted=True,
    )
    device: str = setting(
        "auto",
        "Where the model runs: auto picks cuda, then mps, then cpu.",
        enum=("auto", "cpu", "cuda", "mps"),
        group="general",
        enum_descriptions=(
            "CUDA if there is a GPU, else Apple MPS, else the CPU.",
            "The CPU (float32 weights).",
            "An NVIDIA GPU.",
            "The GPU of an Apple Silicon Mac.",
        ),
    )
    dtype: str = setting(
        "auto",
        "Weight dtype: auto is bfloat16 on GPU and float32 on CPU.",
        enum=("auto", "float32", "bfloat16", "float16"),
        enum_descriptions=(
            "bfloat16 on a GPU, float32 on the CPU.",
            "Full precision: the CPU default, twice the memory of bfloat16.",
            "Half the memory of float32; needs a GPU or CPU with bfloat16 support to be fast.",
            "Half the memory of float32, for GPUs without bfloat16 (before Ampere).",
        ),
    )
    weights: str = setting(
        "auto",
        "Weight format of the native CPU step: auto keeps the model's own (bf16 panels for bf16 "
        "weights) unless the model names its format (the bundled model: int8), bf16 rounds float32 weights to "
        "bf16, int8 quantises them per output channel (smaller and faster, slightly less accurate). "
        "Speculative output equals plain output in every format.",
        enum=("auto", "bf16", "int8"),
        enum_descriptions=(
            "The model's own values (bf16 panels for bf16 weights), or the format the model names "
            "(the bundled model: int8).",
            "Float32 weights rounded to bfloat16: half the bytes per token.",
            "Weights quantised to 8 bits per output channel: smallest and fastest, slightly less accurate.",
        ),
    )
    draft_model: str = setting(
        "",
        "A separate, smaller draft model with the same tokenizer (local directory or hub id) that "
        "proposes tokens for the model to verify (lossless); empty: the model drafts from its own early layers.",
        restricted=True,
    )
    trust_remote_code: bool = setting(
        False,
        "Allow model repositories to run their own Python code (off: only built-in "
        "transformers architectures load). A user or machine setting only, and honoured only for a model named "
        "there too (never for one a workspace picks).",
        scope="machine",
        restricted=True,
    )
    max_tokens: int = setting(64, "Most tokens generated for one suggestion.", minimum=1, maximum=1024, group="general")
    temperature: float = setting(
        0.0, "Sampling temperature; 0 is greedy (deterministic).", minimum=0.0, maximum=2.0, group="general"
    )
    top_p: float = setting(1.0, "Nucleus sampling mass (1 disables).", minimum=0.01, maximum=1.0)
    top_k: int = setting(0, "Keep only the K most likely tokens (0 disables).", minimum=0, maximum=100000)
    seed: int = setting(
        0,
        "Sampling seed; each request derives its own from it, so results are reproducible.",
        minimum=0,
        maximum=2**31 - 1,
    )
    alternatives: int = setting(
        1,
        "Most different suggestions offered at once, to cycle through with the editor's next/previous "
        "keys. Each one after the first costs about one more generation: greedy gives the branch of the next-best "
        "first token, sampling a run with its own seed.",
        minimum=1,
        maximum=8,
        group="general",
    )
    speculation: bool = setting(True, "Self-speculative decoding (lossless: same output distribution, faster).")
    exit_layer: int = setting(
        0, "Draft exit layer E; 0 uses the calibrated value for the model.", minimum=0, maximum=1024
    )
    draft_tokens: int = setting(0, "Most draft tokens K per round; 0 uses the calibrated value.", minimum=0, maximum=32)
    draft_threshold: float = setting(
        0.0,
        "Stop drafting when the draft's top probability falls below this; 0 uses the calibrated value.",
        minimum=0.0,
        maximum=1.0,
    )
    multiline: str = setting(
        "auto",
        "Multi-line suggestions: auto (after a block opener or on an empty line), always, never.",
        enum=("auto", "always", "never"),
        group="general",
        enum_descriptions=(
            "Several lines after a block opener (a line ending in : { ( [) or on an empty line; one line elsewhere.",
            "Always allow several lines.",
            "One line at most.",
        ),
    )
    max_lines: int = setting(8, "Most lines in a multi-line suggestion.", minimum=1, maximum=200, group="general")
    syntax_check: bool = setting(
        True,
        "Every language with a grammar (Python, JavaScript, TypeScript, Go, Rust, Java, C, "
        "C++, C#, Bash): show only what adds no syntax error around the cursor (the longest part of a suggestion that "
        "does, or nothing). A header without its body yet, a bracket you are still inside and a brace the suggestion "
        "opens pass.",
        group="general",
    )
    disabled_languages: str = setting(
        "markdown,plaintext,text,scminput,gitcommit,gitrebase,help",
        "Comma-separated language ids (as editors name them: markdown, plaintext, text, gitcommit...) whose "
        "documents get no suggestions from the server, whatever the client. Prose and commit messages are off "
        "by default; remove one to turn it on (VS Code and Neovim also keep their own list: "
        "completiond.editor.disabledLanguages, `filetypes`).",
        check=lambda value: _check_languages(value),
        group="general",
    )
    fim_template: str = setting(
        "auto",
        "Fill-in-the-middle prompt template; auto detects it from the tokenizer's special tokens.",
        enum=("auto", "completiond", "qwen2.5-coder", "starcoder", "deepseek-coder", "codellama", "codestral", "none"),
        group="prompt",
        enum_descriptions=(
            "Detected from the tokenizer's special tokens.",
            "The bundled model's own layout.",
            "Qwen2.5-Coder's <|fim_prefix|> layout.",
            "StarCoder's <fim_prefix> layout.",
            "DeepSeek-Coder's layout.",
            "Code Llama's <PRE> <SUF> <MID> layout.",
            "Codestral's [SUFFIX] [PREFIX] layout.",
            "No fill-in-the-middle: the text before the cursor only.",
        ),
    )
    token_healing: bool = setting(
        True,
        "When the cursor is inside a word, back up its last token and constrain the output to start with the removed text.",
        group="prompt",
    )
    prefix_tokens: int = setting(
        1024,
        "Token budget for text before the cursor (clipped to the model's context).",
        minimum=16,
        maximum=32768,
        group="prompt",
    )
    suffix_tokens: int = setting(
        256, "Token budget for text after the cursor.", minimum=0, maximum=32768, group="prompt"
    )
    workspace_context: bool = setting(
        True, "Prepend snippets of recently edited and open files of the same language.", group="prompt"
    )
    context_tokens: int = setting(
        256, "Token budget for the workspace context block.", minimum=0, maximum=32768, group="prompt"
    )
    context_retrieval: str = setting(
        "on",
        "How the context block is chosen: on retrieves the chunks of workspace files that "
        "the code around the cursor needs (definitions of the names at the cursor, then similar code); off takes "
        "snippets of recently edited files.",
        enum=("on", "off"),
        group="prompt",
        enum_descriptions=(
            "Chunks retrieved for the cursor from an index of the workspace files that may be context.",
            "Snippets of recently edited and open files of the same language.",
        ),
    )
    context_exclude: str = setting(
        "",
        "Comma-separated glob patterns (e.g. *.sql,fixtures/*) of files never sent as context, "
        "added to the built-in deny-list of secret files (.env*, *.pem, *.key, id_* keys, *credential*, *secret*, .netrc, "
        ".npmrc, .pypirc, cloud CLI folders; see docs/RELIABILITY.md), which no setting can weaken.",
        check=_check_exclude,
        group="prompt",
    )
    cache_megabytes: int = setting(
        0, "Prefix KV cache budget in MiB; 0 picks a default (512 on CPU, 4096 on GPU).", minimum=0, maximum=1 << 20
    )
    idle_timeout: int = setting(
        900, "Seconds the shared daemon stays up with no editor connected.", minimum=5, maximum=7 * 24 * 3600
    )
    log_level: str = setting(
        "info",
        "Log verbosity of the daemon and the LSP server.",
        enum=("error", "warning", "info", "debug"),
        enum_descriptions=(
            "Errors only.",
            "Errors and warnings.",
            "Also loads, connections and settings changes.",
            "Also each request and the files its context came from.",
        ),
    )
    # A team server instead of the local model (completiond/backends/team_server.py). Editors offer these as
    # machine settings (VS Code scope "machine"): a repository's own workspace settings cannot send its
    # reader's code to a server of its choosing.
    backend: str = setting(
        "local",
        "Where suggestions are generated: local (the model in the daemon), openai (an "
        "OpenAI-compatible /v1/completions server: vLLM, SGLang, TGI, llama.cpp's llama-server) or llamacpp-infill "
        "(llama.cpp's native /infill). Remote backends get the prompt as text: no token healing, token budgets "
        "counted as 4 characters per token.",
        enum=("local", "openai", "llamacpp-infill"),
        scope="machine",
        group="team",
        restricted=True,
        enum_descriptions=(
            "The model in the daemon on this machine: nothing leaves it.",
            "An OpenAI-compatible /v1/completions server (vLLM, SGLang, TGI, llama-server).",
            "llama.cpp's native /infill endpoint.",
        ),
    )
    endpoint: str = setting(
        "",
        "Base URL of the completion server for a remote backend (e.g. https://gpu-box:8000); "
        "TLS certificates are verified.",
        check=_check_url,
        scope="machine",
        group="team",
        restricted=True,
    )
    endpoint_model: str = setting(
        "",
        "The model name the server serves it under (the request's model field; "
        "with fimTemplate auto it also picks the FIM template).",
        scope="machine",
        group="team",
        restricted=True,
    )
    api_key_env: str = setting(
        "",
        "Name of the environment variable that holds the server's API key (the key itself is never a setting).",
        scope="machine",
        group="team",
        restricted=True,
    )
    api_key_file: str = setting(
        "",
        "File that holds the server's API key on one line; it must be readable by you "
        "only (chmod 600). Used when apiKeyEnv is empty.",
        scope="machine",
        group="team",
        restricted=True,
    )
    endpoint_ca_file: str = setting(
        "",
        "PEM file of the certificate authority that signed the server's certificate, "
        "for a private CA (verification stays on).",
        scope="machine",
        group="team",
        restricted=True,
    )
    api_key_over_http: str = setting(
        "",
        "Endpoints (comma-separated base URLs, exactly as in completiond.endpoint) to which "
        "the API key may be sent over plain http://, unencrypted. Without this, a key goes over http:// only to "
        "this machine (localhost, 127.0.0.1, ::1); use https:// for anything else.",
        check=_check_urls,
        scope="machine",
        group="team",
        restricted=True,
    )
    endpoint_timeout: float = setting(
        10.0,
        "Seconds to wait for the completion server (to connect, or between two "
        "parts of its answer) before reporting it and retrying with backoff.",
        minimum=0.5,
        maximum=300.0,
        scope="machine",
        group="team",
    )


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _settings() -> tuple[Setting, ...]:
    types = get_type_hints(Config)
    out = []
    for f in dataclasses.fields(Config):
        s = Setting(_camel(f.name), types[f.name], f.default, **f.metadata["setting"])
        if s.attr != f.name or s.type not in (bool, int, float, str) or type(s.default) is not s.type:
            raise TypeError(
                f"Config.{f.name}: a setting is a bool, int, float or str field with a default of that "
                "type whose name survives camelCase and back"
            )
        out.append(s)
    return tuple(out)


SETTINGS: tuple[Setting, ...] = _settings()
SETTINGS_BY_KEY = {s.key: s for s in SETTINGS}
_KEY_ATTRS = tuple((s.key, s.attr) for s in SETTINGS)


def _coerce(setting: Setting, value: Any) -> Any:
    """Return the value converted to the setting's type, or raise ValueError with the reason."""
    t = setting.type
    if t is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"expected true or false, got {value!r}")
    if t is int:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (isinstance(value, float) and not value.is_integer())
        ):
            raise ValueError(f"expected an integer, got {value!r}")
        value = int(value)
    elif t is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected a number, got {value!r}")
        value = float(value)
        if value != value:  # NaN
            raise ValueError("expected a number, got NaN")
    elif t is str:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
    if setting.enum is not None and value not in setting.enum:
        raise ValueError(f"expected one of {', '.join(setting.enum)}, got {value!r}")
    if setting.minimum is not None and value < setting.minimum:
        raise ValueError(f"must be >= {setting.minimum}, got {value!r}")
    if setting.maximum is not None and value > setting.maximum:
        raise ValueError(f"must be <= {setting.maximum}, got {value!r}")
    if setting.check is not None:
        setting.check(value)
    return value


# Settings that name a model: a hub id or catalog short name, or a local directory written explicitly.
MODEL_KEYS = ("model", "draftModel")
# Settings that name a file (read by the daemon, which runs in /).
FILE_KEYS = ("apiKeyFile", "endpointCaFile")
LOCAL_PREFIXES = ("./", "../", "/", "~")


def is_local_model(value: str | os.PathLike) -> bool:
    """Whether a model setting names a local directory: only when written as one (`./`, `../`, `/`, `~`).
    Anything else is a hub id or a catalog short name, even where a directory of that name happens to be
    in the current directory (a cloned repository could plant `Qwen/Qwen2.5-Coder-0.5B` there)."""
    text = os.fspath(value)
    return text in (".", "..") or text.startswith(LOCAL_PREFIXES)


def resolve_local_model(value: str, base: str | os.PathLike | None = None) -> str:
    """An explicit local directory as an absolute path (`~` expanded; a relative one against `base`, else
    the current directory); a hub id or short name unchanged."""
    if not value or not is_local_model(value):
        return value
    path = os.path.expanduser(value)
    if not os.path.isabs(path) and base is not None:
        path = os.path.join(os.fspath(base), path)
    return os.path.abspath(path)


def _relative_path(key: str, value: Any) -> bool:
    """A path setting whose value is relative: resolved against nothing reliable in an editor's settings."""
    if not isinstance(value, str) or not value:
        return False
    if key in MODEL_KEYS:
        return is_local_model(value) and not os.path.isabs(value) and not value.startswith("~")
    return key in FILE_KEYS and not os.path.isabs(value) and not value.startswith("~")


def merge(
    base: Config, overrides: Mapping[str, Any] | None, relative_to: str | os.PathLike | None = None, source: str = ""
) -> tuple[Config, list[str]]:
    """Apply camelCase overrides to a Config. Returns (config, errors).

    Unknown keys and invalid values are reported in errors and ignored, so the
    result is always a valid Config. A value of None means "leave as is".

    Paths (a local model directory, apiKeyFile, endpointCaFile): with `relative_to` (the folder of the
    config file that set them) a relative one is resolved against it; with `source` (an editor's settings
    layer, named so in the message) a relative one is refused, since the editor's working directory (the
    project, for Neovim) is no base to trust.
    """
    errors: list[str] = []
    if overrides is None:
        return base, errors
    if not isinstance(overrides, Mapping):
        return base, [f"completiond settings must be an object, got {type(overrides).__name__}"]
    changes = {}
    for key, value in overrides.items():
        setting = SETTINGS_BY_KEY.get(key) if isinstance(key, str) else None
        if setting is None:
            errors.append(f"completiond.{key}: unknown setting (ignored)")
            continue
        if value is None:
            continue
        if _relative_path(key, value):
            if relative_to is not None:
                value = os.path.abspath(os.path.join(os.fspath(relative_to), os.path.expanduser(value)))
            elif source:
                errors.append(
                    f"completiond.{key}: {value!r} is a relative path, which {source} cannot use (it "
                    f"would depend on the editor's working directory); write it absolute or from ~, or "
                    f"set it in config.toml, where it is relative to that file; using "
                    f"{getattr(base, setting.attr)!r}"
                )
                continue
        try:
            changes[setting.attr] = _coerce(setting, value)
        except ValueError as exc:
            errors.append(f"completiond.{key}: {exc}; using {getattr(base, setting.attr)!r}")
    return dataclasses.replace(base, **changes), errors


def defaults() -> Config:
    return Config()


def config_file_path() -> Path:
    root = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(root) / "completiond" / "config.toml"


def load_file(path: Path | None = None, base: Config | None = None) -> tuple[Config, list[str]]:
    """Read config.toml (top-level camelCase keys, or a [completiond] table).

    A missing file is not an error; an unreadable or malformed one is reported
    and the base config is kept.
    """
    path = path or config_file_path()
    base = base if base is not None else Config()
    try:
        # Symlinks are followed (dotfile managers link config files), but the target must be a
        # regular file: a FIFO or /dev/zero would otherwise block or fill memory.
        raw = read_file(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        return base, []
    except UnsafeFile as exc:  # its message names the file
        return base, [f"cannot read config file: {exc}; using the defaults"]
    except OSError as exc:
        return base, [f"{path}: cannot read config file: {exc.strerror or exc}"]
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, ValueError) as exc:
        return base, [f"{path}: invalid TOML: {exc}"]
    except RecursionError:
        return base, [f"{path}: invalid TOML: nested too deeply to parse"]
    if isinstance(data.get("completiond"), dict):
        data = data["completiond"]
    # Relative paths in the file are relative to the file, never to whichever directory the reader runs in.
    cfg, errors = merge(base, data, relative_to=Path(path).expanduser().absolute().parent)
    return cfg, [f"{path}: {e}" for e in errors]


MAX_CONFIG_BYTES = 1 << 20  # a real config.toml is a few hundred bytes


def to_settings(cfg: Config) -> dict[str, Any]:
    """camelCase dict of a Config, as editors send it."""
    return {key: getattr(cfg, attr) for key, attr in _KEY_ATTRS}


def schema() -> list[dict[str, Any]]:
    """Machine-readable SETTINGS for the editor plugins and the README table."""
    out = []
    in_group: dict[str, int] = {}
    for s in SETTINGS:
        in_group[s.group] = in_group.get(s.group, 0) + 1
        item: dict[str, Any] = {
            "key": s.key,
            "type": {bool: "boolean", int: "integer", float: "number", str: "string"}[s.type],
            "default": s.default,
            "description": s.description,
            # The editors' section (GROUPS) and the place in it: SETTINGS order within each group.
            "group": s.group,
            "order": in_group[s.group],
        }
        if s.enum is not None:
            item["enum"] = list(s.enum)
        if s.enum_descriptions is not None:
            item["enumDescriptions"] = list(s.enum_descriptions)
        if s.restricted:
            item["restricted"] = True
        if s.minimum is not None:
            item["minimum"] = s.minimum
        if s.maximum is not None:
            item["maximum"] = s.maximum
        if s.scope != "window":
            item["scope"] = s.scope
        out.append(item)
    return out


def groups() -> list[dict[str, Any]]:
    """GROUPS as editors read them (`completiond settings --schema` carries them per setting)."""
    return [{"key": key, "title": title, "order": i + 1} for i, (key, title) in enumerate(GROUPS)]


def markdown_table() -> str:
    """The settings table of README.md (a test keeps the README in step with SETTINGS)."""
    rows = ["| setting | type | default | description |", "| --- | --- | --- | --- |"]
    for item in schema():
        kind = item["type"]
        if "enum" in item:
            kind = " \\| ".join(f"`{v}`" for v in item["enum"])
        elif "minimum" in item or "maximum" in item:
            lo, hi = item.get("minimum"), item.get("maximum")
            kind += f" ({'' if lo is None else _num(lo)}…{'' if hi is None else _num(hi)})"
        rows.append(f"| `completiond.{item['key']}` | {kind} | `{_default(item['default'])}` | {item['description']} |")
    return "\n".join(rows) + "\n"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def _default(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return '""' if v == "" else str(v)


# Settings that decide which engine is loaded (a change needs a model reload); the rest apply per request.
ENGINE_KEYS = (
    "model",
    "draftModel",
    "device",
    "dtype",
    "weights",
    "trustRemoteCode",
    "cacheMegabytes",
    "backend",
    "endpoint",
    "endpointModel",
    "apiKeyEnv",
    "apiKeyFile",
    "endpointCaFile",
    "endpointTimeout",
    "apiKeyOverHttp",
)

# What a user can actually do when the shared daemon serves other engine settings than theirs (the LSP
# restarts it by itself only when the user changes them; a daemon another editor started is left alone).
RESTART_HINT = (
    'restart the daemon to load yours: "completiond: Restart Daemon" in the VS Code command palette, '
    "`:CompletiondRestart` in Neovim, or `completiond stop` in a terminal"
)


def engine_settings(cfg: Config) -> dict[str, Any]:
    full = to_settings(cfg)
    return {k: full[k] for k in ENGINE_KEYS}


# The bundled default model, as users see it named (models/ ships it in a directory of this name, and the
# engine calls it "<name> (bundled)"; a test keeps the three in step).
BUNDLED_MODEL = "completiond-py-mini"


def model_label(value: str, key: str = "model") -> str:
    """How a model setting reads in messages, status lines and `completiond status`: the one naming of the
    bundled default (an empty model), "none" for no separate draft model, anything else as written."""
    if value:
        return value
    return f"{BUNDLED_MODEL} (bundled)" if key == "model" else "none (the model drafts from its own layers)"


# What every completion request carries of its editor's engine settings: where the editor allows its
# documents to go. The daemon serves a request only under the backend it names (route_refusal).
ROUTE_KEYS = ("backend", "endpoint")


def request_settings(cfg: Config) -> dict[str, Any]:
    """The settings a completion request carries: those that apply per request, and ROUTE_KEYS."""
    return {k: v for k, v in to_settings(cfg).items() if k not in ENGINE_KEYS or k in ROUTE_KEYS}


def request_config(base: Config, settings: Mapping[str, Any] | None) -> Config:
    """`base` with a request's per-request settings (its ENGINE_KEYS are the daemon's own: left out); errors
    ignored, as merge reports them to the editor that sent them. Every keystroke's request carries the same
    settings, so the merged config is kept (a merge per request was a large share of the daemon's time)."""
    # Each value's type is part of the key: 1, 1.0 and True are equal keys, and merge takes them differently.
    items = tuple((k, type(v), v) for k, v in (settings or {}).items() if k not in ENGINE_KEYS)
    try:
        return _request_config(base, items)
    except TypeError:  # an unhashable value (a malformed request): merged uncached, and rejected there
        return merge(base, {k: v for k, _, v in items})[0]


@functools.lru_cache(maxsize=16)
def _request_config(base: Config, items: tuple[tuple[str, type, Any], ...]) -> Config:
    return merge(base, {k: v for k, _, v in items})[0]


def _endpoint_key(url: Any) -> str:
    return str(url or "").strip().rstrip("/")


def route_refusal(wanted: Mapping[str, Any] | None, cfg: Config) -> str:
    """Why a daemon serving `cfg` must not answer a request whose editor settings are `wanted`, or ''.

    A daemon with a remote backend sends the document to its server: it may do so only for an editor whose
    own settings name a remote backend at that same endpoint. A request that names no backend counts as
    `local` (an editor that never chose a server). The reverse, a remote backend asked and the local model
    serving, keeps the document on this machine: allowed (the welcome's warning says so).
    """
    if cfg.backend == "local":
        return ""
    wanted = wanted if isinstance(wanted, Mapping) else {}
    backend = wanted.get("backend") or "local"
    endpoint = wanted.get("endpoint") or ""
    if backend != "local" and _endpoint_key(endpoint) == _endpoint_key(cfg.endpoint):
        return ""
    asked = "backend = local" if backend == "local" else f"backend {backend} at {endpoint or '(no endpoint)'}"
    return (
        f"not sent: your settings say {asked}, but the shared daemon sends documents to {cfg.backend} at "
        f"{cfg.endpoint or '(no endpoint)'}, which your settings did not choose; no document of yours is sent "
        f"there. Restart the daemon with your settings: " + RESTART_HINT.split(": ", 1)[-1]
    )


def engine_differences(want: Mapping[str, Any], have: Mapping[str, Any]) -> list[str]:
    """The ENGINE_KEYS where `have` (what a daemon serves) differs from `want` (what an editor asked for),
    each as `key=wanted (daemon: actual)`. Local model directories compare by absolute path, as the
    daemon stores them."""

    def norm(key: str, value: Any) -> Any:
        if key in MODEL_KEYS and isinstance(value, str):
            return resolve_local_model(value)
        return value

    def shown(key: str, value: Any) -> str:
        return repr(model_label(value or "", key)) if key in ("model", "draftModel") else repr(value)

    return [
        f"{k}={shown(k, want.get(k))} (daemon: {shown(k, have.get(k))})"
        for k in ENGINE_KEYS
        if norm(k, want.get(k)) != norm(k, have.get(k))
    ]
