"""The speculator registry: every draft kind behind one interface (after llama.cpp's common/speculative.h,
whose decode loop never names a draft kind either).

A Speculator says whether it is available on an engine (its trained file or draft model attached),
describes itself for status displays, and builds the round a request decodes with. `plan` resolves a
request's settings against the calibration into a Plan; `build` turns the plan into a decode.Round.
Kinds are DraftKind members (draft_kind.py); a string naming one is parsed at the boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from completiond.engine import medusa as medusa_mod
from completiond.engine.decode import (
    Host,
    Request,
    choose_k,
    plain_step,
    speculative_round,
)
from completiond.engine.draft import Draft, EarlyExitDraft, LookupDraft
from completiond.engine.draft_kind import MODEL_DRAFTS, SETTINGS, DraftKind
from completiond.engine.draft_model import DraftModelDraft
from completiond.engine.exit_adapter import AdapterDraft
from completiond.engine.kvcache import KVSequence
from completiond.engine.lookup import OutputHistory
from completiond.engine.params import SamplingParams
from completiond.errors import EngineError

__all__ = ["MODEL_DRAFTS", "REGISTRY", "SETTINGS", "DraftKind", "Plan", "Speculator", "build", "describe", "plan"]


@dataclass(frozen=True)
class Plan:
    """How one request drafts: what replaced the settings tuple. `kind` is the model draft the calibrated
    figures are looked up for; `speculative` says whether it runs."""

    kind: DraftKind
    speculative: bool
    exit_layer: int
    k_max: int
    threshold: float
    lookup: bool
    adaptive_k: bool = True
    alpha0: float = 0.7  # acceptance to start K's choice from (the calibrated one where it applies)
    cost: float = 0.25  # one draft step relative to one verify pass


class Speculator:
    """One draft kind. Subclasses name their kind and override what differs from the plain early exit."""

    kind: ClassVar[DraftKind]
    missing: ClassVar[str] = ""  # the error when a request asks for it and it is not available
    stats_exit_layer: ClassVar[int | None] = None  # the exit layer stats report (None: the plan's)
    tag: ClassVar[str] = ""  # its prefix in calibration logs

    def available(self, engine: Host) -> bool:
        return True

    def fixed_exit_layer(self, engine: Host) -> int | None:
        """The one exit layer this kind drafts at (a trained adapter's), or None: any."""
        return None

    def exact(self, greedy: bool, constrained: bool) -> bool:
        """Whether its rounds keep the output exact for such a request (else the early exit stands in)."""
        return True

    def describe(self, engine: Host) -> str:
        raise NotImplementedError

    def chain(self, engine: Host, plan: Plan) -> Draft:
        """The draft that proposes a chain of tokens each round."""
        raise NotImplementedError

    def build(self, engine: Host, plan: Plan, history: OutputHistory | None) -> ChainRound | TreeRound | PlainRound:
        draft = self.chain(engine, plan)
        if plan.lookup:
            # In front of a model draft, lookup proposes up to LOOKUP_K (K belongs to the model draft)
            lookup = LookupDraft(engine, draft, history=history)
            return ChainRound(lookup, plan, room=max(plan.k_max, lookup.k))
        return ChainRound(draft, plan, room=plan.k_max)


class EarlyExit(Speculator):
    kind = DraftKind.EARLY_EXIT

    def describe(self, engine: Host) -> str:
        cal = engine.calibration
        return f"early exit at layer {cal.exit_layer} of {engine.num_layers}, K<={cal.draft_k}"

    def chain(self, engine: Host, plan: Plan) -> Draft:
        return EarlyExitDraft(engine, plan.exit_layer)


class ExitAdapter(Speculator):
    kind = DraftKind.ADAPTER
    tag = "adapter "
    missing = "no exit adapter is attached to this model; train one with `completiond train-adapter`"

    def available(self, engine: Host) -> bool:
        return engine.exit_adapter is not None

    def fixed_exit_layer(self, engine: Host) -> int | None:
        assert engine.exit_adapter is not None
        return engine.exit_adapter.exit_layer

    def describe(self, engine: Host) -> str:
        assert engine.exit_adapter is not None
        return f"exit adapter at layer {engine.exit_adapter.exit_layer}, K<={engine.calibration.draft_k}"

    def chain(self, engine: Host, plan: Plan) -> Draft:
        assert engine.exit_adapter is not None
        return AdapterDraft(engine, engine.exit_adapter)


class DraftModel(Speculator):
    kind = DraftKind.DRAFT_MODEL
    tag = "draft model "
    missing = "no draft model is attached to this model; set completiond.draftModel"
    stats_exit_layer = 0  # it drafts with none of the target's layers

    def available(self, engine: Host) -> bool:
        return engine.draft_model is not None

    def describe(self, engine: Host) -> str:
        assert engine.draft_model is not None
        return f"draft model {engine.draft_model.name}, K<={engine.calibration.draft_k}"

    def chain(self, engine: Host, plan: Plan) -> Draft:
        assert engine.draft_model is not None
        return DraftModelDraft(engine, engine.draft_model)


class Medusa(Speculator):
    kind = DraftKind.MEDUSA
    tag = "Medusa tree "
    missing = "no Medusa heads are attached to this model; train them with `completiond train-medusa`"

    def available(self, engine: Host) -> bool:
        return engine.medusa is not None

    def exact(self, greedy: bool, constrained: bool) -> bool:
        return greedy and not constrained  # the tree walk is exact for greedy decoding only

    def describe(self, engine: Host) -> str:
        heads = engine.medusa
        assert heads is not None
        return f"{heads.num_heads} Medusa heads, a {len(heads.tree) + 1}-node tree (greedy; else early exit)"

    def build(self, engine: Host, plan: Plan, history: OutputHistory | None) -> ChainRound | TreeRound | PlainRound:
        assert engine.medusa is not None
        # with lookup, its proposal is a branch of the tree
        return TreeRound(medusa_mod.TreeDecoder(engine, engine.medusa, plan.lookup, history=history))


class NoModelDraft(Speculator):
    """Prompt lookup alone (a plain step where it finds nothing), or plain steps."""

    kind = DraftKind.NONE
    tag = "no model draft "

    def describe(self, engine: Host) -> str:
        if engine.calibration.prompt_lookup:
            return "prompt lookup alone (a plain step where it finds nothing)"
        return "none (speculation does not pay for this model here)"

    def build(self, engine: Host, plan: Plan, history: OutputHistory | None) -> ChainRound | TreeRound | PlainRound:
        if plan.lookup:  # alone, K is its own (calibrated: a verify pass over more positions costs more here)
            return ChainRound(LookupDraft(engine, None, k=plan.k_max, history=history), plan, room=plan.k_max)
        return PlainRound(room=plan.k_max)


REGISTRY: dict[DraftKind, Speculator] = {
    s.kind: s for s in (EarlyExit(), ExitAdapter(), DraftModel(), Medusa(), NoModelDraft())
}


class ChainRound:
    """Rounds of a chain draft (or prompt lookup alone): draft K tokens, verify them in one pass, accept."""

    merges_prefill = True

    def __init__(self, draft: Draft, plan: Plan, room: int):
        self.draft = draft
        self.plan = plan
        self.room = room

    def step(
        self, engine: Host, seq: KVSequence, pending: int, out: list[int], remaining: int, req: Request
    ) -> list[int] | None:
        if remaining <= 0:
            return [_plain(engine, seq, pending, out, req)]
        return speculative_round(
            engine,
            seq,
            pending,
            out,
            self.draft,
            min(self.k(req), remaining),
            self.plan.threshold,
            req,
            limit=remaining,
        )

    def k(self, req: Request) -> int:
        """K for this round: the most the plan allows, or with adaptive K the best for the acceptance so far,
        from 8 pseudo-tests of the calibrated α and this request's own model-draft tests."""
        if not self.plan.adaptive_k:
            return self.plan.k_max
        s = req.stats
        accepted, rejected = s.accepted - s.lookup_accepted, s.rejected - s.lookup_rejected
        alpha = (8 * self.plan.alpha0 + accepted) / (8 + accepted + rejected)
        return choose_k(alpha, self.plan.cost, self.plan.k_max)


class TreeRound:
    """Rounds of a token tree (Medusa): its own draft and verify in each step."""

    merges_prefill = False
    draft = None

    def __init__(self, tree: medusa_mod.TreeDecoder):
        self.tree = tree
        self.room = tree.max_nodes

    def step(
        self, engine: Host, seq: KVSequence, pending: int, out: list[int], remaining: int, req: Request
    ) -> list[int] | None:
        if remaining <= 0:
            return [_plain(engine, seq, pending, out, req)]
        return self.tree.step(seq, pending, remaining, req.stats)


class PlainRound:
    """No draft: one plain step a round."""

    merges_prefill = True
    draft = None

    def __init__(self, room: int):
        self.room = room

    def step(
        self, engine: Host, seq: KVSequence, pending: int, out: list[int], remaining: int, req: Request
    ) -> list[int] | None:
        return [_plain(engine, seq, pending, out, req)]


def _plain(engine: Host, seq: KVSequence, pending: int, out: list[int], req: Request) -> int:
    req.stats.rounds += 1
    return plain_step(engine, seq, pending, out, req)


def plan(engine: Host, params: SamplingParams, greedy: bool, constrained: bool) -> Plan:
    """A request's settings resolved against the calibration and what is attached: which kind drafts, at
    which exit layer, how many tokens; EngineError for a kind asked for that is not attached."""
    cal = engine.calibration
    lookup = params.speculative and (cal.prompt_lookup if params.prompt_lookup is None else params.prompt_lookup)
    asked = None if params.draft is None else DraftKind.parse(params.draft)
    k_max = max(1, params.draft_k or cal.draft_k)
    if asked is DraftKind.NONE:  # no model draft: prompt lookup alone, when it is asked for or calibrated
        return _with_figures(
            engine,
            Plan(
                DraftKind.parse(cal.draft, MODEL_DRAFTS), False, cal.exit_layer, k_max, 0.0, lookup, params.adaptive_k
            ),
        )
    spec = params.speculative and (cal.speculative or params.exit_layer is not None or asked is not None)
    kind = asked or DraftKind.parse(cal.draft, MODEL_DRAFTS)
    exit_layer = params.exit_layer or cal.exit_layer
    speculator = REGISTRY[kind]
    if not speculator.available(engine):
        if asked is kind:
            raise EngineError(speculator.missing)
        kind = DraftKind.EARLY_EXIT  # a calibration that chose a draft since deleted: plain early exit
    elif (fixed := speculator.fixed_exit_layer(engine)) is not None:
        if params.exit_layer is not None and params.exit_layer != fixed:
            kind = DraftKind.EARLY_EXIT  # an explicit exit layer that is not the adapter's
        else:
            exit_layer = fixed
    if not 1 <= exit_layer < engine.num_layers:
        raise EngineError(
            f"exit layer must be in 1..{engine.num_layers - 1} for this {engine.num_layers}-layer "
            f"model, got {exit_layer}"
        )
    if spec and not REGISTRY[kind].exact(greedy, constrained):
        kind = DraftKind.EARLY_EXIT  # the chain is exact always
    threshold = cal.threshold if params.draft_threshold is None else params.draft_threshold
    return _with_figures(engine, Plan(kind, spec, exit_layer, k_max, threshold, lookup, params.adaptive_k))


def _with_figures(engine: Host, p: Plan) -> Plan:
    """p with the acceptance and draft cost K starts from: the calibrated figures where they describe this
    exit layer and kind, so that a seeded request is reproducible whatever ran before it."""
    cal = engine.calibration
    measured = cal.measured if p.exit_layer == cal.exit_layer and p.kind == cal.draft else {}
    return Plan(
        p.kind,
        p.speculative,
        p.exit_layer,
        p.k_max,
        p.threshold,
        p.lookup,
        p.adaptive_k,
        alpha0=measured.get("alpha", 0.7),
        cost=measured.get("draft_cost", p.exit_layer / engine.num_layers),
    )


def build(engine: Host, p: Plan, history: OutputHistory | None) -> ChainRound | TreeRound | PlainRound:
    """The round a planned request decodes with."""
    return REGISTRY[p.kind if p.speculative else DraftKind.NONE].build(engine, p, history)


def stats_fields(engine: Host, p: Plan) -> tuple[int, str]:
    """(exit layer, draft name) a request's stats report for its plan."""
    if not p.speculative:
        return engine.num_layers, ""
    fixed = REGISTRY[p.kind].stats_exit_layer
    return (p.exit_layer if fixed is None else fixed), p.kind.value


def describe(engine: Host) -> str:
    """How requests with default settings draft, in words (status displays)."""
    cal = engine.calibration
    speculator = REGISTRY[DraftKind.parse(cal.draft, MODEL_DRAFTS) if cal.speculative else DraftKind.NONE]
    if not speculator.available(engine):
        speculator = REGISTRY[DraftKind.EARLY_EXIT]
    return ("prompt lookup, else " if cal.prompt_lookup and cal.speculative else "") + speculator.describe(engine)
