"""The generation engine: token ids in, token ids out.

Self-speculative decoding by early exit (LayerSkip): the draft is layers [0, E)
plus the final norm and the shared LM head. The draft writes the KV of layers
< E as it goes and keeps its exit-layer hidden states; the verifier runs layers
[0, E) only on the last draft token (which the draft never fed), then layers
[E, L) on all K+1 exit states at once. Everything after the accepted prefix is
dropped by moving the sequence's valid length back: the scratch slots are
rewritten before they are read again.

Sequence invariant: `seq` holds the KV of every committed token except the
last one, `pending`, which is the next model input.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from completiond.engine import sampling
from completiond.errors import EngineError  # defined below the engine (engine/native raises it too); importable from here
from completiond.engine.calibration import Calibration, load_calibration
from completiond.engine.cancel import CancelToken  # noqa: F401  (part of the engine API)
from completiond.engine import hub
from completiond.engine.draft import Draft, EarlyExitDraft, LookupDraft
from completiond.engine.draft_model import DraftModelDraft, tokenizer_mismatch
from completiond.engine import checkpoint
from completiond.engine.exit_adapter import AdapterDraft, ExitAdapter, adapter_paths, attach, find_and_attach
from completiond.engine import medusa as medusa_mod
from completiond.engine import native as native_mod
from completiond.engine import tokenizer as tokenizer_mod
from completiond.engine.forward import Forward, packs_bf16_checkpoint
from completiond.engine.kvcache import KVSequence, PrefixCache
from completiond.engine.lookup import OutputHistory
from completiond.engine.threads import ThreadGovernor
from completiond.engine.model_info import ModelInfo
from completiond.models.adapters import Adapter, UnsupportedModel, adapter_for

PREFILL_CHUNK = 256
# At most this many uncached prompt tokens go through the first decode step with the pending token
# (forward.SMALL_T positions still take the small-pass kernels).
MERGE_PREFILL = 7
# Files beside a model's weights that are trained on it (keyed to its identity), not part of it: one
# list for the identity here and for what engine/hub.py counts as weights.
DRAFT_FILES = hub.DRAFT_FILES

log = logging.getLogger(__name__)


# EngineError: a request or model the engine refuses (completiond/errors.py, so engine/native raises it too)


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    speculative: bool = True
    exit_layer: int | None = None  # None: calibrated
    draft_k: int | None = None  # None: calibrated; the most drafted per round
    draft_threshold: float | None = None  # None: calibrated
    prompt_lookup: bool | None = None  # n-gram drafts from the prompt and output; None: calibrated
    # "early_exit" | "adapter" (the trained exit adapter) | "draft_model" (a separate small model)
    # | "medusa" (Medusa heads and a token tree; greedy only, else the early-exit chain)
    # | "none" (no model draft: prompt lookup alone, a plain step where it finds nothing); None: calibrated
    draft: str | None = None
    adaptive_k: bool = True
    ignore_eos: bool = False  # benchmarks: always generate max_tokens


@dataclass
class Stats:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # rounds that stopped at a rejected draft token
    generated_tokens: int = 0
    exit_layer: int = 0
    draft: str = ""  # the model draft used: "early_exit", "adapter", "draft_model", "medusa", or "" (none)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    lookup_rounds: int = 0      # rounds whose draft came from prompt lookup
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    lookup_rejected: int = 0
    history_rounds: int = 0     # of the lookup rounds, those whose draft came from earlier requests' outputs
    history_accepted: int = 0

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability, the α of (1 - α^(K+1)) / (1 - α).

        Each drafted token after a rejection is never tested, so accepted/drafted would
        understate it; accepted / (accepted + rejections) is its estimate from the tests made.
        """
        tested = self.accepted + self.rejected
        return self.accepted / tested if tested else 0.0

    @property
    def mean_accepted_per_round(self) -> float:
        """Tokens committed per round (accepted drafts plus the target's own token)."""
        return self.generated_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.generated_tokens / self.decode_ms if self.decode_ms > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(alpha=self.alpha, mean_accepted_per_round=self.mean_accepted_per_round, tokens_per_s=self.tokens_per_s)
        return d


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str  # "length" | "eos" | "stop" | "cancelled"
    stats: Stats = field(default_factory=Stats)


StopFn = Callable[[list[int]], "int | None"]
ConstraintFn = Callable[[list[int]], "torch.Tensor | None"]


def pick_device(device: str = "auto") -> str:
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def default_cache_bytes(device: str) -> int:
    return (512 if device == "cpu" else 4096) << 20


def pick_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        if device == "cpu":
            return torch.float32
        if device.startswith("cuda") and not torch.cuda.is_bf16_supported():
            return torch.float16  # GPUs before Ampere emulate bfloat16 slowly
        return torch.bfloat16
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64}[dtype]
    except KeyError:
        raise EngineError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16") from None


