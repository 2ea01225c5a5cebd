"""Speculative decoding with a draft model: which draft a target gets, whether the engine accepts the pair,
what the pair costs in memory, and what the service's plan says about it.

The engine decides compatibility from the two vocabularies (llama.cpp ``common/speculative.cpp``,
``common_speculative_are_compatible``, the same at 0c1e570 and in every build after the April 2026
speculative-parameter refactor): the tokenizer type must match, BOS and EOS must be added alike (and be the
same token when added), the token counts may differ by at most 128, and every token text from id 5 up
to the smaller vocabulary must be identical. A pair that fails is refused there ("the target and draft
vocabs are not compatible"), so the planner checks the same facts first: from the two GGUF headers when
they were read (``--header``, a GGUF path or URL; only headers are read, nothing is downloaded), else from
the ``tokenizer:`` facts the catalog transcribed from them.

The draft keeps its own KV cache: the server creates its context from the target's parameters, so it
has the target's context size, slots and micro-batch, with the cache types given for the draft (the plan
gives it the target's). ``PairMemory`` adds the draft's weights, KV and compute to the target's estimate,
so every fit, context choice and refusal of the placement counts both models.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from controller.errors import DraftError
from controller.model.catalog import Catalog, DraftPairing, EngineEntry, ModelEntry
from controller.model.fleet import WantedModel
from controller.model.serveplan import DraftService, Service, ServiceMemory
from controller.stages.estimate.gguf_header import GGUFHeader, read_header
from controller.stages.estimate.memory import CUDA_OVERHEAD_MIB, MIB, Settings, estimate, resolve_settings
from controller.stages.planner import fit as fitting
from controller.stages.planner.commandline import draft_args
from controller.stages.planner.specs import MemoryModel, SpecMemory, memory_model

AUTO = "auto"
VOCAB_MAX_SIZE_DIFFERENCE = 128  # SPEC_VOCAB_MAX_SIZE_DIFFERENCE in llama.cpp common/speculative.cpp
VOCAB_CHECK_START_TOKEN_ID = 5  # SPEC_VOCAB_CHECK_START_TOKEN_ID: texts are compared from this id on
DRAFT_MAX = 5  # the seed's speculation length: 5 drafted tokens per step
DRAFT_MIN = 0  # the engine's default: keep a draft however short it is

# tokenizer.ggml.model -> llama.cpp's vocabulary type (llama_vocab::impl::load)
_VOCAB_TYPES = {"llama": "SPM", "gpt2": "BPE", "bert": "WPM", "t5": "UGM", "rwkv": "RWKV", "plamo2": "PLaMo2",
                "no_vocab": "none"}
# Pre-tokenizers for which llama.cpp adds BOS unless the GGUF says otherwise (llama-vocab.cpp)
_BPE_ADD_BOS = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                "tekken", "chameleon"}


@dataclass(frozen=True)
class Vocab:
    """The facts llama.cpp compares, from a GGUF header or from the catalog's transcription of one."""

    source: str
    model: str
    pre: str | None
    n_tokens: int
    bos: int | None
    eos: int | None
    add_bos: bool
    add_eos: bool
    tokens: tuple[str, ...] | None = None  # the texts themselves, when a header was read

    @property
    def kind(self) -> str:
        return _VOCAB_TYPES.get(self.model, self.model)


def vocab_from_header(header: GGUFHeader) -> Vocab | None:
    meta = header.metadata
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(model, str) or not isinstance(tokens, list):
        return None
    pre = meta.get("tokenizer.ggml.pre")
    kind = _VOCAB_TYPES.get(model, model)
    default_bos = kind in ("SPM", "WPM") or (kind == "BPE" and pre in _BPE_ADD_BOS)
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_eos = meta.get("tokenizer.ggml.add_eos_token")
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    return Vocab(
        source=f"the GGUF header of {header.source}", model=model, pre=pre if isinstance(pre, str) else None,
        n_tokens=len(tokens), bos=int(bos) if isinstance(bos, int) else None,
        eos=int(eos) if isinstance(eos, int) else None,
        add_bos=bool(add_bos) if add_bos is not None else default_bos,
        add_eos=bool(add_eos) if add_eos is not None else kind == "UGM",
        tokens=tuple(str(t) for t in tokens))


