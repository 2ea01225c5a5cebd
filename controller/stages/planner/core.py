"""The serving plan of a box: placement, then each service's settings, command line and sources.

``plan_models`` places every wanted model (``controller.stages.planner.placement``), settles each
service's settings with a reason for each, has ``controller.stages.planner.commandline`` spell them for the
pinned engine version, and resolves what the box must fetch (``controller.stages.planner.sources``). The
result is complete: rendering the inventory only projects it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from controller.errors import PlanError, ProbeError
from controller.model.catalog import Catalog, EngineEntry, ModelEntry
from controller.model.fleet import Box, Mirror, WantedModel
from controller.model.profile import HardwareProfile
from controller.model.rules import DEFAULT_MODEL_DIR, PRESET_DIR, TEMPLATE_DIR, box_path
from controller.model.serveplan import (
    IdleGpu,
    ModelFile,
    OnDemandModel,
    OnDemandPlan,
    ServePlan,
    Service,
    ServiceMemory,
    Unplaced,
)
from controller.stages.estimate.gguf_header import GGUFHeader
from controller.stages.planner import draft as drafting
from controller.stages.planner import fit as fitting
from controller.stages.planner import sandbox, sources
from controller.stages.planner.commandline import (
    CACHE_RAM_MIB,
    GPU_STOP_TIMEOUT_S,
    command_line,
    environment,
    load_flags,
    preset_section,
    router_args,
)
from controller.stages.planner.placement import (
    HOST_RESERVE_MIB,
    RESIDENT_UBATCH,
    Context,
    Placement,
    agent_reason,
    agent_refusal,
    agent_shortfall,
    gpu_builds_run,
    idle_cards,
    pinned_engine_problem,
    place_cpu,
    place_gpu,
    swa_reason,
)
from controller.stages.planner.specs import MemoryModel, memory_model
from controller.stages.planner.topology import GpuPool

MTP_SPEC = "mtp:n_max=3,p_min=0.75"
BATCH = 2048
GPU_THREADS = 6


def service_name(model_id: str) -> str:
    return "llama-" + re.sub(r"[^a-z0-9._-]+", "-", model_id.lower())


# ---------------------------------------------------------------- engines

def _threads(ctx: Context, place: Placement) -> tuple[int, str]:
    cores = ctx.cores
    if place.gpus is None:
        return cores or 1, f"threads {cores or 1}: one per physical core, the whole model runs on the CPU"
    if cores is None:
        return GPU_THREADS, f"threads {GPU_THREADS}: the probe did not report the CPU's cores (the kit's GPU default)"
    if not place.offload:
        threads = min(GPU_THREADS, max(1, cores // 2))
        return threads, (f"threads {threads}: the model is GPU-resident, so more threads only add contention "
                         f"(-t 6 beats 12 in the kit); 6 or half the {cores} physical cores, whichever is fewer")
    return cores, f"threads {cores}: one per physical core, for the experts computed on the CPU"


def _ubatch_reason(place: Placement) -> str:
    if place.gpus is None:
        return f"ubatch {place.ubatch}: the CPU engine's default micro-batch"
    if place.offload:
        return (f"ubatch {place.ubatch}: with expert offload, larger micro-batches mean fewer trips to the CPU experts "
                f"(the kit's -ub 2048)")
    if place.ubatch == RESIDENT_UBATCH:
        return f"ubatch {place.ubatch}: GPU-resident (the kit's -ub 1024)"
    return (f"ubatch {place.ubatch}: at {RESIDENT_UBATCH} the compute buffers leave too little room for the context; "
            f"a smaller micro-batch only slows prompt processing, decoding is unchanged")


def _slots_reason(agents: int, engine: EngineEntry) -> str:
    if agents == 1:
        return "--parallel 1: one agent"
    how = ("ik_llama.cpp always keeps one KV cache for all slots (it has no --kv-unified flag)"
           if engine.family == "ik" else "--kv-unified")
    return (f"--parallel {agents} --cont-batching for {agents} agents, one KV cache shared by all slots ({how}) so "
            f"they share a common prompt prefix and the whole context")


def _mtp(entry: ModelEntry, model: MemoryModel, engine: EngineEntry) -> tuple[str | None, str | None]:
    """The --spec-type value (or None) and why."""
    if not entry.mtp:
        return None, None
    if model.spec is not None and model.spec.n_layer_all == model.spec.n_layer:
        return None, "no MTP speculative decoding: the GGUF header shows no MTP layer"
    if engine.family != "ik":
        return None, f"no MTP speculative decoding: {engine.id} cannot draft with the model's MTP head"
    return MTP_SPEC, f"MTP speculative decoding (--spec-type {MTP_SPEC}): the GGUF carries the model's MTP head"


def _template_reason(entry: ModelEntry) -> str:
    if entry.template:
        return (f"no-think chat template {entry.template} with --jinja: agents want thinking off (and the template "
                f"accepts system messages that are not first, as Claude Code sends them)")
    return "--jinja with the GGUF's own chat template: the catalog has no no-think variant for this model"



def _auth_reason(engine: EngineEntry) -> str:
    """The role adds the key and slot flags (it knows where the key file is); say how this engine gets them."""
    unread = "" if engine.api_key.env else f"; {engine.id} reads no API key from the environment"
    return (f"API key required: {engine.api_key.file_flag} reads the box's key file through a systemd credential, "
            f"never on the command line{unread}; {' '.join(engine.no_slots_flags) or 'no flag'} turns the slot "
            f"endpoints off unless the instance sets slots: true")



def _env_reason(env: dict[str, str], gpus: Sequence[int]) -> list[str]:
    if not env:
        return []
    reason = f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}: the service sees only its own cards"
    if "CUDA_DEVICE_ORDER" in env:
        reason += (", by nvidia-smi index because the profile records no UUID for them; CUDA_DEVICE_ORDER=PCI_BUS_ID "
                   "so that CUDA numbers the cards by PCI bus as nvidia-smi does, not fastest first")
    else:
        order = ", ".join(f"CUDA{position} is GPU {index}" for position, index in enumerate(gpus))
        reason += (f", named by UUID so that no numbering (nvidia-smi's by PCI bus, CUDA's fastest first) can give it "
                   f"another card; CUDA numbers them in this order ({order})")
    return [reason]


def _service(index: int, name: str, want: WantedModel, entry: ModelEntry, model: MemoryModel, place: Placement,
             ctx: Context, host: str, port: int, os: str, model_dir: str, template_dir: str) -> tuple[Service, float]:
    """The service for a placement, with its settings, command line and every reason; returns it and its host RAM."""
    fit, engine, gset = place.fit, place.engine, place.gpus
    reasons = list(place.reasons)
    swa = swa_reason(entry, model, fit.ctx)
    threads, threads_reason = _threads(ctx, place)
    spec_decoding, mtp_reason = _mtp(entry, model, engine)
    cards = [next(gpu for gpu in ctx.profile.gpus if gpu.index == index) for index in (gset.gpus if gset else ())]
    env = environment(place, cards)
    reasons += [r for r in (agent_reason(want, fit.ctx), swa, threads_reason, _ubatch_reason(place),
                            _slots_reason(want.agents, engine), mtp_reason, _template_reason(entry)) if r]
    reasons += _env_reason(env, gset.gpus if gset else ())
    minors, deny_wx = [], False
    if os == "linux":  # systemd's sandbox; a Windows service has no device list
        minors, device_reasons = sandbox.device_minors(cards)
        deny_wx, wx_reason = sandbox.deny_write_execute(engine, cards)
        reasons += [*device_reasons, wx_reason]
    reasons.append(f"port {port}: the box's base port plus the model's place ({index}) in the wanted list")
    reasons.append(_auth_reason(engine))
    cpu_mib = fit.device_mib[-1]
    cram = engine.family == "ik" and gset is not None and (
        ctx.ram_free_mib is None or ctx.ram_free_mib - cpu_mib >= CACHE_RAM_MIB + HOST_RESERVE_MIB)
    if cram:
        reasons.append(f"-cram {CACHE_RAM_MIB}: up to 16 GiB of prompt cache in host RAM, so agents' 22-24k-token "
                       f"system prompts restore instead of being prefilled again")
    if place.offload:
        reasons.append(f"{' '.join(load_flags(engine, mlock=True))}: the experts in host RAM must never be paged out")
    reasons.append(f"memory estimated from {getattr(model, 'source', 'the catalog')}")
    reasons += [f"note: {note}" for note in model.notes]
    memory = {f"cuda{g}": round(v) for g, v in zip(gset.gpus, fit.device_mib)} if gset else {}
    memory["cpu"] = round(cpu_mib)
    layers = (model.spec.n_layer_all + 1) if model.spec is not None else 0
    service = Service(
        name=name, model=entry.id, models=[entry.id], model_file=entry.file, engine=engine.id, gpus=list(gset.gpus) if gset else [],
        split_mode=fit.split_mode if gset is not None and gset.size > 1 else "none", ctx=fit.ctx,
        parallel=want.agents, kv_unified=want.agents > 1 or engine.family == "ik", cache_type_k=fit.cache,
        cache_type_v=fit.cache, ubatch=place.ubatch, batch=BATCH, threads=threads,
        n_gpu_layers=max(99, layers) if gset is not None else 0, cpu_offload=place.offload,
        spec_decoding=spec_decoding, template=entry.template, host=host, port=port, env=env,
        memory=ServiceMemory(per_device_mib=memory), reasons=reasons,
        mlock=place.offload, nccl=env.get("GGML_CUDA_ALLREDUCE") == "nccl",
        template_file=box_path(os, template_dir, entry.template) if entry.template else None,
        gpu_minors=minors, memory_deny_write_execute=deny_wx,
    )
    service.args = command_line(service, place, box_path(os, model_dir, entry.file), cram)
    return service, cpu_mib + (CACHE_RAM_MIB if cram else 0)


def plan_models(wanted: Sequence[WantedModel], profile: HardwareProfile, catalog: Catalog, *, host: str = "127.0.0.1",
                base_port: int = 8001, model_dir: str | None = None, os: str | None = None,
                mirror: Mirror | None = None, headers: Mapping[str, str | GGUFHeader] | None = None,
                on_demand_max: int | None = None) -> ServePlan:
    """Plan every wanted model on one box; models that cannot be placed are listed with the numbers.

    ``os`` defaults to the probed OS (else Linux) and ``model_dir`` to that OS's model folder; ``mirror``
    gives the download addresses (without it, models come from the hub and engine packs have none).
    ``headers`` maps catalog ids to a GGUF path/URL (or a header already read) whose header is used
    instead of the catalog's hyperparameters.
    """
    wanted = _group_pins(wanted)
    problem = profile.gpu_index_problem()
    if problem:  # the indices become CUDA_VISIBLE_DEVICES: never plan on a profile that misnames the GPUs
        raise ProbeError(f"the hardware profile cannot be planned for: {problem}; probe the box again")
    os = os or profile.os.family or "linux"
    model_dir = model_dir or DEFAULT_MODEL_DIR[os]
    template_dir = TEMPLATE_DIR[os]
    headers = headers or {}
    entries = [_on_router(_pinned(catalog.model(want.id), want, catalog), want, catalog) for want in wanted]
    for entry in entries:  # a pinned pack that no card here can run: refuse before planning anything
        if mismatch := pinned_engine_problem(entry, catalog, profile):
            raise PlanError(mismatch)
    models = [memory_model(entry, headers.get(entry.id)) for entry in entries]
    pairs = [drafting.choose(want, entry, model, catalog, headers) for want, entry, model in zip(wanted, entries, models)]
    models = [pair.memory if isinstance(pair, drafting.Pairing) else model for pair, model in zip(pairs, models)]
    pool = GpuPool(profile)
    ctx = Context(profile, catalog, pool, float(profile.memory_mib) if profile.memory_mib else None)
    names = _names(entries)
    unknown = ", ".join(f"GPU {g.index}" for g in profile.gpus if g.is_v100 and not g.memory_mib)
    results: dict[int, Service | Unplaced] = {}

    def place(i: int) -> tuple[Placement | str, str | None]:
        """Where model ``i`` goes (or why not), settling its draft; the agent refusal when that was it."""
        entry, want = entries[i], wanted[i]
        again = True
        while again:  # a second pass places the target alone when its auto draft must go
            if refused := agent_refusal(entry, models[i], want):
                where = refused
            elif gpu_builds_run(ctx):
                where = place_gpu(entry, models[i], want, ctx)
            elif unknown:
                where = (f"{entry.id}: the probe saw V100s ({unknown}) but not their memory, so nothing can be sized; "
                         f"re-run the probe (nvidia-smi output was cut short or failed)")
            else:
                where = place_cpu(entry, models[i], want, ctx)
            models[i], pairs[i], again = drafting.settle(pairs[i], where, models[i])
        return where, refused

    def unplaced(i: int, where: str, refused: str | None) -> Unplaced:
        return Unplaced(model=entries[i].id, reason=where + ("" if refused else agent_shortfall(wanted[i]))
                        + drafting.refusal_note(pairs[i]))

    def service_for(i: int, where: Placement, name: str, port: int) -> tuple[Service, float]:
        service, ram = _service(i, name, wanted[i], entries[i], models[i], where, ctx, host, port, os, model_dir,
                                template_dir)
        if isinstance(pairs[i], drafting.Pairing):
            drafting.attach(pairs[i], service, where.engine, box_path(os, model_dir, pairs[i].entry.file))
        elif pairs[i] is not None:
            service.reasons.append(pairs[i])
        return service, ram

    # A unit is one model, or an on-demand group: its models share one server and the same cards.
    units: list[list[int]] = []
    groups: dict[str, list[int]] = {}
    for i, want in enumerate(wanted):
        if want.group is None:
            units.append([i])
        elif want.group in groups:
            groups[want.group].append(i)
        else:
            units.append(groups.setdefault(want.group, [i]))
    # Pinned models first (their cards are the fleet's word), then the largest first, so big models get the boards.
    units.sort(key=lambda unit: (not any(wanted[i].pinned for i in unit),
                                 -max(fitting.weights_mib(models[i]) for i in unit), unit[0]))
    for unit in units:
        if wanted[unit[0]].group is not None:
            results.update(_place_group(unit, wanted, entries, models, ctx, place, unplaced, service_for,
                                        base_port=base_port, os=os, on_demand_max=on_demand_max))
            continue
        (i,) = unit
        where, refused = place(i)
        if isinstance(where, str):
            results[i] = unplaced(i, where, refused)
            continue
        service, ram = service_for(i, where, names[i], base_port + i)
        if where.gpus is not None:
            pool.take(where.gpus.gpus, entries[i].id)
        if ctx.ram_free_mib is not None:
            ctx.ram_free_mib -= ram
        results[i] = service
    services = [r for _, r in sorted(results.items()) if isinstance(r, Service)]
    unplaced = [r for _, r in sorted(results.items()) if isinstance(r, Unplaced)]
    unplaced += [Unplaced(model=service.draft.model, reason=service.draft.reasons[0])  # a refused draft: flagged
                 for service in services if service.draft is not None and not service.draft.compatible]
    engines = [sources.engine_pack(catalog.engine(engine_id), os, mirror)
               for engine_id in dict.fromkeys(service.engine for service in services)]
    files: dict[str, ModelFile] = {}  # one download per file, however many services load it
    for service in services:
        served = service.on_demand.models if service.on_demand is not None else [service]
        for item in served:
            model_id = item.id if service.on_demand is not None else item.model
            if item.model_file not in files:
                files[item.model_file] = sources.model_file(catalog.model(model_id), os, mirror)
            if item.draft is not None and item.draft.compatible and item.draft.model_file not in files:
                files[item.draft.model_file] = sources.model_file(catalog.model(item.draft.model), os, mirror)
    idle = [IdleGpu(index=gpu.index, name=gpu.name, arch=gpu.arch, reason=why) for gpu, why in idle_cards(ctx)]
    return ServePlan(fits=not unplaced, services=services, unplaced=unplaced, os=os, model_dir=model_dir,
                     template_dir=template_dir, engines=engines, models=list(files.values()), idle_gpus=idle)


def _group_pins(wanted: Sequence[WantedModel]) -> list[WantedModel]:
    """Where an on-demand group runs, as one of its models says it (gpus, board, spill, mix_cards), for all of them:
    whichever model is the largest is placed with it (the fleet file refuses a group whose models disagree)."""
    placement = ("gpus", "board", "spill", "mix_cards")
    stated = {want.group: {key: getattr(want, key) for key in placement} for want in wanted
              if want.group is not None and (want.pinned or want.spill or want.mix_cards)}
    return [want.model_copy(update=stated[want.group]) if want.group in stated else want for want in wanted]


def _on_router(entry: ModelEntry, want: WantedModel, catalog: Catalog) -> ModelEntry:
    """An on-demand model whose catalog entry asks for ik_llama.cpp (no router mode) is served by upstream."""
    if want.group is None or entry.engine in catalog.engines or entry.engine == "upstream":
        return entry
    return entry.model_copy(update={"engine": "upstream"})


def _group_name(group: str) -> str:
    return "llama-on-demand" if group == "default" else service_name(f"on-demand-{group}")


def _member_reasons(member: Service, catalogued: ModelEntry, want: WantedModel) -> list[str]:
    """A group model's own reasons: its port and key are the router's (the group's reasons say so), and its engine
    is upstream's where the catalog names ik_llama.cpp, which has no router mode."""
    reasons = [r for r in member.reasons if not r.startswith(("port ", "API key required"))]
    if catalogued.engine == "ik" and want.engine is None and reasons and reasons[0].startswith("engine "):
        reasons[0] = (f"engine {member.engine}, upstream llama.cpp: served on demand by its router mode; the catalog "
                      f"entry of {member.model} names ik_llama.cpp, which has no router mode at 022bd00a")
    return reasons


def _max_loaded(members: Sequence[tuple[Service, float]], cards: Sequence[int], ctx: Context,
                cap: int | None) -> tuple[int, str]:
    """How many of the group's models may be loaded at once, and why: the most whose largest estimates, card by
    card and in host RAM, fit together (each model's own estimate includes its CUDA context)."""
    budgets = {f"cuda{g}": float(ctx.pool.gpus[g].memory_mib or 0) - fitting.RESIDENT_MARGIN_MIB for g in cards}
    ram = ctx.ram_free_mib - HOST_RESERVE_MIB if ctx.ram_free_mib is not None else None

    def top(values: Sequence[float], k: int) -> float:
        return sum(sorted(values, reverse=True)[:k])

    def fits(k: int) -> bool:
        on_cards = all(top([s.memory.per_device_mib.get(device, 0) for s, _ in members], k) <= budget
                       for device, budget in budgets.items())
        return on_cards and (ram is None or top([r for _, r in members], k) <= ram)

    fit = max((k for k in range(1, len(members) + 1) if fits(k)), default=1)
    where = (", ".join(f"{device} {budget:.0f} MiB" for device, budget in budgets.items()) if budgets
             else f"{ram:.0f} MiB of host RAM" if ram is not None else "the host's memory")
    why = (f"--models-max {fit}: at most {fit} of the {len(members)} models fit at once ({where} usable; each "
           f"model's own estimate, its CUDA context included, the largest first)")
    if cap is not None and cap < fit:
        return cap, f"--models-max {cap}: the fleet's on_demand_max (up to {fit} would fit at once)"
    return fit, why


def _place_group(unit: Sequence[int], wanted: Sequence[WantedModel], entries: list[ModelEntry],
                 models: list[MemoryModel], ctx: Context, place, unplaced, service_for, *, base_port: int, os: str,
                 on_demand_max: int | None) -> dict[int, Service | Unplaced]:
    """An on-demand group: its largest model is placed as any model is; every other one is planned alone on the
    same cards with the same engine; one router serves them all from the port of the group's first model."""
    group = wanted[unit[0]].group or "default"
    name = _group_name(group)
    out: dict[int, Service | Unplaced] = {}
    if os == "windows":
        for i in unit:
            out[i] = Unplaced(model=entries[i].id, reason=(
                f"{entries[i].id}: on-demand group {group} needs the engine's router mode under a Linux unit; a Windows "
                f"box serves each model as a service of its own: drop on_demand"))
        return out
    for i in list(unit):  # an engine the fleet names for a model must be one the router can be
        named = ctx.catalog.engines.get(wanted[i].engine or "")
        if named is not None and named.router is None:
            out[i] = Unplaced(model=entries[i].id, reason=(
                f"{entries[i].id}: the fleet names engine {named.id} for it, which has no router mode in the engine "
                f"catalog (ik_llama.cpp at 022bd00a has none), so on-demand group {group} cannot serve it; drop its "
                f"engine: or its on_demand"))
    unit = [i for i in unit if i not in out]
    if not unit:
        return out
    order = sorted(unit, key=lambda i: (-fitting.weights_mib(models[i]), i))
    ctx.router = True
    try:
        return out | _group_on_cards(unit, order, group, name, wanted, entries, models, ctx, place, unplaced,
                                     service_for, base_port=base_port, os=os, on_demand_max=on_demand_max)
    finally:
        ctx.router = False


def _group_on_cards(unit: Sequence[int], order: Sequence[int], group: str, name: str, wanted: Sequence[WantedModel],
                    entries: list[ModelEntry], models: list[MemoryModel], ctx: Context, place, unplaced, service_for, *,
                    base_port: int, os: str, on_demand_max: int | None) -> dict[int, Service | Unplaced]:
    out: dict[int, Service | Unplaced] = {}
    first = order[0]
    where, refused = place(first)
    if isinstance(where, str):
        out[first] = unplaced(first, where, refused)
        for i in order[1:]:
            out[i] = Unplaced(model=entries[i].id, reason=(
                f"{entries[i].id}: on-demand group {group} has no cards: its largest model, {entries[first].id}, "
                f"could not be placed"))
        return out
    engine = where.engine
    if engine.router is None:
        for i in unit:
            out[i] = Unplaced(model=entries[i].id, reason=(
                f"{entries[i].id}: on-demand group {group} would run on {engine.id}, which has no router mode in the "
                f"engine catalog, so it cannot load models on demand; declare router: on that engine's entry if the "
                f"build has it (upstream llama.cpp does; ik_llama.cpp at 022bd00a does not), or drop on_demand"))
        return out
    cards = where.gpus.gpus if where.gpus is not None else ()
    placed = {first: where}
    for i in order[1:]:
        entries[i] = entries[i].model_copy(update={"engine": engine.id})  # one router: one engine build
        ctx.within = cards or None
        try:
            there, why = place(i)
        finally:
            ctx.within = None
        if isinstance(there, str):
            out[i] = unplaced(i, there + f"; on-demand group {group} holds its models on the cards of its largest, "
                              f"{entries[first].id}", why)
        else:
            placed[i] = there
    port = base_port + unit[0]
    members = {i: service_for(i, placed[i], name, port) for i in unit if i in placed}
    loaded, loaded_reason = _max_loaded(list(members.values()), cards, ctx, on_demand_max)
    preset_file = box_path(os, PRESET_DIR[os], f"{name}.ini")
    ordered = [i for i in unit if i in members]
    sections = {}
    for i in ordered:
        try:
            sections[i] = preset_section(members[i][0].args)
        except ValueError as exc:
            raise PlanError(f"{entries[i].id} in on-demand group {group}: {exc}") from None
    lead = members[ordered[0]][0]
    on_demand = OnDemandPlan(group=group, max_loaded=loaded, preset_file=preset_file,
                             key_file_env=engine.router.key_file_env, models=[
        OnDemandModel(id=member.model, model_file=member.model_file, template=member.template, ctx=member.ctx,
                      parallel=member.parallel, cache_type_k=member.cache_type_k, cache_type_v=member.cache_type_v,
                      gpus=member.gpus, split_mode=member.split_mode, cpu_offload=member.cpu_offload,
                      preset=sections[i] | ({engine.router.stop_timeout: str(GPU_STOP_TIMEOUT_S)} if cards else {}),
                      memory=member.memory, draft=member.draft,
                      reasons=_member_reasons(member, ctx.catalog.model(wanted[i].id), wanted[i]))
        for i, member in ((i, members[i][0]) for i in ordered)])
    devices = sorted({device for member, _ in members.values() for device in member.memory.per_device_mib})
    resident = {device: round(sum(sorted((m.memory.per_device_mib.get(device, 0) for m, _ in members.values()),
                                          reverse=True)[:loaded])) for device in devices}
    ids = [member.model for member in (members[i][0] for i in ordered)]
    reasons = [
        f"on demand (group {group}): {', '.join(ids)} behind one port and one key, served by {engine.id} in router "
        f"mode: a request naming a model loads it (the first waits for the load, sending nothing until then), and "
        f"the least recently used is unloaded when the next would not fit; /v1/models lists every one with its status",
        loaded_reason,
        f"each model is planned alone on the group's {'GPUs ' + ','.join(map(str, cards)) if cards else 'CPU'} with "
        f"its own context, cache and flags, written as its section of {preset_file}; the router's command line "
        f"carries only what applies to all of them",
        *([f"{engine.router.stop_timeout} {GPU_STOP_TIMEOUT_S} s: a model server on a GPU told to exit by the router "
           f"was measured still running at the default 10 s (an H100, driver 580), which every swap waited out; it "
           f"is killed after {GPU_STOP_TIMEOUT_S} s instead (nothing is in flight when the router unloads it)"]
          if cards else []),
        f"the key reaches the router and each model's own server as {engine.router.key_file_env} (a systemd "
        f"credential): the models' servers listen on loopback ports of their own and refuse a request without it",
        f"memory: up to {loaded} loaded at once, {', '.join(f'{d} {v} MiB' for d, v in resident.items())}",
    ]
    for i in ordered:
        catalog_entry = ctx.catalog.model(wanted[i].id)
        if catalog_entry.engine == "ik" and wanted[i].engine is None:
            reasons.append(f"{entries[i].id}: upstream rather than the ik_llama.cpp its catalog entry names, since "
                           f"ik_llama.cpp (022bd00a) has no router mode")
    group_service = lead.model_copy(update={
        "name": name, "models": ids, "port": port, "gpus": list(cards), "draft": None, "spec_decoding": None,
        "template": None, "template_file": None,
        "mlock": any(m.mlock for m, _ in members.values()), "nccl": any(m.nccl for m, _ in members.values()),
        "memory": ServiceMemory(per_device_mib=resident), "reasons": reasons,
        "args": router_args(engine, preset_file, loaded, lead.host, port), "on_demand": on_demand,
    })
    out[ordered[0]] = group_service  # one service, at its first model's place in the wanted list
    if cards:
        ctx.pool.take(tuple(cards), f"on-demand group {group}")
    if ctx.ram_free_mib is not None:
        ctx.ram_free_mib -= sum(sorted((ram for _, ram in members.values()), reverse=True)[:loaded])
    return out


def _pinned(entry: ModelEntry, want: WantedModel, catalog: Catalog) -> ModelEntry:
    """The catalog entry, with the engine the fleet names for this model (``engine:``) in place of its own."""
    if want.engine is None:
        return entry
    catalog.engine(want.engine)  # an unknown id is refused with the ids the catalog has
    return entry.model_copy(update={"engine": want.engine})


def _names(entries: Sequence[ModelEntry]) -> list[str]:
    """One unit name per service; the same model wanted twice gets -2, -3 ..."""
    names, counts = [], {}
    for entry in entries:
        counts[entry.id] = counts.get(entry.id, 0) + 1
        base = service_name(entry.id)
        names.append(base if counts[entry.id] == 1 else f"{base}-{counts[entry.id]}")
    return names


def plan_box(box: Box, profile: HardwareProfile, catalog: Catalog, wanted: list[WantedModel] | None = None,
             *, headers: Mapping[str, str | GGUFHeader] | None = None) -> ServePlan:
    """The serving plan for a fleet box: its wanted models on its probed hardware, its sources and its driver."""
    wanted = box.models if wanted is None else wanted
    if not wanted:
        raise PlanError(f"box {box.name}: no models wanted; add 'models:' with catalog ids to the fleet file")
    plan = plan_models(wanted, profile, catalog, host=box.bind, base_port=box.base_port,
                       model_dir=box.effective_model_dir, os=box.os, mirror=box.mirror, headers=headers,
                       on_demand_max=box.on_demand_max)
    plan.service_wrapper = sources.service_wrapper(box, catalog)
    plan.driver = sources.plan_driver(box, profile, catalog, nccl=any(service.nccl for service in plan.services))
    return plan
