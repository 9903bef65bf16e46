"""The generation engine: token ids in, token ids out.

Self-speculative decoding by early exit (LayerSkip): the draft is layers [0, E)
plus the final norm and the shared LM head. The draft writes the KV of layers
< E as it goes and keeps its exit-layer hidden states; the verifier runs layers
[0, E) only on the last draft token (which the draft never fed), then layers
[E, L) on all K+1 exit states at once. Everything after the accepted prefix is
dropped by moving the sequence's valid length back: the scratch slots are
rewritten before they are read again.

The parts: load_plan.py decides how a model loads and loader.py reads it (Engine.load); speculators.py
plans how a request drafts and builds its round; decode.py runs the loop (prefill, draft, verify, accept).

Sequence invariant: `seq` holds the KV of every committed token except the
last one, `pending`, which is the next model input.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from completiond.engine import decode, load_plan, loader, sampling, speculators
from completiond.engine import medusa as medusa_mod
from completiond.engine import native as native_mod
from completiond.engine import tokenizer as tokenizer_mod
from completiond.engine.calibration import Calibration, load_calibration
from completiond.engine.cancel import CancelToken
from completiond.engine.draft import Draft
from completiond.engine.draft_model import tokenizer_mismatch
from completiond.engine.exit_adapter import ExitAdapter, attach, find_and_attach
from completiond.engine.forward import Forward
from completiond.engine.kvcache import KVSequence, PrefixCache
from completiond.engine.load_plan import (
    DRAFT_FILES,
    check_weights,
    default_cache_bytes,
    model_identity,
)
from completiond.engine.loader import pick_device, pick_dtype
from completiond.engine.lookup import OutputHistory
from completiond.engine import model_facts
from completiond.engine.model_facts import PREFILL_CHUNK, cpu_prefill, eos_ids, warm_slices
from completiond.engine.model_info import ModelInfo
from completiond.engine.params import (
    ConstraintFn,
    Generation,
    SamplingParams,
    Stats,
    StopFn,
)
from completiond.engine.threads import ThreadGovernor
from completiond.errors import (
    EngineError,  # defined below the engine (engine/native raises it too)
)
from completiond.models.adapters import Adapter, UnsupportedModel, adapter_for

# The engine's API is importable from here (docs/ENGINE_API.md), whichever module defines it.
__all__ = [
    "DRAFT_FILES",
    "CancelToken",
    "ConstraintFn",
    "Engine",
    "EngineError",
    "Generation",
    "SamplingParams",
    "Stats",
    "StopFn",
    "check_weights",
    "default_cache_bytes",
    "model_identity",
    "pick_device",
    "pick_dtype",
]

log = logging.getLogger(__name__)


# EngineError: a request or model the engine refuses (completiond/errors.py, so engine/native raises it too)


class Engine:
    def __init__(
        self,
        model,
        tokenizer,
        model_id: str,
        device: str,
        cache_bytes: int | None = None,
        calibration: Calibration | None = None,
        name: str = "",
        info: ModelInfo | None = None,
        weights: str = "auto",
        compute_dtype: torch.dtype | None = None,
    ):
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
        self.eos_token_ids = eos_ids(model, tokenizer)
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
        # The CPU's planning rate (None on accelerators, where prefill is cheap): prompt builders size the
        # suffix by it, and prefill chunks take about PREFILL_CHUNK_S at it. It comes from the model's size and
        # the path its prefill runs on (set below, once the Forward is built), never from a clock, so that load
        # on the machine cannot move a prompt's layout (engine/model_facts.py).
        self.prefill_tokens_per_s: float | None = None
        self.prefill_chunk = PREFILL_CHUNK
        self.weights = weights  # the weights setting: auto, bf16 or int8 (native.WEIGHT_FORMATS)
        self.fwd = Forward(self.adapter, cfg, device, self.dtype, self.max_context, weights=weights)
        # On an accelerator every read of a device value stalls the host until the queue drains, and a
        # host int fed back costs a copy the other way: there the early-exit draft and the accept test keep
        # token ids on the device and a round reads once, what it commits (tests switch this on for the CPU).
        self.resident_ids = torch.device(device).type != "cpu"
        self.pending_dev: tuple[int, torch.Tensor] | None = None  # the last committed token, kept on the device
        self.exit_adapter: ExitAdapter | None = None
        self.draft_model: Engine | None = None  # a separate draft model (attach_draft_model)
        self.medusa: medusa_mod.Medusa | None = None  # Medusa heads (attach_medusa)
        self.model_dir: Path | None = None  # the local directory it loaded from (Engine.load sets it)
        self.vocab_size = self.fwd.head_w.shape[0]  # (the module's own copy may have been dropped after packing)
        self.set_draft_vocab(self.calibration.draft_vocab)
        if self.threads is not None:
            native = self.fwd.native
            kernel = native.kernel if native is not None else None
            self.prefill_tokens_per_s, self.prefill_chunk = cpu_prefill(
                self.adapter, cfg, kernel, weights, self.threads.most
            )
            with torch.inference_mode():
                model_facts.warm_prefill(self)

    # ---------------------------------------------------------------- loading
    @classmethod
    def load(
        cls,
        model: str | os.PathLike | None = None,
        device: str = "auto",
        dtype: str = "auto",
        trust_remote_code: bool = False,
        cache_bytes: int | None = None,
        threads: int | None = None,
        progress: Callable[[str], None] | None = None,
        download_progress: Callable[[int, int], None] | None = None,
        warn: Callable[[str], None] | None = None,
        draft_model: str | os.PathLike | None = None,
        weights: str = "auto",
        reader: str = "auto",
    ) -> Engine:
        """Load a model directory, hub id or short name (fetched into the Hugging Face cache first, engine/hub.py).

        progress(phase) at each phase; download_progress(done, total) in bytes; warn(message) before weights that
        will probably not fit. weights: the native CPU step's format (native.WEIGHT_FORMATS). reader: "auto" reads
        checkpoints with engine/checkpoint.py where it can (its modules have no forward pass: `model` is then no
        transformers model), "transformers" always through AutoModelForCausalLM. load_plan.py decides, loader.py
        reads."""
        say = progress or (lambda phase: None)
        how = (trust_remote_code, cache_bytes, weights, reader, native_mod.WEIGHT_FORMATS, download_progress)
        plan = load_plan.plan(model, loader.machine(device, dtype, threads), dtype, *how)
        for warning in plan.warnings:
            log.warning("%s", warning)
            if warn is not None:
                warn(warning)
        hf, tok = loader.read(plan, trust_remote_code, say)
        info = ModelInfo.read(plan.path)
        # The model's own record may pick the CPU step's format for "auto" (the bundled model: int8, chosen on its
        # measured quality and prefill speed, docs/PERFORMANCE.md).
        fmt = info.cpu_weights if weights == "auto" and plan.device == "cpu" and info.cpu_weights else weights
        say("engine")
        try:
            engine = cls(
                hf,
                tok,
                plan.model_id,
                plan.device,
                cache_bytes=cache_bytes,
                calibration=load_calibration(plan.model_id, info, hf.config.num_hidden_layers),
                name=plan.name,
                info=info,
                weights=fmt,
                compute_dtype=loader.compute_dtype(plan),
            )
        except UnsupportedModel as exc:
            raise EngineError(f"cannot use model {plan.name}: {exc}") from exc
        engine.load_warnings = list(plan.warnings)
        engine.model_dir = plan.path
        engine.exit_adapter = find_and_attach(engine, plan.path)
        engine.medusa = medusa_mod.find_and_attach(engine, plan.path)
        if draft_model:
            say("draft model")
            same = (plan.device, dtype, trust_remote_code)  # the draft shares the device, dtype and weight format
            draft = cls.load(draft_model, *same, 0, threads, None, download_progress, warn, weights=weights)
            engine.attach_draft_model(draft)
        return engine

    def attach_medusa(self, path: str | os.PathLike) -> medusa_mod.Medusa:
        """Use the Medusa heads at path (raises models.medusa.MedusaFileError if they do not fit)."""
        self.medusa = medusa_mod.attach(self, Path(path))
        return self.medusa

    def attach_draft_model(self, drafter: Engine) -> None:
        """Draft with a separate model of the same tokenizer (refused with EngineError otherwise)."""
        why = tokenizer_mismatch(self.tokenizer, drafter.tokenizer)
        if why is not None:
            raise EngineError(
                f"draft model {drafter.name} cannot draft for {self.name}: its tokenizer differs ({why}); "
                "a draft model must share the target's vocabulary"
            )
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
    def run_layers(
        self,
        h: torch.Tensor,
        first: int,
        last: int,
        pos: int,
        seq: KVSequence,
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
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
        kept = self.pending_dev
        if kept is not None and kept[0] == token:
            return kept[1]
        return torch.tensor([token], dtype=torch.long, device=self.device)

    def new_sequence(self, capacity: int) -> KVSequence:
        a = self.adapter
        slots = len(self.fwd.layers)  # the model's layers, and an exit adapter's when one is attached
        return KVSequence(slots, a.num_kv_heads, a.head_dim, self.dtype, self.device, capacity)

    def prefill(
        self,
        seq: KVSequence,
        tokens: Sequence[int],
        cancel: CancelToken | None,
        draft: Draft | None = None,
        chunk_size: int = PREFILL_CHUNK,
        slices: int = 1,
    ) -> bool:
        """Feed tokens through every layer in chunks; False if cancelled between chunks.

        A draft with a tap layer is shown each chunk's states there (the layer range split in two
        calls: the same arithmetic). slices > 1 (a background warm-up) runs each chunk's layers in that many
        calls and looks at `cancel` between them too: a request that preempts the warm-up then waits for a
        slice of a chunk, not a whole one. A chunk cancelled part-way is not committed; the K/V its first
        layers wrote lie past the sequence's length, where the next prefill writes over them."""
        tap = None if draft is None else draft.tap_layer
        cuts = [self.num_layers * k // max(1, slices) for k in range(max(1, slices) + 1)]
        for i in range(0, len(tokens), chunk_size):
            if cancel is not None and cancel.cancelled:
                return False
            if i and self.threads is not None:
                # Between chunks the thread count follows the machine again: a task that was passing by when
                # the request came costs one chunk at most, and one that came since takes its core.
                self.threads.pick()
            chunk = list(tokens[i : i + chunk_size])
            pos = seq.length
            if draft is None or tap is None:
                h = self.embed(chunk)
                for first, last in zip(cuts, cuts[1:]):
                    if first and cancel is not None and cancel.cancelled:
                        return False
                    h = self.run_layers(h, first, last, pos, seq)
                seq.commit(chunk)
            else:
                h_tap = self.run_layers(self.embed(chunk), 0, tap, pos, seq)
                self.run_layers(h_tap, tap, self.num_layers, pos, seq)
                seq.commit(chunk)
                draft.observe(seq, pos, h_tap, eager=True)
        return True

    @torch.inference_mode()
    def warm(
        self, tokens: Sequence[int], cancel: CancelToken | None = None, limit: int | None = None
    ) -> tuple[int, int]:
        """Prefill `tokens` into the prefix cache ahead of a request that will start with them (a background
        warm-up): at most `limit` new tokens, in small chunks, stopping between them once `cancel` is set.
        What it finished stays cached for the request (the same KV a cold prefill computes: a token's KV depends
        only on the tokens before it). Returns (tokens prefilled now, tokens of `tokens` cached now)."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return 0, 0
        if max(tokens) >= self.vocab_size or min(tokens) < 0 or len(tokens) >= self.max_context:
            raise EngineError("warm-up tokens outside the vocabulary or longer than the model's context")
        if self.threads is not None:
            self.threads.pick()
        # acquire() keeps the last token for the logits a request needs: ask one past what is to be cached.
        # keep_tails: a cached request's prompt that shares only a head with these tokens is copied, not cut.
        seq, reused = self.cache.acquire(tokens + [0], self.new_sequence, keep_tails=True)
        background = True
        try:
            if reused >= len(tokens):
                background = seq.background  # a request's prompt stays one
                return 0, len(tokens)  # all cached already (perhaps inside a longer sequence, left whole)
            todo = tokens[reused:]
            if limit is not None:
                todo = todo[: max(0, limit)]
            seq.ensure_capacity(reused + len(todo) + 1)
            chunk = max(32, self.prefill_chunk // 4)
            slices = warm_slices(chunk, self.prefill_tokens_per_s, self.num_layers)
            self.prefill(seq, todo, cancel, chunk_size=chunk, slices=slices)
            return seq.length - reused, seq.length
        finally:
            self.cache.release(seq, background=background)

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
    def plain_step(
        self,
        seq: KVSequence,
        pending: int,
        gen_tokens: list[int],
        warp: sampling.Warp,
        rng: torch.Generator | None,
        constraint: ConstraintFn | None,
    ) -> int:
        """One token after pending (decode.plain_step; bench and tests time it alone)."""
        req = decode.Request(SamplingParams(), warp, rng or torch.Generator(), constraint, Stats())
        return decode.plain_step(self, seq, pending, gen_tokens, req)

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        cancel: CancelToken | None = None,
        on_round: Callable[[list[int]], None] | None = None,
        stop: StopFn | None = None,
        constraint: ConstraintFn | None = None,
        history: OutputHistory | None | bool = True,
    ) -> Generation:
        """`history`: the output history this request drafts from and adds its output to; True, the
        engine's own (earlier requests' outputs); None or False, none. Read by greedy requests only."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        self._validate(prompt, params)
        reduced = self.threads is not None and self.threads.pick() < self.threads.most
        warp = sampling.Warp(params.temperature, params.top_k, params.top_p)
        # Sampled requests neither read it (see OutputHistory) nor add to it (their text is a draw,
        # not what a greedy request would repeat).
        history = (self.history if history is True else None if history is False else history) if warp.greedy else None
        plan = speculators.plan(self, params, warp.greedy, constraint is not None)
        stats = Stats(prompt_tokens=len(prompt), threads_reduced=reduced)
        stats.exit_layer, stats.draft = speculators.stats_fields(self, plan)
        # On the logits' device: torch.multinomial refuses a generator of another device.
        rng = torch.Generator(device=self.device).manual_seed(int(params.seed))
        req = decode.Request(params, warp, rng, constraint, stats, cancel)
        rounds = speculators.build(self, plan, history)
        seq, stats.reused_tokens = self.cache.acquire(prompt, self.new_sequence)
        try:
            seq.ensure_capacity(len(prompt) + params.max_tokens + rounds.room + 2)
            out, finish = decode.decode(self, seq, prompt, stats.reused_tokens, rounds, req, stop, on_round)
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
            return (
                f"native (engine/native/step.c, {native.kernel} kernels, {torch.get_num_threads()} threads, {weights})"
            )
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
        return speculators.describe(self)

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise EngineError("empty prompt")
        if params.max_tokens < 1:
            raise EngineError(f"max_tokens must be at least 1, got {params.max_tokens}")
        if len(prompt) + params.max_tokens > self.max_context:
            raise EngineError(
                f"prompt of {len(prompt)} tokens plus {params.max_tokens} new tokens exceeds the "
                f"model's context of {self.max_context} tokens"
            )
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise EngineError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size})")
        if not (params.temperature >= 0 and 0 < params.top_p <= 1 and params.top_k >= 0):
            raise EngineError(
                f"invalid sampling parameters: temperature={params.temperature}, "
                f"top_p={params.top_p}, top_k={params.top_k}"
            )