def vocab_from_entry(entry: ModelEntry) -> Vocab | None:
    facts = entry.tokenizer
    if facts is None:
        return None
    return Vocab(source=f"the catalog's tokenizer facts for {entry.id}", model=facts.model, pre=facts.pre,
                 n_tokens=facts.tokens, bos=facts.bos, eos=facts.eos, add_bos=facts.add_bos, add_eos=facts.add_eos)


def incompatibilities(target: Vocab, draft: Vocab) -> list[str]:
    """What makes the engine refuse the pair, in its order of checks; empty when it accepts it."""
    if target.kind != draft.kind:
        return [f"the tokenizer types differ ({target.model} vs {draft.model})"]
    problems = []
    if target.add_bos != draft.add_bos or (target.add_bos and target.bos != draft.bos):
        problems.append(f"BOS is handled differently (added: {str(target.add_bos).lower()} vs "
                        f"{str(draft.add_bos).lower()}, token {target.bos} vs {draft.bos})")
    if target.add_eos != draft.add_eos or (target.add_eos and target.eos != draft.eos):
        problems.append(f"EOS is handled differently (added: {str(target.add_eos).lower()} vs "
                        f"{str(draft.add_eos).lower()}, token {target.eos} vs {draft.eos})")
    gap = abs(target.n_tokens - draft.n_tokens)
    if gap > VOCAB_MAX_SIZE_DIFFERENCE:
        problems.append(f"the vocabularies have {target.n_tokens} and {draft.n_tokens} tokens, {gap} apart (the "
                        f"engine allows {VOCAB_MAX_SIZE_DIFFERENCE})")
    if problems:
        return problems
    if target.tokens is not None and draft.tokens is not None:
        for i in range(VOCAB_CHECK_START_TOKEN_ID, min(target.n_tokens, draft.n_tokens)):
            if target.tokens[i] != draft.tokens[i]:
                return [f"token {i} differs ({target.tokens[i]!r} vs {draft.tokens[i]!r})"]
    elif target.pre != draft.pre:
        return [f"the pre-tokenizers differ ({target.pre} vs {draft.pre}), so the token texts do"]
    return []


def _agreement(target: Vocab, draft: Vocab) -> str:
    texts = (f"identical token texts from id {VOCAB_CHECK_START_TOKEN_ID} up to {min(target.n_tokens, draft.n_tokens)}"
             if target.tokens is not None and draft.tokens is not None else
             f"the same {target.pre} pre-tokenizer (the texts themselves are compared when both GGUF headers are "
             f"read: --header ID=PATH_OR_URL)")
    return (f"vocabularies match as llama.cpp checks them (common_speculative_are_compatible): both {target.model} "
            f"tokenizers, BOS/EOS added alike, {target.n_tokens} and {draft.n_tokens} tokens "
            f"({abs(target.n_tokens - draft.n_tokens)} apart, at most {VOCAB_MAX_SIZE_DIFFERENCE} allowed), {texts}; "
            f"checked from {target.source} and {draft.source}")


# ---------------------------------------------------------------- memory


def draft_settings(draft: SpecMemory, target: Settings) -> Settings:
    """The draft's settings under the target's: same context, slots and batches; on the first card of the
    target's (``--device-draft``), every layer there; on the CPU with the target when it has no card."""
    gpus = target.gpus[:1]
    return replace(target, gpus=gpus, gpu_mem_mib=target.gpu_mem_mib[:1], split_mode="none",
                   n_gpu_layers=draft.spec.n_layer_all + 1 if gpus else 0, cpu_moe=False)


@dataclass
class PairMemory(SpecMemory):
    """A target's memory with its draft's added: weights, the draft's own KV cache and its compute."""

    draft: SpecMemory | None = None

    def draft_mib(self, settings: Settings) -> list[float]:
        """The draft's MiB on the target's devices (GPUs in order, then the CPU)."""
        values = [0.0] * (len(settings.gpus) + 1)
        if self.draft is None:
            return values
        own = self.draft.device_mib(draft_settings(self.draft, settings))
        if settings.gpus:
            values[0] += own[0] - CUDA_OVERHEAD_MIB  # one process, one CUDA context: the target's counts it
        values[-1] += own[-1]
        return values

    def device_mib(self, settings: Settings) -> list[float]:
        return [t + d for t, d in zip(super().device_mib(settings), self.draft_mib(settings))]