def check_weights(path: Path) -> None:
    """Refuse a local model directory without safetensors weights."""
    if not path.is_dir():
        raise EngineError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise EngineError(f"{path} is not a transformers model directory: config.json is missing")
    if any(path.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt", ".pkl"})
    if pickles:
        raise EngineError(
            f"refusing to load {path}: it has only pickle weights ({', '.join(pickles)}), which can run "
            "arbitrary code when loaded. Convert them to safetensors first."
        )
    raise EngineError(f"no *.safetensors weights in {path}")


def model_identity(path: Path | str) -> str:
    """A stable id for calibration records: config plus the weight files' names, sizes and headers."""
    h = hashlib.sha256()
    p = Path(path)
    if p.is_dir():
        h.update((p / "config.json").read_bytes())
        # Draft artifacts trained on this model live beside it and are keyed to this identity.
        for w in sorted(q for q in p.glob("*.safetensors") if q.name not in DRAFT_FILES):
            h.update(w.name.encode())
            h.update(str(w.stat().st_size).encode())
            with w.open("rb") as f:
                h.update(f.read(65536))
    else:
        h.update(str(path).encode())
    return h.hexdigest()[:16]


class Engine:
    def __init__(self, model, tokenizer, model_id: str, device: str, cache_bytes: int | None = None,
                 calibration: Calibration | None = None, name: str = "", info: ModelInfo | None = None,
                 weights: str = "auto", compute_dtype: torch.dtype | None = None):
        self.model = model
        self.info = info or ModelInfo()
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.name = name or model_id
        self.load_warnings: list[str] = []  # what Engine.load told the user (memory), for status displays
        self.device = device
        self.adapter: Adapter = adapter_for(model)
        self.num_layers = self.adapter.num_layers
        # compute_dtype: float32 for a bf16 checkpoint loaded as bf16 only to be packed (Engine.load)
        self.dtype = compute_dtype or next(model.parameters()).dtype
        self.calibration = calibration or Calibration.heuristic(self.num_layers)
        cfg = model.config
        window = self.adapter.sliding_window or 1 << 30
        self.max_context = int(min(getattr(cfg, "max_position_embeddings", 4096), window))
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.eos_ids_tensor = torch.tensor(sorted(self.eos_token_ids), dtype=torch.int64)  # [n] for native drafts
        # Longest context the model was trained on, when it says (the bundled model's
        # completiond.json does); prompt builders budget against this, not max_context.
        self.train_context = min(self.max_context, self.info.train_context or self.max_context)
        if cache_bytes is None:
            cache_bytes = default_cache_bytes(device)
        self.cache = PrefixCache(cache_bytes, on_evict=self._on_evict)
        self.history = OutputHistory()  # what greedy requests generated, for later requests' lookup drafts
        # CPU: no more threads per request than the cores other runnable tasks leave (engine/threads.py)
        self.threads = ThreadGovernor() if torch.device(device).type == "cpu" else None
        self.weights = weights  # the weights setting: auto, bf16 or int8 (native.WEIGHT_FORMATS)
        self.fwd = Forward(self.adapter, cfg, device, self.dtype, self.max_context, weights=weights)
        # On an accelerator every read of a device value stalls the host until the queue drains, and a
        # host int fed back costs a copy the other way: there the early-exit draft and the accept test keep
        # token ids on the device and a round reads once, what it commits (tests switch this on for the CPU).
        self.resident_ids = torch.device(device).type != "cpu"
        self._pending_dev: tuple[int, torch.Tensor] | None = None  # the last committed token, kept on the device
        self.exit_adapter: ExitAdapter | None = None
        self.draft_model: "Engine | None" = None  # a separate draft model (attach_draft_model)
        self.medusa: medusa_mod.Medusa | None = None  # Medusa heads (attach_medusa)
        self.model_dir: Path | None = None  # the local directory it loaded from (Engine.load sets it)
        self.vocab_size = self.fwd.head_w.shape[0]  # (the module's own copy may have been dropped after packing)
        self.set_draft_vocab(self.calibration.draft_vocab)

    # ---------------------------------------------------------------- loading
    @classmethod
    def load(cls, model: str | os.PathLike | None = None, device: str = "auto", dtype: str = "auto",
             trust_remote_code: bool = False, cache_bytes: int | None = None, threads: int | None = None,
             progress: Callable[[str], None] | None = None,
             download_progress: Callable[[int, int], None] | None = None,
             warn: Callable[[str], None] | None = None, draft_model: str | os.PathLike | None = None,
             weights: str = "auto", reader: str = "auto") -> "Engine":
        """progress, if given, is called with each phase as it starts: tokenizer, weights, device, engine.

        A hub id or short name is fetched into the Hugging Face cache first (engine/hub.py: safetensors and
        tokenizer only, the cache first, failing fast offline), reporting bytes to download_progress(done,
        total); the model is then loaded from that directory, never from the network. warn(message) is told,
        before the weights load, when the model will probably not fit the device's memory.

        weights: the native CPU step's weight format (native.WEIGHT_FORMATS): auto keeps the model's values
        (bf16 panels for bf16 values), bf16 rounds them to bf16, int8 quantises them per output channel.

        reader: "auto" reads a large bf16 checkpoint bound for the native CPU step with engine/checkpoint.py
        (no transformers model code: less resident memory) where it can; "transformers" always uses
        AutoModelForCausalLM (the training commands, which need its modules)."""
        if weights not in native_mod.WEIGHT_FORMATS:
            raise EngineError(f"unknown weights format {weights!r}; use {', '.join(native_mod.WEIGHT_FORMATS)}")
        if reader not in ("auto", "transformers"):
            raise EngineError(f"unknown reader {reader!r}; use auto or transformers")
        from completiond.engine import memory

        bundled = not model
        if not model:
            from completiond.models import default_model_dir

            model = default_model_dir()
        device = pick_device(device)
        threads = threads or int(os.environ.get("COMPLETIOND_THREADS", "0") or 0)
        if device == "cpu" and threads > 0:
            # Batch-1 decode is a stream of small ops: on a busy machine, fewer threads beat
            # threads that wait for each other.
            torch.set_num_threads(threads)
        torch_dtype = pick_dtype(dtype, device)
        local = Path(model).expanduser()
        if hub.is_local(model):  # a path written as one; a hub id or short name never means a folder here
            check_weights(local)
            name = (f"{local.name} (bundled)" if bundled else hub.name_for_path(local) or str(local.resolve()))
        else:
            try:
                pulled = hub.pull(str(model), trust_remote_code=trust_remote_code, progress=download_progress)
            except hub.HubError as exc:
                raise EngineError(f"cannot load model {model!r}: {exc}") from None
            local, name = pulled.path, pulled.name
            check_weights(local)
        # Before anything is allocated or read by a library: side files are regular files under a cap,
        # config.json's sizes within bounds, and the model it describes fits the memory there is.
        try:
            config = hub.read_json(local / "config.json")
        except (OSError, ValueError) as exc:
            raise EngineError(f"cannot load model {name}: config.json is unreadable: {exc}") from None
        raw = config if isinstance(config, dict) else {}
        try:
            hub.check_side_files(local)
            hub.check_config(name, raw, trust_remote_code)
        except hub.HubError as exc:
            raise EngineError(f"cannot use model {name}: {exc}") from None
        refusal = memory.config_fit_error(name, config, local, torch.tensor([], dtype=torch_dtype).element_size(),
                                          str(torch_dtype).removeprefix("torch."), device)
        if refusal:
            raise EngineError(refusal)
        budget = cache_bytes if cache_bytes is not None else default_cache_bytes(device)
        warning = memory.fit_warning(name, local, torch.tensor([], dtype=torch_dtype).element_size(),
                                     str(torch_dtype).removeprefix("torch."), device, budget)
        if warning:
            log.warning("%s", warning)
            if warn is not None:
                warn(warning)
        # A large bf16 checkpoint on the CPU with the native step: read as bf16 and packed layer by layer
        # (forward.packs_bf16_checkpoint), never widened to float32 as a whole; computed in float32.
        compute_dtype = None
        if dtype == "auto" and device == "cpu" and raw and packs_bf16_checkpoint(raw, local):
            torch_dtype, compute_dtype = torch.bfloat16, torch.float32
        source = str(local)
        model_id = model_identity(local)
        # why transformers' model classes load this model rather than engine/checkpoint.py (None: they do not)
        why_transformers = ("asked for" if reader != "auto" else "not packed from bf16" if compute_dtype is None
                            else checkpoint.eligible(raw, local, trust_remote_code))
        if why_transformers is None and any(p.exists() for p in adapter_paths(local, model_id)):
            why_transformers = "an exit adapter is built from transformers' layer classes"
        try:
            if progress is not None:
                progress("tokenizer")
            # the tokenizer without transformers only where the model loads without it: else nothing is saved
            tok = tokenizer_mod.load_tokenizer(local, raw, trust_remote_code, light=why_transformers is None)
            if progress is not None:
                progress("weights")
            if why_transformers is None:
                hf = checkpoint.read(local, torch_dtype, raw)
            else:
                tokenizer_mod.quiet_transformers()
                from transformers import AutoModelForCausalLM

                hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, use_safetensors=True,
                                                          trust_remote_code=trust_remote_code, local_files_only=True)
        except OSError as exc:
            raise EngineError(f"cannot load model {name} from {source}: {exc}") from exc
        except checkpoint.config_errors() as exc:
            raise EngineError(f"cannot load model {name}: {exc}") from exc
        if progress is not None:
            progress("device")
        hf.to(device).eval()
        info = ModelInfo.read(local)
        if progress is not None:
            progress("engine")
        try:
            engine = cls(hf, tok, model_id, device, cache_bytes=cache_bytes,
                         calibration=load_calibration(model_id, info, hf.config.num_hidden_layers),
                         name=name, info=info, weights=weights, compute_dtype=compute_dtype)
        except UnsupportedModel as exc:
            raise EngineError(f"cannot use model {name}: {exc}") from exc
        engine.load_warnings = [warning] if warning else []
        engine.model_dir = local
        engine.exit_adapter = find_and_attach(engine, local)
        engine.medusa = medusa_mod.find_and_attach(engine, local)
        if draft_model:
            if progress is not None:
                progress("draft model")
            drafter = cls.load(draft_model, device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                               cache_bytes=0, threads=threads, download_progress=download_progress, warn=warn,
                               weights=weights)
            engine.attach_draft_model(drafter)
        return engine

    def attach_medusa(self, path: str | os.PathLike) -> medusa_mod.Medusa:
        """Use the Medusa heads at path (raises models.medusa.MedusaFileError if they do not fit)."""
        self.medusa = medusa_mod.attach(self, Path(path))
        return self.medusa

    def attach_draft_model(self, drafter: "Engine") -> None:
        """Draft with a separate model of the same tokenizer (refused with EngineError otherwise)."""
        why = tokenizer_mismatch(self.tokenizer, drafter.tokenizer)
        if why is not None:
            raise EngineError(f"draft model {drafter.name} cannot draft for {self.name}: its tokenizer differs ({why}); "
                              "a draft model must share the target's vocabulary")
        if drafter.device != self.device:
            raise EngineError(f"draft model {drafter.name} is on {drafter.device}, the model on {self.device}")
        self.draft_model = drafter
        self.cache.clear()  # cached sequences carry no draft-model K/V yet; they would only be re-fed

    def attach_adapter(self, path: str | os.PathLike) -> ExitAdapter:
        """Use the exit adapter at path (raises models.exit_adapter.AdapterFileError if it does not fit)."""
        self.exit_adapter = attach(self, Path(path))
        self.cache.clear()  # cached sequences have no K/V slot for it
        return self.exit_adapter

    def set_draft_vocab(self, ids: Sequence[int]) -> None:
        """Restrict the draft's LM head to these ids (most frequent first); empty: the full vocabulary.

        The LM head is a large share of a shallow draft's cost (8k x 192 weights against
        ~0.4M per layer in the bundled model). Proposing only frequent tokens keeps the
        output exact: q is simply zero elsewhere, and the verifier still scores everything.
        """
        ids = sorted({int(t) for t in ids if 0 <= int(t) < self.vocab_size})
        if not ids or len(ids) >= self.vocab_size:
            self.draft_ids = None
            self.draft_head_weight = self.draft_head_t = None
            return
        self.draft_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [Vd]
        self.draft_head_weight = self.fwd.head_w[self.draft_ids].clone()  # [Vd, d]
        self.draft_head_t = self.draft_head_weight.t().contiguous() if self.fwd.transposed else None  # [d, Vd]

    def draft_head(self, h: torch.Tensor) -> torch.Tensor:
        """Draft logits [Vd] for the last position of h [1, t, d], over draft_ids (or everything)."""
        if self.draft_head_weight is None:
            return self.head(h[:, -1:])[-1]
        return self.fwd.head_rows(h[:, -1:], self.draft_head_weight, self.draft_head_t)[-1]

    def _on_evict(self, seq: KVSequence) -> None:
        # Dropping the tensors returns their blocks to torch's caching allocator, where the next
        # sequence reuses them; handing them back to the driver (empty_cache) on every eviction
        # would only make the next allocation slow. The service empties the cache after an OOM.
        del seq.k, seq.v
        seq.companion = None

    # ---------------------------------------------------------------- forward
    def run_layers(self, h: torch.Tensor, first: int, last: int, pos: int, seq: KVSequence,
                   tree: "tuple[torch.Tensor, torch.Tensor] | None" = None) -> torch.Tensor:
        """Layers [first, last) on hidden states h [1, t, d] at positions [pos, pos+t).

        Writes those positions' K/V into seq for these layers and attends over [0, pos+t)
        (a token tree: see Forward.layers_range).
        """
        return self.fwd.layers_range(h, first, last, pos, seq, tree=tree)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: [1, t, d] -> logits [t, V] float32."""
        return self.fwd.head(h)

    def embed(self, tokens: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, t]
        return self.fwd.embed(ids)  # [1, t, d]

    def pending_on_device(self, token: int) -> torch.Tensor:
        """token as a [1] device tensor: the one the last round left on the device when it is that token
        (no host-to-device copy), else a fresh one."""
        kept = self._pending_dev
        if kept is not None and kept[0] == token:
            return kept[1]
        return torch.tensor([token], dtype=torch.long, device=self.device)

    def new_sequence(self, capacity: int) -> KVSequence:
        a = self.adapter
        slots = len(self.fwd.layers)  # the model's layers, and an exit adapter's when one is attached
        return KVSequence(slots, a.num_kv_heads, a.head_dim, self.dtype, self.device, capacity)

    def prefill(self, seq: KVSequence, tokens: Sequence[int], cancel: CancelToken | None,
                draft: Draft | None = None) -> bool:
        """Feed tokens through every layer in chunks; False if cancelled between chunks.

        A draft with a tap layer is shown each chunk's states there (the layer range split in two
        calls: the same arithmetic)."""
        tap = getattr(draft, "tap_layer", None)
        for i in range(0, len(tokens), PREFILL_CHUNK):
            if cancel is not None and cancel.cancelled:
                return False
            chunk = list(tokens[i : i + PREFILL_CHUNK])
            pos = seq.length
            if tap is None:
                self.run_layers(self.embed(chunk), 0, self.num_layers, pos, seq)
                seq.commit(chunk)
            else:
                h_tap = self.run_layers(self.embed(chunk), 0, tap, pos, seq)
                self.run_layers(h_tap, tap, self.num_layers, pos, seq)
                seq.commit(chunk)
                draft.observe(seq, pos, h_tap, eager=True)
        return True

    @torch.inference_mode()
    def logits_for(self, prompt: Sequence[int], use_cache: bool = True) -> torch.Tensor:
        """Next-token logits [V] after prompt (test and calibration helper)."""
        prompt = list(prompt)
        if use_cache:
            seq, reused = self.cache.acquire(prompt, self.new_sequence)
        else:
            seq, reused = self.new_sequence(len(prompt)), 0
        try:
            seq.ensure_capacity(len(prompt) + 1)
            self.prefill(seq, prompt[reused:-1], None)
            h = self.run_layers(self.embed(prompt[-1:]), 0, self.num_layers, seq.length, seq)
            seq.commit(prompt[-1:])
            return self.head(h)[-1]
        finally:
            if use_cache:
                self.cache.release(seq)

    # ---------------------------------------------------------------- decoding
    def plain_step(self, seq: KVSequence, pending: int, gen_tokens: list[int], warp: sampling.Warp,
                   rng: torch.Generator, constraint: ConstraintFn | None, before: Sequence[int] = (),
                   draft: Draft | None = None) -> int:
        """One token after pending; `before`: prompt tokens still to feed ahead of it, in the same pass
        (a draft with a tap layer is shown their states there, as prefill does)."""
        ids, pos = list(before) + [pending], seq.length
        native = self.fwd.native
        if native is not None and warp.greedy and constraint is None and not before and seq.k.is_contiguous():
            # Embed, layers, head and argmax in one native call (the greedy draft's, run through every
            # layer): the same computation as below, without the ~0.2 ms of Python and tensor glue a
            # step otherwise spends around a ~1 ms pass.
            (token,), _ = native.draft_greedy(pending, self.num_layers, pos, 1, 0.0, seq, self.fwd.head_w,
                                              self.fwd.head_b, None, self.eos_ids_tensor)
            seq.commit(ids)
            return token
        tap = getattr(draft, "tap_layer", None) if before else None
        if tap is None:
            x = self.fwd.embed(self.pending_on_device(pending).view(1, 1)) if self.resident_ids and not before \
                else self.embed(ids)  # [1, t, d]
            h = self.run_layers(x, 0, self.num_layers, pos, seq)
            seq.commit(ids)
        else:
            h_tap = self.run_layers(self.embed(ids), 0, tap, pos, seq)
            h = self.run_layers(h_tap, tap, self.num_layers, pos, seq)
            seq.commit(ids)
            draft.observe(seq, pos, h_tap)
        logits = sampling.mask_logits(self.head(h[:, -1:])[-1], _mask(constraint, gen_tokens))
        if warp.greedy:
            nxt = torch.argmax(logits).view(1)  # [1]
        else:
            nxt = torch.multinomial(sampling.probs(logits[None], warp)[0], 1, generator=rng)  # [1]
        token = int(nxt)  # the step's one read
        if self.resident_ids:
            self._pending_dev = (token, nxt)
        return token

    def speculative_round(self, seq: KVSequence, pending: int, gen_tokens: list[int], draft: Draft, k_max: int,
                          threshold: float, warp: sampling.Warp, rng: torch.Generator,
                          constraint: ConstraintFn | None, stats: Stats, cancel: CancelToken | None = None,
                          limit: int | None = None) -> list[int] | None:
        """One draft + verify + accept round. Returns the tokens it commits (accepted drafts + one more),
        or None when cancelled between draft and verify (the draft's scratch KV is simply not committed)."""
        t0 = time.perf_counter()
        proposal = draft.propose(seq, pending, gen_tokens, k_max, threshold, warp, rng, constraint, limit)
        if cancel is not None and cancel.cancelled:
            return None
        t1 = time.perf_counter()
        k = len(proposal.tokens)
        exit_states = proposal.exit_states  # [1, k+1, d]: pending and each draft token at layer E
        tap = draft.tap_layer
        native = self.fwd.native
        if exit_states is None and k == 0 and warp.greedy:
            # Nothing drafted and nothing computed (prompt lookup alone found no match): a plain step,
            # which takes the native path where it can.
            nxt = self.plain_step(seq, pending, gen_tokens, warp, rng, constraint)
            stats.rounds += 1
            stats.draft_ms += 1000 * (t1 - t0)
            stats.verify_ms += 1000 * (time.perf_counter() - t1)
            return [nxt]
        if (exit_states is None and native is not None and warp.greedy and constraint is None and tap is None
                and k + 1 <= native_mod.MAX_ROWS and seq.k.is_contiguous() and not self.resident_ids):
            # A lookup proposal, greedy: embed, every layer, head and argmax in one native call (the plain
            # step's own arithmetic per row), without the Python and tensors between them.
            target = native.verify_greedy([pending] + proposal.tokens, self.num_layers, seq.length, seq,
                                          self.fwd.head_w, self.fwd.head_b)
            m, nxt = sampling.accept_greedy(proposal.tokens, target)
            seq.commit([pending] + proposal.tokens[:m])
            return self._count_round(proposal, m, nxt, stats, t0, t1)
        if exit_states is None:
            # the proposal enters at layer 0: pending and the drafts as embeddings (sampling with no match:
            # the bare pending token)
            exit_states = self.embed([pending] + proposal.tokens)  # [1, k+1, d]
        if exit_states.shape[1] < k + 1:
            # The last draft token was never fed to the draft: its layers < E run here, once.
            x_last = (self.fwd.embed(proposal.token_ids[-1:].view(1, 1)) if proposal.token_ids is not None
                      else self.embed(proposal.tokens[-1:]))  # [1, 1, d]
            h_last = self.run_layers(x_last, 0, proposal.exit_layer, seq.length + k, seq)
            exit_states = torch.cat([exit_states, h_last], dim=1)  # [1, k+1, d]
        if tap is not None and proposal.exit_layer < tap:
            # The draft wants these positions' states at its tap layer: stop there on the way up.
            exit_states = self.run_layers(exit_states, proposal.exit_layer, tap, seq.length, seq)
            h = self.run_layers(exit_states, tap, self.num_layers, seq.length, seq)
        else:
            h = self.run_layers(exit_states, proposal.exit_layer, self.num_layers, seq.length, seq)
        logits = self.head(h)  # [k+1, V]
        masks = proposal.masks + [_mask(constraint, gen_tokens + proposal.tokens)]
        if any(m is not None for m in masks):
            logits = torch.stack([sampling.mask_logits(logits[i], masks[i]) for i in range(k + 1)])
        if warp.greedy:
            target = torch.argmax(logits, dim=-1)  # [k+1]
            m, nxt = sampling.accept_greedy(proposal.tokens, target.tolist())  # the round's one read
            if self.resident_ids:
                self._pending_dev = (nxt, target[m:m + 1])
        elif self.resident_ids:
            drafted = (proposal.token_ids if proposal.token_ids is not None
                       else torch.tensor(proposal.tokens, dtype=torch.long, device=self.device))  # [k]
            out = sampling.accept_sampled_resident(drafted, proposal.probs, sampling.probs(logits, warp), rng)  # [2]
            m, nxt = out.tolist()  # the round's one read
            self._pending_dev = (nxt, out[1:])
        else:
            m, nxt = sampling.accept_sampled(proposal.tokens, proposal.probs, sampling.probs(logits, warp), rng)
        p0 = seq.length
        seq.commit([pending] + proposal.tokens[:m])
        if tap is not None and proposal.exit_layer <= tap:
            draft.observe(seq, p0, exit_states[:, :m + 1])
        return self._count_round(proposal, m, nxt, stats, t0, t1)

    @staticmethod
    def _count_round(proposal, m: int, nxt: int, stats: Stats, t0: float, t1: float) -> list[int]:
        """A verified round's stats (drafted from t0, verified from t1 until now); returns the tokens it
        adds: the m accepted drafts and the verifier's own next one."""
        k = len(proposal.tokens)
        t2 = time.perf_counter()
        stats.rounds += 1
        stats.drafted += k
        stats.accepted += m
        stats.rejected += int(m < k)
        if proposal.kind == "lookup":
            stats.lookup_rounds += 1
            stats.lookup_drafted += k
            stats.lookup_accepted += m
            stats.lookup_rejected += int(m < k)
            if proposal.from_history:
                stats.history_rounds += 1
                stats.history_accepted += m
        stats.draft_ms += 1000 * (t1 - t0)
        stats.verify_ms += 1000 * (t2 - t1)
        return proposal.tokens[:m] + [nxt]

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                 cancel: CancelToken | None = None, on_round: Callable[[list[int]], None] | None = None,
                 stop: StopFn | None = None, constraint: ConstraintFn | None = None,
                 history: OutputHistory | None | bool = True) -> Generation:
        """`history`: the output history this request drafts from and adds its output to; True, the
        engine's own (earlier requests' outputs); None or False, none. Read by greedy requests only."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        self._validate(prompt, params)
        if self.threads is not None:
            self.threads.pick()
        stats = Stats(prompt_tokens=len(prompt))
        warp = sampling.Warp(params.temperature, params.top_k, params.top_p)
        if history is True:
            history = self.history
        elif history is False:
            history = None
        # Sampled requests neither read it (see OutputHistory) nor add to it (their text is a draw,
        # not what a greedy request would repeat).
        history = history if warp.greedy else None
        # On the logits' device: torch.multinomial refuses a generator of another device.
        rng = torch.Generator(device=self.device).manual_seed(int(params.seed))
        spec, exit_layer, k_max, threshold, lookup, kind = self._speculation(params)
        stats.exit_layer = exit_layer if spec else self.num_layers
        draft: Draft | None = None
        tree: medusa_mod.TreeDecoder | None = None
        if spec and kind == "medusa" and (not warp.greedy or constraint is not None):
            kind = "early_exit"  # the tree walk is exact for greedy decoding only: the chain is exact always
        if spec:
            if kind == "medusa":
                tree = medusa_mod.TreeDecoder(self, self.medusa, lookup, history=history)
                lookup = False  # its proposal is a branch of the tree
            elif kind == "adapter":
                draft = AdapterDraft(self, self.exit_adapter)
            elif kind == "draft_model":
                draft = DraftModelDraft(self, self.draft_model)
                stats.exit_layer = 0
            else:
                draft = EarlyExitDraft(self, exit_layer)
            stats.draft = kind
        room = k_max if tree is None else tree.max_nodes  # most tokens a round may write ahead of the committed ones
        if lookup:
            # In front of a model draft, lookup proposes up to LOOKUP_K (K belongs to the model draft); alone,
            # K is its own (calibrated: a verify pass over more positions costs more here)
            draft = (LookupDraft(self, draft, history=history) if draft is not None
                     else LookupDraft(self, None, k=k_max, history=history))
            room = max(k_max, draft.k)

        t0 = time.perf_counter()
        seq, reused = self.cache.acquire(prompt, self.new_sequence)
        stats.reused_tokens = reused
        out: list[int] = []
        finish = "length"
        try:
            seq.ensure_capacity(len(prompt) + params.max_tokens + room + 2)
            rest = prompt[reused:-1]
            # A keystroke leaves a few new tokens before the cursor: fed with the pending token in the
            # first step, they cost about one pass instead of two (a prefill, then the step).
            ahead = rest if tree is None and 0 < len(rest) <= MERGE_PREFILL else []
            if not ahead and not self.prefill(seq, rest, cancel, draft):
                finish = "cancelled"
            t1 = time.perf_counter()
            stats.prefill_ms = 1000 * (t1 - t0)
            pending = prompt[-1]
            # Acceptance estimate for choosing K: starts at the calibrated value and follows this
            # request only, so that a seeded request is reproducible whatever ran before it.
            # The calibrated figures describe the calibrated exit layer only.
            cal = self.calibration
            measured = cal.measured if exit_layer == cal.exit_layer and kind == cal.draft else {}
            alpha0 = measured.get("alpha", 0.7)
            cost = measured.get("draft_cost", exit_layer / self.num_layers)
            while finish == "length" and len(out) < params.max_tokens:
                if cancel is not None and cancel.cancelled:
                    finish = "cancelled"
                    break
                remaining = params.max_tokens - len(out) - 1
                if draft is not None:
                    # 8 pseudo-tests of the calibrated α, then this request's own early-exit tests
                    accepted = stats.accepted - stats.lookup_accepted
                    rejected = stats.rejected - stats.lookup_rejected
                    alpha = (8 * alpha0 + accepted) / (8 + accepted + rejected)
                    k = choose_k(alpha, cost, k_max) if params.adaptive_k else k_max
                    k = min(k, remaining)
                if ahead:
                    new = [self.plain_step(seq, pending, out, warp, rng, constraint, before=ahead, draft=draft)]
                    stats.rounds += 1
                    ahead = []
                elif tree is not None and remaining > 0:
                    new = tree.step(seq, pending, remaining, stats)
                elif draft is not None and remaining > 0:
                    new = self.speculative_round(seq, pending, out, draft, k, threshold, warp, rng, constraint,
                                                 stats, cancel, limit=remaining)
                    if new is None:
                        finish = "cancelled"
                        break
                else:
                    new = [self.plain_step(seq, pending, out, warp, rng, constraint)]
                    stats.rounds += 1
                pending = new[-1]
                for tok in new:
                    if tok in self.eos_token_ids and not params.ignore_eos:
                        finish = "eos"
                        break
                    out.append(tok)
                    if len(out) >= params.max_tokens:
                        break
                if stop is not None:
                    keep = stop(out)
                    if keep is not None:
                        del out[keep:]
                        finish = "stop"
                if on_round is not None:
                    on_round(list(out))
            stats.decode_ms = 1000 * (time.perf_counter() - t1)
        finally:
            self.cache.release(seq)
        stats.generated_tokens = len(out)
        if history is not None:
            history.add(prompt, out)
        return Generation(out, finish, stats)

    def decode_step_in_use(self) -> str:
        """Which forward pass decode steps take, in words (status displays)."""
        native = self.fwd.native
        if native is not None:
            weights = f"{native.weights()} weights"
            if native.act_levels and "int8" in weights:  # w8a8: the activations' precision is the kernel's
                weights += f", {native.act_levels.bit_length() + 1}-bit activations"
            return f"native (engine/native/step.c, {native.kernel} kernels, {torch.get_num_threads()} threads, {weights})"
        return f"PyTorch ({self.fwd.native_reason})"

    def tokenizer_in_use(self) -> str:
        """Which library tokenizes, in words (status displays)."""
        return tokenizer_mod.describe(self.tokenizer)

    def weights_in_use(self) -> str:
        """The weight format decode steps read: "bf16", "int8", "float32" (native panels), or the PyTorch
        path's dtype ("PyTorch float32") where the native step does not run."""
        if self.fwd.native is not None:
            return self.fwd.native.weights()
        return f"PyTorch {str(self.dtype).removeprefix('torch.')}"

    def draft_in_use(self) -> str:
        """How requests with default settings draft, in words (status displays)."""
        cal = self.calibration
        kind = cal.draft
        if (kind == "adapter" and self.exit_adapter is None or kind == "draft_model" and self.draft_model is None
                or kind == "medusa" and self.medusa is None):
            kind = "early_exit"
        if not cal.speculative:
            if cal.prompt_lookup:
                return "prompt lookup alone (a plain step where it finds nothing)"
            return "none (speculation does not pay for this model here)"
        if kind == "adapter":
            text = f"exit adapter at layer {self.exit_adapter.exit_layer}, K<={cal.draft_k}"
        elif kind == "draft_model":
            text = f"draft model {self.draft_model.name}, K<={cal.draft_k}"
        elif kind == "medusa":
            text = f"{self.medusa.num_heads} Medusa heads, a {len(self.medusa.tree) + 1}-node tree (greedy; else early exit)"
        else:
            text = f"early exit at layer {cal.exit_layer} of {self.num_layers}, K<={cal.draft_k}"
        return ("prompt lookup, else " if cal.prompt_lookup else "") + text

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise EngineError("empty prompt")
        if params.max_tokens < 1:
            raise EngineError(f"max_tokens must be at least 1, got {params.max_tokens}")
        if len(prompt) + params.max_tokens > self.max_context:
            raise EngineError(f"prompt of {len(prompt)} tokens plus {params.max_tokens} new tokens exceeds the "
                              f"model's context of {self.max_context} tokens")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise EngineError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size})")
        if not (params.temperature >= 0 and 0 < params.top_p <= 1 and params.top_k >= 0):
            raise EngineError(f"invalid sampling parameters: temperature={params.temperature}, "
                              f"top_p={params.top_p}, top_k={params.top_k}")

    def _speculation(self, params: SamplingParams) -> tuple[bool, int, int, float, bool, str]:
        cal = self.calibration
        if params.draft == "none":  # no model draft: prompt lookup alone, when it is asked for or calibrated
            lookup = params.speculative and (cal.prompt_lookup if params.prompt_lookup is None else params.prompt_lookup)
            return False, cal.exit_layer, max(1, params.draft_k or cal.draft_k), 0.0, lookup, cal.draft
        spec = params.speculative and (cal.speculative or params.exit_layer is not None or params.draft is not None)
        kind = params.draft or cal.draft
        exit_layer = params.exit_layer or cal.exit_layer
        if kind not in ("early_exit", "adapter", "draft_model", "medusa"):
            raise EngineError(f"unknown draft {kind!r}; use early_exit, adapter, draft_model, medusa or none")
        if kind == "medusa" and self.medusa is None:
            if params.draft == "medusa":
                raise EngineError("no Medusa heads are attached to this model; train them with `completiond train-medusa`")
            kind = "early_exit"
        if kind == "draft_model" and self.draft_model is None:
            if params.draft == "draft_model":
                raise EngineError("no draft model is attached to this model; set completiond.draftModel")
            kind = "early_exit"
        if kind == "adapter":
            if self.exit_adapter is None:
                if params.draft == "adapter":
                    raise EngineError("no exit adapter is attached to this model; train one with `completiond train-adapter`")
                kind = "early_exit"  # a calibration that chose an adapter since deleted: plain early exit
            elif params.exit_layer is not None and params.exit_layer != self.exit_adapter.exit_layer:
                kind = "early_exit"  # an explicit exit layer that is not the adapter's
            else:
                exit_layer = self.exit_adapter.exit_layer
        if not 1 <= exit_layer < self.num_layers:
            raise EngineError(f"exit layer must be in 1..{self.num_layers - 1} for this {self.num_layers}-layer model, "
                              f"got {exit_layer}")
        k_max = params.draft_k or cal.draft_k
        threshold = cal.threshold if params.draft_threshold is None else params.draft_threshold
        lookup = params.speculative and (cal.prompt_lookup if params.prompt_lookup is None else params.prompt_lookup)
        return spec, exit_layer, max(1, k_max), threshold, lookup, kind


def choose_k(alpha: float, cost: float, k_max: int) -> int:
    """The K that maximises expected tokens per unit of time.

    K drafts at acceptance α commit (1 - α^(K+1)) / (1 - α) tokens on average; a round
    costs K draft steps of `cost` (relative to one verify pass) plus the verify pass.
    """
    a = min(max(alpha, 0.0), 0.999)
    return max(range(1, k_max + 1), key=lambda k: (1 - a ** (k + 1)) / (1 - a) / (k * cost + 1))


def _mask(constraint: ConstraintFn | None, tokens: list[int]) -> torch.Tensor | None:
    return None if constraint is None else constraint(tokens)


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    # FIM-trained models end the middle with one of these.
    for name in ("<|endoftext|>", "<|fim_pad|>", "<EOT>", "▁<EOT>", "<｜end▁of▁sentence｜>", "<|file_sep|>", "<file_sep>"):
        tid = tokenizer.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return ids
