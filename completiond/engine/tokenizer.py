"""The model's tokenizer read by the `tokenizers` library alone, where it is proven to act as transformers' does.

Why: building the tokenizer is the one thing a CPU daemon on engine/checkpoint.py still imported transformers
for. That import costs about 32 MiB of resident memory (0.034x of a 0.5B model's bf16 weights) and 1.1 s of
every start. tokenizer.json already describes the whole pipeline, so `tokenizers.Tokenizer` can run it.

But AutoTokenizer is the reference, and in transformers 5 it does not always do what the file says: a family's
class may rebuild the pipeline in code (Qwen2Tokenizer lays its own pre-tokenizer over the file's vocabulary),
add a BOS token from tokenizer_config.json, or clean up spaces on decode. So nothing is assumed. The first time
a tokenizer is seen, a child process (`python -m completiond.engine.tokenizer_check DIR`) loads both and compares
them (tokenizer_check.py): vocabulary, every id's token and text, and encode/decode of a probe set (code, whitespace,
Unicode, every added token in text). It stores the verdict in the user's cache, keyed by the tokenizer files'
contents, the config fields AutoTokenizer reads, and the installed transformers and tokenizers versions. Only a
verdict of "same" lets `light_tokenizer` stand in; anything else (a difference, a failed check, remote code, no
tokenizer.json) leaves the load to AutoTokenizer, as before. A process that has imported transformers anyway
uses AutoTokenizer directly: there is nothing left to save.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

from completiond.engine.hub_cache import SIDE_FILE_LIMITS, TOKENIZER_FILES, read_json
from completiond.fileio import read_file, user_cache_dir, write_text_atomic

log = logging.getLogger(__name__)

CHECK_VERSION = 2  # bumped when the comparison changes: older verdicts are then checked again
CHECK_TIMEOUT_S = 120  # the child imports transformers and compares (3-5 s here): a hung one ends
RECORD_LIMIT = 1 << 20
# the config.json fields AutoTokenizer's choice of class rests on (auto_tokenizer passes these)
CONFIG_FIELDS = ("model_type", "tokenizer_class", "model_name", "auto_map")
ID_FIELDS = ("eos_token_id", "bos_token_id", "unk_token_id", "pad_token_id")


class Encoding(dict):
    """What `tokenizer(text)` returns, as transformers' BatchEncoding is read here: ["input_ids"] or .input_ids."""

    @property
    def input_ids(self) -> list[int]:
        return self["input_ids"]


class LightTokenizer:
    """The subset of a transformers tokenizer the engine, prompts, stops and healing use, over tokenizer.json:
    encode/decode and id lookups, and what healing and the FIM templates read (`backend_tokenizer`'s
    decoder, `added_tokens_decoder`, `all_special_ids`).

    Special ids come from the verdict record (transformers' values for these very files); decode applies
    transformers' space clean-up where the check found that it does."""

    def __init__(self, path: Path, ids: dict[str, Any], clean_up: bool, checked_against: str = ""):
        import tokenizers

        self._tok = tokenizers.Tokenizer.from_file(str(path))
        # encode_special_tokens is state on the Rust object: set and used under one lock
        self._lock = threading.Lock()
        self.name_or_path = str(path.parent)
        self.clean_up_tokenization_spaces = clean_up
        self.checked_against = checked_against  # the transformers class the check compared it with
        self.eos_token_id, self.bos_token_id, self.unk_token_id, self.pad_token_id = (ids.get(k) for k in ID_FIELDS)
        self.all_special_ids = list(ids.get("all_special_ids") or [])
        self.added_tokens_decoder = self._tok.get_added_tokens_decoder()  # {id: tokenizers.AddedToken}

    @property
    def backend_tokenizer(self):
        """The tokenizers.Tokenizer itself (healing reads its decoder's kinds), as transformers names it."""
        return self._tok

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        with self._lock:
            self._tok.encode_special_tokens = split_special_tokens
            try:
                return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
            finally:
                self._tok.encode_special_tokens = False

    def __call__(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> Encoding:
        return Encoding(input_ids=self.encode(text, add_special_tokens, split_special_tokens))

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self._tok.decode([ids] if isinstance(ids, int) else list(ids), skip_special_tokens=skip_special_tokens)
        return clean_up_spaces(text) if self.clean_up_tokenization_spaces else text

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._tok_id(tokens)
        return [self._tok_id(t) for t in tokens]

    def _tok_id(self, token: str) -> int | None:
        tid = self._tok.token_to_id(token)
        return self.unk_token_id if tid is None else tid

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(int(i)) for i in ids]