# ---------------------------------------------------------------- choosing a draft


@dataclass
class Pairing:
    """A target's draft: the catalog entry, the memory of the pair, and why (or why not)."""

    target: ModelEntry
    entry: ModelEntry
    explicit: bool
    compatible: bool
    reasons: list[str]
    plain: MemoryModel  # the target alone
    pair: PairMemory | None = None  # the target with the draft; None when the draft is refused
    recommendation: DraftPairing | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def memory(self) -> MemoryModel:
        return self.pair if self.pair is not None else self.plain


def _header(entry: ModelEntry, headers: Mapping[str, str | GGUFHeader]) -> GGUFHeader | None:
    given = headers.get(entry.id)
    if given is None:
        return None
    return given if isinstance(given, GGUFHeader) else read_header(given)


def _vocab(entry: ModelEntry, header: GGUFHeader | None) -> Vocab | None:
    return (vocab_from_header(header) if header is not None else None) or vocab_from_entry(entry)


def _can_draft(entry: ModelEntry, catalog: Catalog) -> EngineEntry | None:
    """An engine the target may run on that has draft flags (the entry names a family or an exact id)."""
    candidates = ([catalog.engines[entry.engine]] if entry.engine in catalog.engines else
                  [e for e in catalog.engines.values() if e.family == entry.engine])
    return next((engine for engine in candidates if engine.draft is not None), None)


def _instead(target: ModelEntry, draft_id: str, catalog: Catalog) -> str:
    own = [p.id for p in target.drafts if p.id in catalog.models]
    suits = [entry.id for entry in catalog.models.values() if any(p.id == draft_id for p in entry.drafts)]
    options = []
    if own:
        options.append(f"give {target.id} the draft {own[0]}")
    else:
        options.append(f"serve {target.id} without a draft (the catalog has none that suits it)")
    if suits:
        options.append(f"pair {draft_id} with {' or '.join(suits)}")
    return "; instead " + ", or ".join(options)


def _speedup(recommendation: DraftPairing | None, target: ModelEntry, draft_id: str) -> str:
    if recommendation is None:
        return (f"no expected speedup is known for {target.id} with {draft_id} (the catalog does not recommend this "
                f"pair); measure it with the verify report's tokens/s")
    return f"expected {recommendation.speedup} (source: {recommendation.source})"


def choose(want: WantedModel, target: ModelEntry, plain: MemoryModel, catalog: Catalog,
           headers: Mapping[str, str | GGUFHeader]) -> Pairing | str | None:
    """The draft the wanted model gets: None without ``draft``; a string saying why ``draft: auto`` found none.

    An explicit draft that the engine cannot load at all (larger than its target, or on an engine without
    draft flags) is a DraftError (exit 2); one whose vocabulary the engine would refuse comes back with
    ``compatible=False`` and what to pick instead, so the plan shows it and nothing is downloaded for it.
    """
    if want.draft is None:
        return None
    if want.draft == AUTO:
        return _auto(want, target, plain, catalog, headers)
    entry = catalog.model(want.draft)
    pairing = _pair(target, entry, plain, catalog, headers, explicit=True,
                    recommendation=next((p for p in target.drafts if p.id == entry.id), None))
    if isinstance(pairing, str):
        raise DraftError(pairing)
    return pairing


def _auto(want: WantedModel, target: ModelEntry, plain: MemoryModel, catalog: Catalog,
          headers: Mapping[str, str | GGUFHeader]) -> Pairing | str:
    why = []
    for recommendation in target.drafts:
        if recommendation.id not in catalog.models:
            why.append(f"{recommendation.id} is not in the catalog")
            continue
        pairing = _pair(target, catalog.model(recommendation.id), plain, catalog, headers, explicit=False,
                        recommendation=recommendation)
        if isinstance(pairing, str):
            why.append(pairing)
        elif not pairing.compatible:
            why.append("; ".join(pairing.reasons))
        else:
            return pairing
    if not target.drafts:
        return f"draft: auto: the catalog recommends no draft model for {target.id}; served without one"
    return f"draft: auto: no recommended draft can be used ({'; '.join(why)}); served without one"


