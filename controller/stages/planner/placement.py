"""Placement: which cards (or the CPU), which engine and which context each wanted model gets.

For each wanted model (largest first, so big models get the boards they need), the planner tries,
in order, and stops at the first that fits:

1. one card, fully resident — never split a model that fits one card;
2. several cards of one NVLink board, fully resident: layer split for MoE models, tensor split
   (with NCCL all-reduce) for dense ones, the fewest cards and the fattest links first;
3. for MoE models, expert offload to host RAM on the free board with the most memory
   (ik_llama.cpp ``--fit``; upstream ``--n-cpu-moe`` for sliding-window models);

and otherwise leaves the model unplaced with the numbers. A box without a usable V100 serves on
the CPU build. Every choice is recorded as a reason. The arguments that carry a placement out on the
pinned engine version are built in ``controller.stages.planner.commandline``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from controller.errors import CatalogError, PlanError
from controller.model.catalog import Catalog, EngineEntry, ModelEntry
from controller.model.fleet import WantedModel
from controller.model.profile import Gpu, HardwareProfile
from controller.model.rules import AGENT_CLIENT_CTX, arch_label, build_runs_on
from controller.stages.estimate.memory import estimate, resolve_settings
from controller.stages.planner import fit as fitting
from controller.stages.planner.fit import Fit, Miss, Request
from controller.stages.planner.specs import MemoryModel, SizedMemory, SpecMemory
from controller.stages.planner.topology import GpuPool, GpuSet, Usable

DEFAULT_CTX = 131072  # the kit's Qwen context; the planner takes the largest that fits up to this
MIN_AGENT_CTX = 32768  # agents send 22-24k-token system prompts; less is not worth serving
CPU_DEFAULT_CTX, CPU_MIN_CTX = 8192, 2048
SIZED_DEFAULT_CTX = 32768  # a model known only by its file size gets the kit's Gemma context
HOST_RESERVE_MIB = 4096  # the OS, the page cache the loader needs, Ansible's own processes
RESIDENT_UBATCH, OFFLOAD_UBATCH, CPU_UBATCH = 1024, 2048, 512
# A resident model that misses by its compute buffers tries a smaller ubatch before more cards.
RESIDENT_UBATCHES = (RESIDENT_UBATCH, 512)


# ---------------------------------------------------------------- engines

def _family(entry: ModelEntry, catalog: Catalog) -> str:
    if entry.engine in catalog.engines:
        return catalog.engines[entry.engine].family
    if entry.engine in ("upstream", "ik"):
        return entry.engine
    raise PlanError(f"model {entry.id}: unknown engine {entry.engine!r}; use upstream, ik or an engine id")


def _runs(engine: EngineEntry, archs: Iterable[int | None]) -> bool:
    return all(build_runs_on(engine.cuda_archs or [], arch) for arch in archs)


def _engine(catalog: Catalog, family: str, *, nccl: bool = False, cpu: bool = False,
            preferred: str | None = None, archs: Iterable[int | None] = ()) -> EngineEntry:
    archs = tuple(archs)
    if preferred in catalog.engines:
        chosen = catalog.engines[preferred]
        if chosen.family == family and chosen.nccl == nccl and chosen.cpu_only == cpu and _runs(chosen, archs):
            return chosen
    for engine_id in sorted(catalog.engines):
        engine = catalog.engines[engine_id]
        if engine.family == family and engine.nccl == nccl and engine.cpu_only == cpu and _runs(engine, archs):
            return engine
    what = "CPU-only" if cpu else f"{family}{' NCCL' if nccl else ''}"
    raise CatalogError(f"the engine catalog has no {what} build; add one to engines.yml or a catalog file")


def _archs(engine: EngineEntry) -> str:
    return ";".join(map(str, engine.cuda_archs or [])) or "none"


def _kinds(ctx: Context, gpus: Iterable[int]) -> str:
    """``GPUs 0,1 (NVIDIA GeForce RTX 3090, sm_86 (Ampere)); GPU 4 (...)``: cards grouped by model."""
    groups: dict[tuple[str, int | None], list[int]] = {}
    for index in gpus:
        gpu = ctx.pool.gpus.get(index) or next(g for g in ctx.profile.gpus if g.index == index)
        groups.setdefault((gpu.name, gpu.arch), []).append(index)
    return "; ".join(f"GPU{'s' if len(indices) > 1 else ''} {','.join(map(str, indices))} ({name}, "
                     f"{arch_label(arch) if arch is not None else 'compute capability unknown'})"
                     for (name, arch), indices in groups.items())


def usable(ctx: Context, entry: ModelEntry, want: WantedModel, family: str) -> Usable:
    """Which card sets the model may run on: an engine of ``family`` built for every card's architecture,
    the pinned engine's own architectures when the model names an exact engine, and one kind of card
    unless the fleet lets it mix (``mix_cards``)."""
    engines = [e for e in ctx.catalog.engines.values() if e.family == family and not e.cpu_only]
    pinned = ctx.catalog.engines.get(entry.engine)
    pin = pin_cards(ctx, want)

    def check(gpus: tuple[int, ...]) -> bool:
        if pin is not None and not (set(gpus) == set(pin) if _exact(ctx, want) else set(gpus) <= set(pin)):
            return False
        archs = {ctx.pool.gpus[i].arch for i in gpus}
        if len(archs) > 1 and not (want.mix_cards or _exact(ctx, want)):  # naming the cards mixes them
            return False
        if pinned is not None and not _runs(pinned, archs):
            return False
        return any(_runs(engine, archs) for engine in engines)
    return check


# ---------------------------------------------------------------- cards the fleet pins a model to


def board_label(ctx: Context, gset: GpuSet) -> str:
    """``board 2`` (the probe's numbering, as ``board:`` pins take it), or ``its PCIe slot`` for a card on none."""
    boards = [tuple(board) for board in ctx.profile.boards]
    for number, board in enumerate(boards):
        if set(gset.board) <= set(board):
            return f"board {number}"
    return "no NVLink board"


def _exact(ctx: Context, want: WantedModel) -> tuple[int, ...] | None:
    """The exact cards a model must take (``gpus:``, or its on-demand group's), or None."""
    if want.gpus is not None:
        return tuple(sorted(want.gpus))
    return ctx.within


def _held(ctx: Context, want: WantedModel) -> bool:
    """Whether the model may only go where it is held: pinned by the fleet, or on its group's cards."""
    return bool(want.pinned) or ctx.within is not None


def pin_cards(ctx: Context, want: WantedModel) -> tuple[int, ...] | None:
    """The cards a pinned model may use (``gpus``: exactly these; ``board``: that board's), or None."""
    if (exact := _exact(ctx, want)) is not None:
        return exact
    if want.board is not None and want.board < len(ctx.profile.boards):
        return tuple(sorted(ctx.profile.boards[want.board]))
    return None


def pin_problem(ctx: Context, entry: ModelEntry, model: MemoryModel, want: WantedModel) -> str | None:
    """Why the cards the fleet pins this model to cannot take it whatever its size, or None."""
    if not want.pinned:
        return None
    head = f"{entry.id} ({fitting.weights_mib(model)} MiB weights) is pinned to {want.pinned}"
    boards = ctx.profile.boards
    listed = " ".join(f"{number}:{{{','.join(map(str, board))}}}" for number, board in enumerate(boards))
    if want.board is not None and want.board >= len(boards):
        where = (f"this box has {len(boards)} board{'s' if len(boards) != 1 else ''} (cards joined by NVLink; a card "
                 f"on none is a board of its own), numbered as `controller probe` lists them ({listed})" if boards else
                 "the probe saw no board on this box; pin it to cards with gpus: [...]")
        return f"{head}, but {where}; fix board in the fleet file"
    cards = pin_cards(ctx, want) or ()
    missing = [i for i in cards if i not in ctx.pool.gpus]
    if missing:
        known = ",".join(map(str, sorted(ctx.pool.gpus))) or "none"
        return (f"{head}, but this box has no GPU {','.join(map(str, missing))} whose memory the probe read (its "
                f"cards: {known}); fix gpus in the fleet file")
    taken = [i for i in cards if i in ctx.pool.taken]
    if want.gpus is not None and taken or taken and len(taken) == len(cards):
        owners = "; ".join(f"GPU {i} to {ctx.pool.owners.get(i) or 'another model'}" for i in taken)
        return (f"{head}, but those cards are already given ({owners}); each card serves one model: pin the models "
                f"to different cards")
    return None


def pinned_engine_problem(entry: ModelEntry, catalog: Catalog, profile: HardwareProfile) -> str | None:
    """Why the engine a model pins cannot run on any card of the box (its architectures match none)."""
    engine = catalog.engines.get(entry.engine)
    if engine is None or engine.cpu_only or not profile.gpus:
        return None
    if any(build_runs_on(engine.cuda_archs or [], gpu.arch) for gpu in profile.gpus):
        return None
    cards = "; ".join(f"GPU {g.index} {g.name} ({arch_label(g.arch) if g.arch else 'compute capability unknown'})"
                      for g in profile.gpus)
    return (f"{entry.id}: engine pack {engine.id} is built for {', '.join(map(arch_label, engine.cuda_archs or []))} "
            f"(cuda_archs: {_archs(engine)}), which none of this box's cards can run: {cards}; name a pack whose "
            f"cuda_archs include one of theirs, or drop the pin")


_FAMILY_NAMES = {"upstream": "upstream llama.cpp", "ik": "ik_llama.cpp"}


def _engine_reason(entry: ModelEntry, engine: EngineEntry, *, split: str = "none", offload: bool = False,
                   instead_of: str | None = None) -> str:
    """Why this engine build serves the model: the rule that chose its family, then the build itself."""
    family = _FAMILY_NAMES.get(engine.family, engine.family)
    if instead_of is not None:
        why = (f"{family}: {entry.id} would run on {_FAMILY_NAMES.get(instead_of, instead_of)}, but no build of it "
               f"runs on these cards, and this one does")
    elif engine.cpu_only:
        why = "the CPU-only build: no card on this box can run a GPU build of the engine catalog"
    elif entry.sliding_window:
        why = (f"{family}: {entry.id} uses sliding-window attention, whose cache only upstream sizes by the window "
               f"(ik_llama.cpp would keep every layer at full context)")
    elif split == "tensor":
        why = (f"{family}: a dense model split across cards needs upstream's tensor split (-sm tensor)"
               + ("; the NCCL build all-reduces over NVLink" if engine.nccl else ""))
    elif entry.engine == engine.id:
        why = f"{family}: the catalog entry of {entry.id} pins this build"
    elif engine.family == "ik" and entry.engine != "ik" and offload:
        why = (f"{family}: its experts spill to host RAM, and ik_llama.cpp's --fit sizes that offload and computes "
               f"the offloaded experts faster on the CPU (the catalog entry of {entry.id} names {entry.engine} for "
               f"it, which serves it where it fits the cards)")
    elif engine.family == "ik":
        why = (f"{family}: the catalog entry of {entry.id} asks for it (engine: ik) for its mixture-of-experts "
               f"kernels" + (", its --fit expert offload" if offload else "") + " and its -cram prompt cache in host RAM")
    else:
        why = f"{family}: the catalog entry of {entry.id} asks for it (engine: {entry.engine})"
    built = "" if engine.cpu_only else f"; built for {', '.join(map(arch_label, engine.cuda_archs or []))}"
    return f"engine {engine.id}, {why} ({engine.description or 'commit ' + engine.commit}{built})"


# ---------------------------------------------------------------- the placement of one model


@dataclass
class Placement:
    """Where a service runs and with which memory fit, before its arguments are rendered."""

    gpus: GpuSet | None
    fit: Fit
    engine: EngineEntry
    offload: bool
    reasons: list[str]
    ubatch: int


@dataclass
class Context:
    """What every placement decision needs to see."""

    profile: HardwareProfile
    catalog: Catalog
    pool: GpuPool
    ram_free_mib: float | None
    spill_alternatives: dict[int, str] = field(default_factory=dict)  # idle card -> model that spill: boards would use
    within: tuple[int, ...] | None = None  # an on-demand group's cards: its next model is planned on exactly these
    router: bool = False  # planning an on-demand group: only engines with router mode (upstream's)

    @property
    def cores(self) -> int | None:
        cpu = self.profile.cpu
        return cpu.cores or (cpu.threads // 2 if cpu.threads else None)


# ---------------------------------------------------------------- the agent clients a model serves


def _client_needs(want: WantedModel) -> tuple[int, int]:
    """The context (at least, preferred) every client named in the fleet can work with."""
    needs = [AGENT_CLIENT_CTX[client] for client in want.clients]
    return max(least for least, _ in needs), max(prefer for _, prefer in needs)


def agent_ctx_bounds(want: WantedModel, target: int, minimum: int, n_ctx_train: int | None) -> tuple[int, int]:
    """The context bounds once the named clients count: never below what they need, up to what they prefer."""
    if not want.clients:
        return target, minimum
    least, prefer = _client_needs(want)
    if want.ctx is None:
        target = max(target, min(prefer, max(n_ctx_train or prefer, least)))
    return target, max(minimum, least)


def agent_refusal(entry: ModelEntry, model: MemoryModel, want: WantedModel) -> str | None:
    """Why a model cannot serve the clients named for it whatever the hardware, or None."""
    n_ctx_train = model.spec.n_ctx_train if model.spec is not None else None
    short = [client for client in want.clients if n_ctx_train and n_ctx_train < AGENT_CLIENT_CTX[client][0]]
    if not short:
        return None
    needs = ", ".join(f"{client} needs at least {AGENT_CLIENT_CTX[client][0]}" for client in short)
    return (f"{entry.id} was trained for {n_ctx_train} tokens of context, the largest it can serve, but {needs}; "
            f"choose a model with a longer context or drop {', '.join(short)} from its agents")


def agent_reason(want: WantedModel, ctx_tokens: int) -> str | None:
    """The plan's reason for the context, as the named clients see it; None when no client is named."""
    if not want.clients:
        return None
    parts = []
    for client in want.clients:
        least, prefer = AGENT_CLIENT_CTX[client]
        parts.append(f"{client} needs at least {least}" + (f" and works best with {prefer}" if prefer > least else ""))
    text = f"context {ctx_tokens} tokens serves the agents named in the fleet ({'; '.join(parts)})"
    _, prefer = _client_needs(want)
    if ctx_tokens < prefer:
        text += f"; below the preferred {prefer} because no more fits"
    return text


def agent_shortfall(want: WantedModel) -> str:
    """What a refusal adds when clients were named: the context they needed."""
    if not want.clients:
        return ""
    least, _ = _client_needs(want)
    return f"; the agents named for it ({', '.join(want.clients)}) need at least {least} tokens of context"


def _request(entry: ModelEntry, model: MemoryModel, want: WantedModel, engine: str, *, offload: bool = False,
             cpu: bool = False, ubatch: int | None = None) -> Request:
    sized = isinstance(model, SizedMemory) and not model.kv_bytes_per_token
    default = CPU_DEFAULT_CTX if cpu else SIZED_DEFAULT_CTX if sized else DEFAULT_CTX
    n_ctx_train = model.spec.n_ctx_train if model.spec is not None and model.spec.n_ctx_train else None
    target = want.ctx or min(default, n_ctx_train or default)
    minimum = CPU_MIN_CTX if cpu else min(MIN_AGENT_CTX, target)
    target, minimum = agent_ctx_bounds(want, target, minimum, n_ctx_train)
    has_head = model.spec is None or model.spec.n_layer_all > model.spec.n_layer
    mtp = engine == "ik" and entry.mtp and has_head and not cpu  # the draft head keeps its own KV
    # Without KV figures the cache type cannot be weighed: the kit's q8_0 on a GPU, f16 on the CPU.
    caches = (("f16",) if cpu else ("q8_0",)) if sized else ()
    return Request(engine=engine, parallel=want.agents,
                   ubatch=ubatch or (CPU_UBATCH if cpu else OFFLOAD_UBATCH if offload else RESIDENT_UBATCH),
                   target_ctx=target, min_ctx=minimum, explicit=want.ctx is not None or sized, mtp=mtp,
                   caches=caches)


def _rank(fit: Fit) -> tuple[int, int]:
    return fit.ctx, -fitting.CACHE_PREFERENCE.index(fit.cache)


def _best_fit(model: MemoryModel, req: Request, sets: list[GpuSet], split: str,
              last_miss: tuple[GpuSet, Miss] | None) -> tuple[tuple[GpuSet, Fit] | None, tuple[GpuSet, Miss] | None]:
    """The set with the best fit (largest context, then best cache), and the miss kept for a refusal."""
    best: tuple[GpuSet, Fit] | None = None
    seen: dict[tuple[int, ...], Fit | Miss] = {}
    for gset in sets:
        result = seen.get(gset.memory_mib)
        if result is None:
            result = seen[gset.memory_mib] = fitting.fit_resident(model, req, gset, split)
        if isinstance(result, Fit):
            if best is None or _rank(result) > _rank(best[1]):
                best = (gset, result)
        elif last_miss is None or gset.total_mib > last_miss[0].total_mib or gset.gpus == last_miss[0].gpus:
            # the biggest set tried; for the same set, its last (smallest ubatch) attempt
            last_miss = (gset, result)
    return best, last_miss


def _resident(entry: ModelEntry, model: MemoryModel, want: WantedModel,
              ctx: Context) -> Placement | tuple[GpuSet, Miss] | None:
    """The fewest cards of one board that hold the whole model at an acceptable context.

    Without a fit, the miss on the largest set tried, for the refusal's numbers.
    """
    last_miss: tuple[GpuSet, Miss] | None = None
    preferred = _family(entry, ctx.catalog)
    # One NVLink board of one kind of card first; a model allowed to mix cards may then span boards and kinds.
    stages = [(size, False) for size in range(1, ctx.pool.max_board + 1)]
    stages += [(size, True) for size in range(2, len(ctx.pool.free) + 1)] if want.mix_cards else []
    exact = ctx.pool.exact(_exact(ctx, want)) if _exact(ctx, want) is not None else None
    if exact is not None:  # the fleet names the cards: that one set, however they are joined
        stages = [(exact.size, exact.spans)]
    for (size, spans), ubatch in ((stage, ubatch) for stage in stages for ubatch in RESIDENT_UBATCHES):
        dense_split = "tensor" if exact is None or not size & (size - 1) else "layer"  # tensor: 2, 4, 8 cards
        split = "none" if size == 1 else "layer" if entry.moe or spans else dense_split
        first = "upstream" if entry.sliding_window or split == "tensor" else preferred
        # Cards no build of the preferred family runs on (an RTX 3090 beside sm_70-only ik packs) may still
        # hold the model with upstream's build for them, unless the model pins its engine.
        families = [first] + (["upstream"] if first != "upstream" and entry.engine not in ctx.catalog.engines else [])
        for family in families:
            ok = usable(ctx, entry, want, family)
            if family != first:
                preferred_ok = usable(ctx, entry, want, first)
                ok = (lambda check, other: lambda gpus: check(gpus) and not other(gpus))(ok, preferred_ok)
            req = _request(entry, model, want, "ik" if family == "ik" else "upstream", ubatch=ubatch)
            if exact is not None:
                sets = [exact] if ok(exact.gpus) else []
            else:
                sets = (ctx.pool.spanning(size, ok) if spans else
                        ctx.pool.candidates(size, powers_of_two=split == "tensor", usable=ok))
            best, last_miss = _best_fit(model, req, sets, split, last_miss)
            if best is not None:
                gset, fit = best
                archs = {ctx.pool.gpus[i].arch for i in gset.gpus}
                pinned_engine = ctx.catalog.engines.get(entry.engine)
                nccl = split == "tensor" and (pinned_engine.nccl if pinned_engine is not None else
                                              any(e.nccl and _runs(e, archs) for e in ctx.catalog.engines.values()))
                engine = _engine(ctx.catalog, family, nccl=nccl, preferred=entry.engine, archs=archs)
                reasons = [_engine_reason(entry, engine, split=split, instead_of=first if family != first else None),
                           _cards_reason(ctx, gset, engine), *_placement_reasons(entry, gset, fit, split, engine, ctx,
                                                                                 req, want=want),
                           fitting.margin_reason(fit, gset.gpus), fitting.host_reason(fit)]
                return Placement(gset, fit, engine, False, reasons, req.ubatch)
    return last_miss


def _offload(entry: ModelEntry, model: MemoryModel, want: WantedModel,
             ctx: Context) -> Placement | tuple[GpuSet, Miss] | str:
    """Experts to host RAM on the free board with the most memory; a reason string when impossible.

    Offload runs on ik_llama.cpp (``--fit``), or upstream (``--n-cpu-moe``) for sliding-window models; a model
    whose engine is not pinned also tries upstream's builds, and takes whichever runs on the board with more
    memory (an RTX 3090 beside V100s ik has the only build for). A pinned model offloads on its own cards."""
    if not isinstance(model, SpecMemory) or not model.spec.n_expert:
        return (f"expert offload needs the model's shape (which tensors are experts); {entry.id} has none in the "
                f"catalog: add arch/hparams or plan it from its GGUF header")
    first = "upstream" if entry.sliding_window or ctx.router else "ik"
    families = [first] + (["upstream"] if first != "upstream" and entry.engine not in ctx.catalog.engines else [])
    options: list[tuple[str, GpuSet]] = []
    for family in families:
        ok = usable(ctx, entry, want, family)
        if _exact(ctx, want) is not None:
            exact = ctx.pool.exact(_exact(ctx, want))
            gset = exact if ok(exact.gpus) else None
        else:
            gset = ctx.pool.largest_free_board(ok)
        if gset is not None:
            options.append((family, gset))
    if not options:
        return "no free NVLink board is left for it" if not _held(ctx, want) else "no engine build runs on those cards"
    family, gset = max(options, key=lambda option: (option[1].total_mib, option[0] == first))
    others = [other for other in options if other[0] != family]
    req = _request(entry, model, want, "ik" if family == "ik" else "upstream", offload=True)
    result = fitting.fit_offload(model, req, gset)
    if isinstance(result, Miss):
        return gset, result
    engine = _engine(ctx.catalog, family, preferred=entry.engine, archs={ctx.pool.gpus[i].arch for i in gset.gpus})
    resident_req = _request(entry, model, want, "ik" if family == "ik" else "upstream", ubatch=RESIDENT_UBATCHES[-1])
    whole = fitting.fit_resident(model, resident_req, gset, "none" if gset.size == 1 else "layer")
    reasons = [_engine_reason(entry, engine, offload=True, instead_of=first if family != first else None),
               _cards_reason(ctx, gset, engine), *([_pin_reason(want, gset, ctx)] if _held(ctx, want) else []),
               *_offload_reasons(entry, gset, result, engine, req, whole if isinstance(whole, Miss) else None,
                                 others[0][1] if others else None, ctx),
               fitting.margin_reason(result, gset.gpus, engine.family), fitting.host_reason(result)]
    return Placement(gset, result, engine, True, reasons, req.ubatch)


def _across_boards(entry: ModelEntry, model: MemoryModel, want: WantedModel,
                   ctx: Context) -> Placement | tuple[GpuSet, Miss] | None:
    """The fewest free boards that hold the whole model together, split by layer (``spill: boards``).

    Cards of one kind unless the fleet lets the model mix them; each board's cards keep their NVLink and the
    boards are joined by PCIe, so only each layer boundary's activations cross between them."""
    if _held(ctx, want):
        return None
    last_miss: tuple[GpuSet, Miss] | None = None
    preferred = _family(entry, ctx.catalog)
    first = "upstream" if entry.sliding_window else preferred
    families = [first] + (["upstream"] if first != "upstream" and entry.engine not in ctx.catalog.engines else [])
    for count, ubatch in ((n, u) for n in range(2, ctx.pool.board_count + 1) for u in RESIDENT_UBATCHES):
        for family in families:
            ok = usable(ctx, entry, want, family)
            req = _request(entry, model, want, "ik" if family == "ik" else "upstream", ubatch=ubatch)
            best, last_miss = _best_fit(model, req, ctx.pool.board_unions(count, ok), "layer", last_miss)
            if best is None:
                continue
            gset, fit = best
            engine = _engine(ctx.catalog, family, preferred=entry.engine,
                             archs={ctx.pool.gpus[i].arch for i in gset.gpus})
            reasons = [_engine_reason(entry, engine, split="layer", instead_of=first if family != first else None),
                       _cards_reason(ctx, gset, engine),
                       *_placement_reasons(entry, gset, fit, "layer", engine, ctx, req, want=want, boards=count,
                                           model=model),
                       fitting.margin_reason(fit, gset.gpus), fitting.host_reason(fit)]
            return Placement(gset, fit, engine, False, reasons, req.ubatch)
    return last_miss


# ---------------------------------------------------------------- reasons


def mib(value: float) -> str:
    return f"{value:.0f} MiB"


def _cards_reason(ctx: Context, gset: GpuSet, engine: EngineEntry) -> str:
    """Which cards the service uses, of which kind, and that its engine build runs there."""
    return f"cards: {_kinds(ctx, gset.gpus)}; {engine.id} carries code for them (cuda_archs: {_archs(engine)})"


def _ctx_reason(fit: Fit, req: Request) -> str:
    options = ", ".join(f"{cache} {tokens}" for cache, tokens in fit.largest_ctx.items())
    if req.explicit:
        return f"context {fit.ctx} tokens, as asked; cache {fit.cache} (largest context per cache type: {options})"
    return (f"context {fit.ctx} tokens: the largest (up to {req.target_ctx}) that fits, with the best cache type "
            f"that reaches it, {fit.cache} (largest context per cache type: {options})")


def _pin_reason(want: WantedModel, gset: GpuSet, ctx: Context | None = None) -> str:
    if ctx is not None and ctx.within is not None and want.gpus is None:
        return (f"on the cards of its on-demand group, {gset.describe()}, planned as if it ran there alone (the "
                f"group's models take turns on them)")
    if want.gpus is not None:
        return f"pinned by the fleet to {want.pinned}: these cards and no others"
    return (f"pinned by the fleet to {want.pinned}: the fewest cards of that board that hold it "
            f"({gset.size} of them); never another board")


def _boards_reasons(entry: ModelEntry, model: MemoryModel | None, gset: GpuSet, per_card: str, req: Request,
                    boards: int, want: WantedModel, ctx: Context) -> list[str]:
    """Why a model is split across boards, and what that costs."""
    spec = model.spec if model is not None else None
    hop = (f"{spec.n_embd} values (~{spec.n_embd * 4 // 1024} KiB) per token" if spec is not None and spec.n_embd
           else "one token's activations")
    if want.spill == "boards":
        why = "the fleet asks for it (spill: boards) rather than experts in host RAM"
    elif entry.moe:
        why = "no single board holds it even with its experts in host RAM"
    else:
        why = "a dense model cannot spill experts to host RAM"
    needed = req.min_ctx if not req.explicit else req.target_ctx
    singles = all(len(ctx.pool.board_of(i)) == 1 for i in gset.gpus)
    where = (f"across {gset.size} cards that share no NVLink" if singles else
             f"across the fewest boards, {boards}, {gset.size} cards")
    links = ("the cards share no NVLink, so" if singles else "each board keeps its own NVLink, but")
    instead = ("; spill: host in the fleet keeps it on one board with its experts in host RAM instead"
               if entry.moe and want.spill == "boards" else "")
    return [
        f"no single free board holds {entry.id} whole at {needed} tokens of context and {why}, so it is split by "
        f"layer {where}: {per_card} MiB estimated",
        f"cross-board cost: {links} at every boundary between them the activations, {hop}, cross PCIe (and NUMA), "
        f"and prompt processing moves {req.ubatch} tokens' worth at a time; a model inside one board is faster (the "
        f"kit keeps every model inside one board){instead}",
        "layer split (-sm layer): each card holds whole layers, so only the activations cross between cards; "
        "never tensor split across boards",
    ]


def _placement_reasons(entry: ModelEntry, gset: GpuSet, fit: Fit, split: str, engine: EngineEntry, ctx: Context,
                       req: Request, *, want: WantedModel | None = None, boards: int = 0,
                       model: MemoryModel | None = None) -> list[str]:
    per_card = ", ".join(f"GPU {g}: {mib(v)} of {m}" for g, v, m in zip(gset.gpus, fit.device_mib, gset.memory_mib))
    reasons = []
    if want is not None and _held(ctx, want):
        reasons.append(_pin_reason(want, gset, ctx))
    if boards and want is not None:
        reasons += _boards_reasons(entry, model, gset, per_card, req, boards, want, ctx)
    elif gset.size == 1:
        reasons.append(
            f"fits one card, {gset.describe()}: {per_card} MiB estimated (weights, KV, compute, CUDA context) with "
            f"{fitting.RESIDENT_MARGIN_MIB} MiB kept free; a model that fits one card is fastest there "
            f"(Gemma 4: 99 tok/s on one card, 90 layer-split, 76 tensor-split on two)")
        if len(gset.board) > 1:
            reasons.append(f"one card of {board_label(ctx, gset)} ({len(gset.board)} cards); the rest stay free for "
                           f"other models")
    elif gset.spans and want is not None and _exact(ctx, want) is not None:
        reasons.append(f"split across the {gset.size} cards it is pinned to, which are not one NVLink board: "
                       f"{gset.describe()}: {per_card} MiB estimated; each token crosses PCIe between them, slower "
                       f"than one board")
        reasons.append("layer split (-sm layer): each card holds whole layers, so only the activations cross PCIe at "
                       "each boundary; never tensor split across boards")
    elif want is not None and _exact(ctx, want) is not None:
        reasons.append(f"split across the {gset.size} cards it is pinned to, inside one NVLink board, "
                       f"{gset.describe()}: {per_card} MiB estimated")
    elif gset.spans:
        reasons.append(
            f"no free NVLink board of one kind of card holds it at {req.min_ctx if not req.explicit else req.target_ctx} "
            f"tokens of context; the fleet lets it mix cards (mix_cards: true), so it spans {gset.size} cards, "
            f"{gset.describe()}: {per_card} MiB estimated; each token crosses PCIe between them, slower than one board")
        reasons.append("layer split (-sm layer): each card holds whole layers, so only the activations cross PCIe at "
                       "each boundary; never tensor split across boards")
    else:
        reasons.append(
            f"does not fit one card at {req.min_ctx if not req.explicit else req.target_ctx} tokens of context; "
            f"{gset.size} cards inside one NVLink board, {gset.describe()}: {per_card} MiB estimated; never across "
            f"boards, where every step would cross PCIe/NUMA")
        if want is None or _exact(ctx, want) is None:
            reasons.append(f"the fattest links free for {gset.size} cards: NVLink x{gset.min_links} per pair "
                           f"({board_label(ctx, gset)})")
    if gset.size > 1:
        if split == "layer" and not gset.spans:
            reasons.append("layer split (-sm layer): an MoE model keeps each layer's experts on one card "
                           "(Qwen3.6 35B on two V100s: 82.8 tok/s, all in VRAM); -sm row crashes for these models")
        elif split == "tensor":
            reasons.append("tensor split (-sm tensor): a dense model runs every weight for every token, so the cards "
                           "share each layer (27B dense: 39.4 tok/s vs 32.4 layer split); -sm row crashes for these "
                           "models")
            if engine.nccl:
                reasons.append("NCCL all-reduce over NVLink (GGML_CUDA_ALLREDUCE=nccl, the upstream NCCL build): "
                               "+7-9% aggregate throughput at 16-32 concurrent requests")
            else:
                reasons.append("no NCCL build in the engine catalog: tensor split uses llama.cpp's own all-reduce")
        if split == "layer" and engine.family == "ik":
            reasons.append(f"--tensor-split {','.join(map(str, fit.card_mib))}: ik_llama.cpp balances the layers by "
                           f"their bytes over each card's memory")
        elif split == "layer":
            counts = ", ".join(f"{c:g}" for c in fit.shares)
            reasons.append(f"--tensor-split: whole layer slots per card ({counts}; a boundary half a slot early keeps "
                           f"rounding from moving a layer), balanced so no card runs out first — the last card also "
                           f"holds the output layer")
        else:
            reasons.append(f"--tensor-split {split_fractions(fit.shares)}: each card's share of every tensor, in "
                           f"proportion to the memory it has free")
    reasons.append(_ctx_reason(fit, req))
    return reasons


def _offload_reasons(entry: ModelEntry, gset: GpuSet, fit: Fit, engine: EngineEntry, req: Request, whole: Miss | None,
                     other: GpuSet | None, ctx: Context) -> list[str]:
    """Why the experts spill, on the cards the service takes: ``whole`` is the miss of the whole model on them,
    ``other`` the board the other engine family would have offloaded on (smaller)."""
    n_layers = fit.cpu_moe_layers
    needs = ""
    if whole is not None:
        needs = (f" (whole on these cards it would need {', '.join(mib(v) for v in whole.need_mib)} at {whole.ctx} "
                 f"tokens; they would hold {whole.largest_ctx} tokens at most)")
    required = req.target_ctx if req.explicit else req.min_ctx
    reasons = [
        f"no free board holds {entry.id} entirely with {required} tokens of context; {gset.describe()}{needs} keeps "
        f"the attention, shared weights and KV, and as a mixture-of-experts model its experts spill to host RAM: "
        f"those of ~{n_layers} of {fit.moe_layers} layers ({mib(fit.device_mib[-1])} of host RAM in all) run on "
        f"the CPU",
    ]
    if engine.family == "ik":
        reasons.append(f"ik_llama.cpp with --fit --fit-margin {fit.fit_margin}: the engine sizes the offload itself and "
                       f"keeps {fit.fit_margin} MiB free per card (the kit's margin; 2048 above 131072 tokens); its "
                       f"CPU kernels for the offloaded experts are faster than upstream's")
    elif entry.sliding_window:
        reasons.append(f"--n-cpu-moe {n_layers} on upstream llama.cpp: the sliding-window cache rules out ik_llama.cpp")
    else:
        why = (f"these cards ({gset.total_mib} MiB) keep more of the model on the GPU than the largest free board an "
               f"ik_llama.cpp build runs on ({other.total_mib} MiB), which outweighs ik's faster CPU expert kernels"
               if other is not None else
               "it is served on demand, by upstream's router mode, which ik_llama.cpp (022bd00a) does not have"
               if ctx.router else "no ik_llama.cpp build of the engine catalog runs on these cards")
        reasons.append(f"--n-cpu-moe {n_layers} on upstream llama.cpp: {why}")
    reasons.append(_ctx_reason(fit, req))
    reasons.append("cache q8_0 or smaller with offload: every MiB of KV on the card pushes more experts to the CPU "
                   "and slows every turn")
    return reasons


def swa_reason(entry: ModelEntry, model: MemoryModel, ctx_tokens: int) -> str | None:
    if not entry.sliding_window:
        return None
    text = "sliding-window attention: upstream llama.cpp only, whose iSWA cache sizes those layers by the window"
    if isinstance(model, SpecMemory):
        ik = estimate(model.spec, resolve_settings(model.spec, engine="ik", ctx=ctx_tokens, cache_type_k="q8_0",
                                                   cache_type_v="q8_0"))
        text += (f"; ik_llama.cpp keeps every layer at full context and would need "
                 f"{ik.kv.total_bytes / 2**30:.1f} GiB of KV at {ctx_tokens} tokens")
    return text


# ---------------------------------------------------------------- arguments



def split_fractions(shares: Sequence[float]) -> str:
    """Each card's share as ``--tensor-split`` reads fractions."""
    total = sum(shares) or 1.0
    return ",".join(f"{share / total:.3g}" for share in shares)




def _refusal(entry: ModelEntry, model: MemoryModel, miss: Miss | None, gset: GpuSet | None, why: str = "") -> str:
    weights = fitting.weights_mib(model)
    if miss is None:
        return f"{entry.id} ({weights} MiB weights): {why or 'no card its engine builds run on is free on this box'}"
    need = ", ".join(mib(v) for v in miss.need_mib)
    budget = ", ".join(mib(v) for v in miss.budget_mib)
    where = gset.describe() if gset is not None else "host RAM"
    largest = (f"the largest context that would fit is {miss.largest_ctx} tokens" if miss.largest_ctx
               else "not even the weights fit")
    detail = f" {miss.detail}" if miss.detail else ""
    text = (f"{entry.id} ({weights} MiB weights) does not fit: on {where}{detail} it needs {need} at {miss.ctx} "
            f"tokens of context, against {budget} usable; {largest}")
    return text + (f"; {why}" if why else "")


# ---------------------------------------------------------------- the box


def _runnable(ctx: Context, entry: ModelEntry, cards: Iterable[int]) -> list[int]:
    """The cards some GPU build of the model's engine families (or its pinned engine) runs on."""
    families = {_family(entry, ctx.catalog), "upstream"}
    pinned = ctx.catalog.engines.get(entry.engine)
    engines = [pinned] if pinned is not None else [e for e in ctx.catalog.engines.values()
                                                   if e.family in families and not e.cpu_only]
    return [i for i in cards if any(_runs(engine, [ctx.pool.gpus[i].arch]) for engine in engines)]


def _mix_hint(ctx: Context, entry: ModelEntry, want: WantedModel) -> str:
    """What mix_cards would allow, when the free cards this model could run on lie on several boards or kinds."""
    free = _runnable(ctx, entry, ctx.pool.free)
    if want.mix_cards or _held(ctx, want) or len(free) < 2:
        return ""
    kinds = {ctx.pool.gpus[i].arch for i in free}
    boards = {ctx.pool.board_of(i) for i in free}
    if len(kinds) < 2 and len(boards) < 2:
        return ""
    return (f"; mixing cards is off for it: mix_cards: true on the wanted model lets it span the free cards "
            f"{_kinds(ctx, free)} (layer split over PCIe{', with a pack built for each kind' if len(kinds) > 1 else ''})")


def _host_ram_problem(entry: ModelEntry, model: MemoryModel, place: Placement, ctx: Context) -> str | None:
    need = place.fit.device_mib[-1] + HOST_RESERVE_MIB  # the pinned CUDA_Host buffers, or the offloaded experts
    if ctx.ram_free_mib is None or need <= ctx.ram_free_mib:
        return None
    if place.offload:
        return (f"{entry.id} ({fitting.weights_mib(model)} MiB weights) does not fit any free board, and offloading "
                f"its experts needs {mib(place.fit.device_mib[-1])} of host RAM plus {HOST_RESERVE_MIB} MiB "
                f"for the system, but only {mib(ctx.ram_free_mib)} is free; add RAM or a board with "
                f"{fitting.weights_mib(model)} MiB of GPU memory")
    return (f"{entry.id} ({fitting.weights_mib(model)} MiB weights) fits the cards but needs "
            f"{mib(place.fit.device_mib[-1])} of host RAM beside them (token embeddings and page-locked "
            f"buffers) plus {HOST_RESERVE_MIB} MiB for the system, and only {mib(ctx.ram_free_mib)} is free")


def _pinned_refusal(want: WantedModel) -> str:
    return (f"; it is pinned to {want.pinned} and is never placed elsewhere: pin it to cards with more memory, ask for "
            f"less context, or drop the pin")


def place_gpu(entry: ModelEntry, model: MemoryModel, want: WantedModel, ctx: Context) -> Placement | str:
    """Resident on the fewest cards of one board; else, as ``spill`` says, experts in host RAM inside one board
    (``host``) or the whole model across the fewest boards (``boards``); unset: host when the model can, else
    boards. A pinned model only ever takes its own cards."""
    if ctx.within is None and (problem := pin_problem(ctx, entry, model, want)):
        return problem
    pin = pin_cards(ctx, want)
    cards = [i for i in ctx.pool.gpus if pin is None or i in pin]
    if not _runnable(ctx, entry, cards):
        families = " or ".join(sorted({_FAMILY_NAMES.get(f, f) for f in (_family(entry, ctx.catalog), "upstream")}))
        where = ("this box's cards" if pin is None else f"the cards it is pinned to ({want.pinned})" if want.pinned
                 else "its on-demand group's cards")
        return (f"{entry.id} ({fitting.weights_mib(model)} MiB weights): no build of {families} in the engine catalog "
                f"runs on {where} ({_kinds(ctx, cards)}); declare a pack whose cuda_archs include theirs")
    if not _runnable(ctx, entry, [i for i in cards if i not in ctx.pool.taken]):
        return (f"{entry.id} ({fitting.weights_mib(model)} MiB weights): every card its engine builds run on is "
                f"already given to a larger model planned first; list fewer models or add cards"
                + ("" if pin is None else _pinned_refusal(want)))
    resident = _resident(entry, model, want, ctx)
    if isinstance(resident, Placement):
        return _host_ram_problem(entry, model, resident, ctx) or resident
    gset, miss = resident if resident else (None, None)
    pinned = (_pinned_refusal(want) if want.pinned else
              "; the models of an on-demand group share its cards, and this one does not fit them alone"
              if ctx.within is not None else "")
    boards: Placement | tuple[GpuSet, Miss] | None = None
    if want.spill == "boards":
        boards = _across_boards(entry, model, want, ctx)
        if isinstance(boards, Placement):
            return _host_ram_problem(entry, model, boards, ctx) or boards
        where, missed = boards if boards else (gset, miss)
        return _refusal(entry, model, missed, where, "spill: boards: not even the fewest free boards together hold "
                        "it" + ("; spill: host would keep it on one board with its experts in host RAM"
                                if entry.moe else "")) + _mix_hint(ctx, entry, want)
    offload = (_offload(entry, model, want, ctx) if entry.moe else
               "a dense model is split by tensor across the cards of one board at most; expert offload only helps "
               "mixture-of-experts models")
    if isinstance(offload, Placement):
        if problem := _host_ram_problem(entry, model, offload, ctx):
            return problem
        if not _held(ctx, want):
            alternative = _across_boards(entry, model, want, ctx)
            if isinstance(alternative, Placement):
                offload.reasons.insert(3, _boards_alternative(entry, want, alternative, ctx))
                for index in alternative.gpus.gpus if alternative.gpus else ():
                    if index not in offload.gpus.gpus:
                        ctx.spill_alternatives[index] = entry.id
        return offload
    if not _held(ctx, want):
        boards = _across_boards(entry, model, want, ctx)
        if isinstance(boards, Placement) and want.spill is None:
            return _host_ram_problem(entry, model, boards, ctx) or boards
    if isinstance(offload, tuple):
        where, missed = offload
        why = "the rest of the model does not fit the cards even with every expert in host RAM"
        return _refusal(entry, model, missed, where, why) + pinned + _boards_note(boards) + _mix_hint(ctx, entry, want)
    return _refusal(entry, model, miss, gset, offload) + pinned + _boards_note(boards) + _mix_hint(ctx, entry, want)


def _boards_alternative(entry: ModelEntry, want: WantedModel, alternative: Placement, ctx: Context) -> str:
    """What ``spill: boards`` would do instead of host RAM, without naming cards the plan leaves idle."""
    gset, fit = alternative.gpus, alternative.fit
    count = len({ctx.pool.board_of(i) for i in gset.gpus}) if gset else 0
    chose = ("as the fleet asks (spill: host)" if want.spill == "host" else
             "the default while one board can hold it so; the fleet chooses with spill: host or spill: boards")
    return (f"experts in host RAM inside one board rather than the whole model across boards, {chose}: spill: boards would hold "
            f"{entry.id} whole on {count} boards together ({gset.size if gset else 0} cards, {gset.total_mib if gset else 0} "
            f"MiB) at {fit.ctx} tokens, with every token crossing PCIe between the boards and those boards taken from "
            f"the other models")


def _boards_note(boards: Placement | tuple[GpuSet, Miss] | None) -> str:
    if isinstance(boards, Placement) and boards.gpus is not None:
        return (f"; spill: boards (the fleet asks for spill: host) would hold it whole across boards, "
                f"{boards.gpus.size} cards ({boards.gpus.total_mib} MiB) at {boards.fit.ctx} tokens, every token "
                f"crossing PCIe between them")
    if isinstance(boards, tuple):
        where, miss = boards
        return (f"; nor do the fewest free boards together ({where.size} cards, {where.total_mib} MiB): they would "
                f"need {sum(miss.need_mib):.0f} MiB at {miss.ctx} tokens")
    return ""


def place_cpu(entry: ModelEntry, model: MemoryModel, want: WantedModel, ctx: Context) -> Placement | str:
    req = _request(entry, model, want, "upstream", cpu=True)
    budget = (ctx.ram_free_mib - HOST_RESERVE_MIB) if ctx.ram_free_mib is not None else float("inf")
    result = fitting.fit_cpu(model, req, budget)
    if isinstance(result, Miss):
        return _refusal(entry, model, result, None)
    engine = _engine(ctx.catalog, "upstream", cpu=True, preferred=entry.engine)  # a CPU build the fleet names
    idle = "; ".join(f"GPU {gpu.index} {gpu.name}: {why}" for gpu, why in idle_cards(ctx))
    reasons = ["no V100 on this box, nor another card a GPU build of the engine catalog runs on: serving on the CPU "
               "with the CPU engine build" + (f" ({idle})" if idle else ""),
               _engine_reason(entry, engine), _ctx_reason(result, req)]
    return Placement(None, result, engine, False, reasons, req.ubatch)


def gpu_engines(catalog: Catalog) -> list[EngineEntry]:
    return [engine for engine in catalog.engines.values() if not engine.cpu_only]


def gpu_builds_run(ctx: Context) -> bool:
    """Whether some GPU build of the catalog runs on a card of the box (else the box serves on the CPU)."""
    return any(_runs(engine, [gpu.arch]) for engine in gpu_engines(ctx.catalog) for gpu in ctx.pool.gpus.values())


def idle_cards(ctx: Context) -> list[tuple[Gpu, str]]:
    """Every card of the box no service uses, with why."""
    engines = gpu_engines(ctx.catalog)
    built = ", ".join(sorted({arch_label(a) for e in engines for a in e.cuda_archs or []})) or "none"
    out = []
    for gpu in ctx.profile.gpus:
        if gpu.index in ctx.pool.taken:
            continue
        if gpu.index not in ctx.pool.gpus:
            why = "the probe did not report its memory, so nothing can be sized for it"
        elif gpu.arch is None:
            why = "its compute capability is unknown, so no engine build can be matched to it"
        elif not any(_runs(engine, [gpu.arch]) for engine in engines):
            why = (f"no engine pack of the catalog is built for {arch_label(gpu.arch)} (the GPU packs are built for "
                   f"{built}); declare one whose cuda_archs include {gpu.arch} in a catalog file")
        elif gpu.index in ctx.spill_alternatives:
            why = (f"free: {ctx.spill_alternatives[gpu.index]} keeps its experts in host RAM inside one board; "
                   f"spill: boards on it would use this card")
        else:
            why = "free: no wanted model was placed on it"
        out.append((gpu, why))
    return out