def clean_up_spaces(text: str) -> str:
    """The space clean-up transformers applies on decode when clean_up_tokenization_spaces is set."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


# ------------------------------------------------------------------ loading


def load_tokenizer(directory: Path, raw: dict, trust_remote_code: bool, light: bool = True):
    """The model's tokenizer: read by the tokenizers library alone where a check has shown that it then acts
    as AutoTokenizer's does (and light allows it), else AutoTokenizer's."""
    try:
        found = light_tokenizer(directory, raw, trust_remote_code) if light else None
        return found if found is not None else auto_tokenizer(directory, raw, trust_remote_code)
    except (OSError, ValueError):
        raise  # Engine.load reports these with the model's name
    except Exception as exc:
        # A malformed tokenizer file fails inside the tokenizers library or transformers with whatever they
        # raise (a RecursionError on JSON nested 5,000,000 deep, the Rust library's own Exception, a
        # KeyError or TypeError on a field of the wrong shape): one error that names the file's folder.
        raise ValueError(f"the tokenizer in {directory} cannot be read ({type(exc).__name__}: {exc})") from exc


def auto_tokenizer(directory: Path, raw: dict, trust_remote_code: bool):
    """AutoTokenizer's tokenizer for the model in directory (config.json read as raw), without loading
    the config class when AutoTokenizer would not need it: tokenizer_config.json names the tokenizer
    class and no remote code is involved. AutoTokenizer's choice then rests on the config's model_type,
    model_name, tokenizer_class and name (tests compare the result with a plain AutoTokenizer load)."""
    quiet_transformers()
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {}
    try:
        tok_cfg = read_json(directory / "tokenizer_config.json")
    except (OSError, ValueError):
        tok_cfg = None
    if (
        not trust_remote_code
        and isinstance(tok_cfg, dict)
        and isinstance(tok_cfg.get("tokenizer_class"), str)
        and "auto_map" not in tok_cfg
        and "auto_map" not in raw
        and isinstance(raw.get("model_type"), str)
    ):
        fields = {
            "model_type": raw["model_type"],
            "tokenizer_class": raw.get("tokenizer_class"),
            "_name_or_path": str(directory),
        }
        if "model_name" in raw:
            fields["model_name"] = raw["model_name"]
        kwargs["config"] = SimpleNamespace(**fields)
    return AutoTokenizer.from_pretrained(
        str(directory), trust_remote_code=trust_remote_code, local_files_only=True, **kwargs
    )


def quiet_transformers() -> None:
    """No progress bars or warnings from transformers on the user's terminal: called before each use of it
    (importing it is left to the paths that need it, for the resident memory it costs)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


# ------------------------------------------------------------------ the verdict cache


def cache_dir() -> Path:
    return user_cache_dir() / "completiond" / "tokenizers"


def verdict_key(directory: Path, raw: dict) -> str:
    """What AutoTokenizer's result depends on: the tokenizer files' bytes, the config fields it reads, and the
    versions of the code that runs them (and of this check)."""
    h = hashlib.sha256(f"completiond tokenizer check {CHECK_VERSION}\n".encode())
    for dist in ("transformers", "tokenizers"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        h.update(f"{dist} {version}\n".encode())
    h.update(json.dumps({k: raw.get(k) for k in CONFIG_FIELDS}, sort_keys=True, default=str).encode())
    for name in TOKENIZER_FILES:
        path = directory / name
        if path.is_file():
            data = read_file(path, SIDE_FILE_LIMITS.get(name, 1 << 20))
            h.update(f"\n{name} {len(data)} ".encode())
            h.update(hashlib.sha256(data).digest())
    return h.hexdigest()


def _record_path(key: str) -> Path:
    return cache_dir() / f"{key}.json"


def read_verdict(key: str) -> dict | None:
    """The stored verdict for key, or None when there is none or it cannot be trusted (then it is checked again)."""
    path = _record_path(key)
    try:
        data = json.loads(read_file(path, RECORD_LIMIT))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:
        log.warning("ignoring the tokenizer verdict %s: %s", path, exc)
        return None
    ok = (
        isinstance(data, dict)
        and data.get("key") == key
        and isinstance(data.get("same"), bool)
        and isinstance(data.get("clean_up_tokenization_spaces"), bool)
        and all(data.get(k) is None or (isinstance(data[k], int) and not isinstance(data[k], bool)) for k in ID_FIELDS)
        and isinstance(data.get("all_special_ids"), list)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in data["all_special_ids"])
    )
    if not ok:
        log.warning("ignoring the tokenizer verdict %s: not a record this version wrote", path)
        return None
    return data