def _pair(target: ModelEntry, entry: ModelEntry, plain: MemoryModel, catalog: Catalog,
          headers: Mapping[str, str | GGUFHeader], *, explicit: bool,
          recommendation: DraftPairing | None) -> Pairing | str:
    if entry.id == target.id:
        return f"{target.id}: a model cannot be its own draft; name a smaller model of the same family as draft"
    engine = _can_draft(target, catalog)
    if engine is None:
        return (f"{target.id} runs on {target.engine}, and the engine catalog gives no {target.engine} build "
                f"draft-model flags, so it cannot draft with {entry.id}; drop the draft or serve {target.id} on an "
                f"upstream engine")
    if not isinstance(plain, SpecMemory):
        return (f"{target.id}: its shape is not in the catalog (only its file size), so the pair's memory cannot be "
                f"estimated; add arch/hparams to its entry or plan it from its GGUF header to use a draft")
    draft_header = _header(entry, headers)
    draft_memory = memory_model(entry, draft_header)
    if not isinstance(draft_memory, SpecMemory):
        return (f"draft {entry.id}: its shape is not in the catalog, so its KV cache cannot be estimated; add "
                f"arch/hparams to its entry or give its GGUF header (--header {entry.id}=PATH_OR_URL)")
    target_mib, draft_mib = fitting.weights_mib(plain), fitting.weights_mib(draft_memory)
    if draft_mib >= target_mib:
        return (f"draft {entry.id} ({draft_mib} MiB of weights) is not smaller than its target {target.id} "
                f"({target_mib} MiB): a draft must be a much smaller model of the same vocabulary; swap them or pick "
                f"a smaller draft")
    target_vocab, draft_vocab = _vocab(target, _header(target, headers)), _vocab(entry, draft_header)
    if target_vocab is None or draft_vocab is None:
        missing = target.id if target_vocab is None else entry.id
        return (f"{missing}: no tokenizer facts in the catalog and no GGUF header, so whether llama.cpp accepts "
                f"{entry.id} as the draft of {target.id} cannot be checked; add tokenizer: to its entry or give "
                f"--header {missing}=PATH_OR_URL")
    problems = incompatibilities(target_vocab, draft_vocab)
    if problems:
        reasons = [f"draft {entry.id} refused for {target.id}: llama.cpp would not draft with it, "
                   f"{'; '.join(problems)} (checked from {target_vocab.source} and {draft_vocab.source})"
                   + _instead(target, entry.id, catalog),
                   "nothing of the draft is downloaded; the target is served without it"]
        if recommendation is not None or explicit:
            reasons.append(f"the pairing's speedup is moot: {_speedup(recommendation, target, entry.id)}")
        return Pairing(target, entry, explicit, False, reasons, plain)
    pair = PairMemory(spec=plain.spec, source=f"{plain.source} with the draft {entry.id} ({draft_memory.source})",
                      notes=list(plain.notes) + list(draft_memory.notes), draft=draft_memory)
    how = "as asked (draft: " + entry.id + ")" if explicit else "the catalog's recommendation (draft: auto)"
    reasons = [f"speculative decoding with draft {entry.id} ({draft_mib} MiB of weights, {target_mib} MiB for the "
               f"target), {how}: {_speedup(recommendation, target, entry.id)}",
               _agreement(target_vocab, draft_vocab)]
    return Pairing(target, entry, explicit, True, reasons, plain, pair, recommendation)


# ---------------------------------------------------------------- after placement


def refusal_note(pairing: Pairing | str | None) -> str:
    """What an unplaced target's refusal adds when the numbers were those of the pair."""
    if not isinstance(pairing, Pairing) or pairing.pair is None:
        return ""
    return (f"; the numbers include the draft {pairing.entry.id} ({fitting.weights_mib(pairing.pair.draft)} MiB of "
            f"weights and its own KV cache at the same context): drop the draft, or ask for a smaller ctx")


def service_settings(service: Service, draft: SpecMemory) -> Settings:
    """The target's settings as the estimator takes them, from the placed service (the planner's own rules:
    flash attention on, one shared cache for several slots, the CPU repacking on upstream)."""
    engine = "ik" if service.engine.startswith("ik") else "upstream"
    return resolve_settings(
        draft.spec, engine=engine, ctx=service.ctx, parallel=service.parallel, kv_unified=service.parallel > 1,
        cache_type_k=service.cache_type_k, cache_type_v=service.cache_type_v, ubatch=service.ubatch,
        batch=service.batch, flash_attn="on", gpus=service.gpus, gpu_mem_mib=[1.0] * len(service.gpus),
        split_mode="layer", cpu_repack=engine == "upstream")


