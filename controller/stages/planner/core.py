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
from controller.model.rules import DEFAULT_MODEL_DIR, TEMPLATE_DIR, box_path
from controller.model.serveplan import IdleGpu, ModelFile, ServePlan, Service, ServiceMemory, Unplaced
from controller.stages.estimate.gguf_header import GGUFHeader
from controller.stages.planner import draft as drafting
from controller.stages.planner import fit as fitting
from controller.stages.planner import sandbox, sources
from controller.stages.planner.commandline import CACHE_RAM_MIB, command_line, environment, load_flags
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
                mirror: Mirror | None = None, headers: Mapping[str, str | GGUFHeader] | None = None) -> ServePlan:
    """Plan every wanted model on one box; models that cannot be placed are listed with the numbers.

    ``os`` defaults to the probed OS (else Linux) and ``model_dir`` to that OS's model folder; ``mirror``
    gives the download addresses (without it, models come from the hub and engine packs have none).
    ``headers`` maps catalog ids to a GGUF path/URL (or a header already read) whose header is used
    instead of the catalog's hyperparameters.
    """
    problem = profile.gpu_index_problem()
    if problem:  # the indices become CUDA_VISIBLE_DEVICES: never plan on a profile that misnames the GPUs
        raise ProbeError(f"the hardware profile cannot be planned for: {problem}; probe the box again")
    os = os or profile.os.family or "linux"
    model_dir = model_dir or DEFAULT_MODEL_DIR[os]
    template_dir = TEMPLATE_DIR[os]
    headers = headers or {}
    entries = [_pinned(catalog.model(want.id), want, catalog) for want in wanted]
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
    # Pinned models first (their cards are the fleet's word), then the largest first, so big models get the boards.
    order = sorted(range(len(wanted)), key=lambda i: (not wanted[i].pinned, -fitting.weights_mib(models[i]), i))
    for i in order:
        entry, model, want = entries[i], models[i], wanted[i]
        again = True
        while again:  # a second pass places the target alone when its auto draft must go
            if refused := agent_refusal(entry, model, want):
                place = refused
            elif gpu_builds_run(ctx):
                place = place_gpu(entry, model, want, ctx)
            elif unknown:
                place = (f"{entry.id}: the probe saw V100s ({unknown}) but not their memory, so nothing can be sized; "
                         f"re-run the probe (nvidia-smi output was cut short or failed)")
            else:
                place = place_cpu(entry, model, want, ctx)
            model, pairs[i], again = drafting.settle(pairs[i], place, model)
        if isinstance(place, str):
            results[i] = Unplaced(model=entry.id, reason=place + ("" if refused else agent_shortfall(want))
                                  + drafting.refusal_note(pairs[i]))
            continue
        service, ram = _service(i, names[i], want, entry, model, place, ctx, host, base_port + i, os, model_dir,
                                template_dir)
        if isinstance(pairs[i], drafting.Pairing):
            drafting.attach(pairs[i], service, place.engine, box_path(os, model_dir, pairs[i].entry.file))
        elif pairs[i] is not None:
            service.reasons.append(pairs[i])
        if place.gpus is not None:
            pool.take(place.gpus.gpus, entry.id)
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
        if service.model_file not in files:
            files[service.model_file] = sources.model_file(catalog.model(service.model), os, mirror)
        if service.draft is not None and service.draft.compatible and service.draft.model_file not in files:
            files[service.draft.model_file] = sources.model_file(catalog.model(service.draft.model), os, mirror)
    idle = [IdleGpu(index=gpu.index, name=gpu.name, arch=gpu.arch, reason=why) for gpu, why in idle_cards(ctx)]
    return ServePlan(fits=not unplaced, services=services, unplaced=unplaced, os=os, model_dir=model_dir,
                     template_dir=template_dir, engines=engines, models=list(files.values()), idle_gpus=idle)


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
                       model_dir=box.effective_model_dir, os=box.os, mirror=box.mirror, headers=headers)
    plan.service_wrapper = sources.service_wrapper(box, catalog)
    plan.driver = sources.plan_driver(box, profile, catalog, nccl=any(service.nccl for service in plan.services))
    return plan