def write_verdict(record: dict) -> Path:
    path = _record_path(record["key"])
    write_text_atomic(path, json.dumps(record, indent=1))  # two daemons checking the same files: one whole record
    return path


# ------------------------------------------------------------------ the decision


def eligible(directory: Path, raw: dict, trust_remote_code: bool) -> str | None:
    """None when the light tokenizer may be tried for this model, else why not."""
    if trust_remote_code:
        return "trust_remote_code asks for the model's own code"
    if not (directory / "tokenizer.json").is_file():
        return "no tokenizer.json"
    if "auto_map" in raw:
        return "config.json maps classes to the model's own code"
    try:
        tok_cfg = read_json(directory / "tokenizer_config.json")
    except FileNotFoundError:
        tok_cfg = {}
    except (OSError, ValueError) as exc:
        return f"tokenizer_config.json is unreadable ({exc})"
    if not isinstance(tok_cfg, dict) or "auto_map" in tok_cfg:
        return "tokenizer_config.json is not a plain object of settings"
    return None


def transformers_loaded() -> bool:
    return "transformers" in sys.modules


def describe(tok: Any) -> str:
    """Which library tokenizes, in words (status displays)."""
    if isinstance(tok, LightTokenizer):
        return f"tokenizers alone (tokenizer.json, checked to act as transformers' {tok.checked_against or 'class'})"
    return f"transformers ({type(tok).__name__})"


def light_tokenizer(directory: Path, raw: dict, trust_remote_code: bool) -> LightTokenizer | None:
    """The tokenizer without transformers when a check has shown it acts as AutoTokenizer's; None otherwise
    (the caller then loads AutoTokenizer). Runs the check in a child process the first time these files are seen.
    COMPLETIOND_TOKENIZER=transformers always takes AutoTokenizer's: a way out should a text outside the
    check's probe ever tokenize otherwise (report it: the probe then grows, and CHECK_VERSION with it)."""
    forced = os.environ.get("COMPLETIOND_TOKENIZER", "auto").strip().lower()
    if forced not in ("auto", "transformers", ""):
        log.warning("COMPLETIOND_TOKENIZER=%r is neither auto nor transformers; using auto", forced)
    if forced == "transformers" or transformers_loaded():
        return None
    why = eligible(directory, raw, trust_remote_code)
    if why is not None:
        log.debug("tokenizer through transformers: %s", why)
        return None
    try:
        key = verdict_key(directory, raw)
    except OSError as exc:
        log.warning("tokenizer through transformers: cannot read its files to key the check (%s)", exc)
        return None
    verdict = read_verdict(key)
    if verdict is None:
        verdict = _run_check(directory, key)
        if verdict is None:
            return None
    if not verdict["same"]:
        log.info(
            "tokenizer through transformers: it differs from tokenizer.json read alone (%s)",
            "; ".join(verdict.get("differences", [])[:2]),
        )
        return None
    try:
        return LightTokenizer(
            directory / "tokenizer.json",
            verdict,
            verdict["clean_up_tokenization_spaces"],
            str(verdict.get("tokenizer_class", "")),
        )
    except Exception as exc:  # tokenizers raises plain Exception for a file it cannot parse
        log.warning("tokenizer through transformers: tokenizers cannot read tokenizer.json (%s)", exc)
        return None


def _run_check(directory: Path, key: str) -> dict | None:
    log.info("checking once that %s's tokenizer reads the same without transformers", directory)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "completiond.engine.tokenizer_check", str(directory)],
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("tokenizer through transformers: the check did not finish (%s)", exc)
        return None
    if done.returncode != 0:
        log.warning(
            "tokenizer through transformers: the check failed (exit %d): %s",
            done.returncode,
            done.stderr.strip()[-600:],
        )
        return None
    # None when the child saw other files than this key was made of (they changed in between)
    return read_verdict(key)