def service_draft(pairing: Pairing, service: Service, args_added: list[str]) -> DraftService:
    """The plan's ``draft`` block for a placed service."""
    if pairing.pair is None or pairing.pair.draft is None:
        return DraftService(model=pairing.entry.id, model_file=pairing.entry.file, compatible=False,
                            reasons=list(pairing.reasons))
    draft = pairing.pair.draft
    gpus = service.gpus
    own = draft_settings(draft, service_settings(service, draft))
    result = estimate(draft.spec, own)
    values = draft.device_mib(own)
    memory = {f"cuda{gpus[0]}": round(values[0] - CUDA_OVERHEAD_MIB)} if gpus else {}
    memory["cpu"] = round(values[-1])
    where = (f"on GPU {gpus[0]} with the target (--device-draft CUDA0 is the service's first visible card), all "
             f"{draft.spec.n_layer_all + 1} layer slots there" if gpus else "in host RAM with the target")
    reasons = list(pairing.reasons) + [
        f"draft memory {', '.join(f'{k} {v} MiB' for k, v in memory.items())}: its weights {where}, and its own KV "
        f"cache ({result.kv.total_bytes / MIB:.0f} MiB: {result.kv.layers} layers x {result.kv.cells} cells, cache "
        f"{own.cache_type_k}, like the target's, since the server gives the draft the target's context and slots) "
        f"plus {sum(result.compute) / MIB:.0f} MiB of compute buffers; all of it is in the service's fit",
        f"{DRAFT_MAX} drafted tokens per step, drafts of any length kept (the seed's speculation length; "
        f"its --num-draft 5 is the old spelling of this engine's "
        f"{next((a for a in args_added if 'max' in a), 'n_max flag')})",
    ]
    return DraftService(model=pairing.entry.id, model_file=pairing.entry.file, args_added=list(args_added),
                        memory=ServiceMemory(per_device_mib=memory), compatible=True, reasons=reasons)


def settle(pairing: Pairing | str | None, place: object, model: MemoryModel
           ) -> tuple[MemoryModel, Pairing | str | None, bool]:
    """After placing the pair: ``(model, pairing, again)``; ``again`` asks to place the target alone.

    ``draft: auto`` drops a draft that does not fit beside its target or whose placement landed on an
    engine without draft flags (expert offload on ik_llama.cpp). An explicit draft on such an engine is
    refused; an explicit draft that does not fit leaves the target unplaced with the pair's numbers.
    """
    if not isinstance(pairing, Pairing) or pairing.pair is None:
        return model, pairing, False
    if isinstance(place, str):
        if pairing.explicit:
            return model, pairing, False
        return pairing.plain, (f"draft: auto: {pairing.entry.id} does not fit beside {pairing.target.id} ({place}); "
                               f"served without it"), True
    engine = getattr(place, "engine", None)
    if engine is not None and engine.draft is None:
        why = (f"{pairing.target.id} is placed on {engine.id} (the pair does not fit the cards otherwise), and the "
               f"engine catalog gives that build no draft-model flags")
        if pairing.explicit:
            raise DraftError(f"draft {pairing.entry.id}: {why}; drop the draft or give {pairing.target.id} more GPU "
                            f"memory")
        return pairing.plain, f"draft: auto: {why}; served without {pairing.entry.id}", True
    return model, pairing, False


def attach(pairing: Pairing | str | None, service: Service, engine: EngineEntry, draft_path: str) -> None:
    """Add the draft's flags, its plan block and its reasons to a placed service."""
    if pairing is None:
        return
    if isinstance(pairing, str):
        service.reasons.append(pairing)
        return
    if pairing.pair is None or pairing.pair.draft is None:
        service.draft = service_draft(pairing, service, [])
        service.reasons.append(pairing.reasons[0])
        return
    layers = pairing.pair.draft.spec.n_layer_all + 1
    added = draft_args(engine, draft_path, service, DRAFT_MAX, DRAFT_MIN, max(99, layers))
    service.args = service.args + added
    service.draft = service_draft(pairing, service, added)
    service.reasons.append(f"speculative decoding with the draft model {pairing.entry.id}: its reasons are in "
                           f"draft.reasons; the memory above counts both models")
