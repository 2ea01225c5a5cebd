"""Plan which llama-server runs where, with which arguments, and why.

For each wanted model (largest first, so big models get the boards they need), the planner tries,
in order, and stops at the first that fits:

1. one card, fully resident — never split a model that fits one card;
2. several cards of one NVLink board, fully resident: layer split for MoE models, tensor split
   (with NCCL all-reduce) for dense ones, the fewest cards and the fattest links first;
3. for MoE models, expert offload to host RAM on the free board with the most memory
   (ik_llama.cpp ``--fit``; upstream ``--n-cpu-moe`` for sliding-window models);

and otherwise leaves the model unplaced with the numbers. A box without a usable V100 serves on
the CPU build. Every choice is recorded as a reason in the plan.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from controller.catalog import Catalog, EngineEntry, ModelEntry
from controller.errors import CatalogError, PlanError, ProbeError
from controller.estimate.gguf_header import GGUFHeader
from controller.estimate.memory import estimate, resolve_settings
from controller.fleet import Box, WantedModel
from controller.planner import fit as fitting
from controller.planner.fit import Fit, Miss, Request
from controller.planner.specs import MemoryModel, SizedMemory, SpecMemory, memory_model
from controller.planner.topology import GpuPool, GpuSet
from controller.profile import HardwareProfile
from controller.serveplan import ServePlan, Service, ServiceMemory, Unplaced

DEFAULT_CTX = 131072  # the kit's Qwen context; the planner takes the largest that fits up to this
MIN_AGENT_CTX = 32768  # agents send 22-24k-token system prompts; less is not worth serving
CPU_DEFAULT_CTX, CPU_MIN_CTX = 8192, 2048
SIZED_DEFAULT_CTX = 32768  # a model known only by its file size gets the kit's Gemma context
HOST_RESERVE_MIB = 4096  # the OS, the page cache the loader needs, Ansible's own processes
CACHE_RAM_MIB = 16384  # the kit's -cram for ik_llama.cpp
MTP_SPEC = "mtp:n_max=3,p_min=0.75"
RESIDENT_UBATCH, OFFLOAD_UBATCH, CPU_UBATCH = 1024, 2048, 512
# A resident model that misses by its compute buffers tries a smaller ubatch before more cards.
RESIDENT_UBATCHES = (RESIDENT_UBATCH, 512)
BATCH = 2048
GPU_THREADS = 6
TEMPLATE_DIR = "/etc/llama/templates"
WINDOWS_TEMPLATE_DIR = "C:\\llama\\templates"  # where roles/win_llama_service puts them


def service_name(model_id: str) -> str:
    return "llama-" + re.sub(r"[^a-z0-9._-]+", "-", model_id.lower())


# ---------------------------------------------------------------- engines


def _family(entry: ModelEntry, catalog: Catalog) -> str:
    if entry.engine in catalog.engines:
        return catalog.engines[entry.engine].family
    if entry.engine in ("upstream", "ik"):
        return entry.engine
    raise PlanError(f"model {entry.id}: unknown engine {entry.engine!r}; use upstream, ik or an engine id")


def _engine(catalog: Catalog, family: str, *, nccl: bool = False, cpu: bool = False,
            preferred: str | None = None) -> EngineEntry:
    if preferred in catalog.engines:
        chosen = catalog.engines[preferred]
        if chosen.family == family and chosen.nccl == nccl and chosen.cpu_only == cpu:
            return chosen
    for engine_id in sorted(catalog.engines):
        engine = catalog.engines[engine_id]
        if engine.family == family and engine.nccl == nccl and engine.cpu_only == cpu:
            return engine
    what = "CPU-only" if cpu else f"{family}{' NCCL' if nccl else ''}"
    raise CatalogError(f"the engine catalog has no {what} build; add one to engines.yml or a catalog file")


# ---------------------------------------------------------------- the plan of one service


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

    @property
    def cores(self) -> int | None:
        cpu = self.profile.cpu
        return cpu.cores or (cpu.threads // 2 if cpu.threads else None)


def _request(entry: ModelEntry, model: MemoryModel, want: WantedModel, engine: str, *, offload: bool = False,
             cpu: bool = False, ubatch: int | None = None) -> Request:
    sized = isinstance(model, SizedMemory) and not model.kv_bytes_per_token
    default = CPU_DEFAULT_CTX if cpu else SIZED_DEFAULT_CTX if sized else DEFAULT_CTX
    n_ctx_train = model.spec.n_ctx_train if model.spec is not None and model.spec.n_ctx_train else None
    target = want.ctx or min(default, n_ctx_train or default)
    minimum = CPU_MIN_CTX if cpu else min(MIN_AGENT_CTX, target)
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


def _resident(entry: ModelEntry, model: MemoryModel, want: WantedModel,
              ctx: Context) -> Placement | tuple[GpuSet, Miss] | None:
    """The fewest cards of one board that hold the whole model at an acceptable context.

    Without a fit, the miss on the largest set tried, for the refusal's numbers.
    """
    last_miss: tuple[GpuSet, Miss] | None = None
    preferred = _family(entry, ctx.catalog)
    for size, ubatch in ((size, ubatch) for size in range(1, ctx.pool.max_board + 1) for ubatch in RESIDENT_UBATCHES):
        split = "none" if size == 1 else "layer" if entry.moe else "tensor"
        family = "upstream" if entry.sliding_window or split == "tensor" else preferred
        req = _request(entry, model, want, "ik" if family == "ik" else "upstream", ubatch=ubatch)
        best: tuple[GpuSet, Fit] | None = None
        seen: dict[tuple[int, ...], Fit | Miss] = {}
        for gset in ctx.pool.candidates(size, powers_of_two=split == "tensor"):
            result = seen.get(gset.memory_mib)
            if result is None:
                result = seen[gset.memory_mib] = fitting.fit_resident(model, req, gset, split)
            if isinstance(result, Fit):
                if best is None or _rank(result) > _rank(best[1]):
                    best = (gset, result)
            elif last_miss is None or gset.total_mib > last_miss[0].total_mib or gset.gpus == last_miss[0].gpus:
                # the biggest set tried; for the same set, its last (smallest ubatch) attempt
                last_miss = (gset, result)
        if best is not None:
            gset, fit = best
            nccl = split == "tensor" and any(e.nccl for e in ctx.catalog.engines.values())
            engine = _engine(ctx.catalog, family, nccl=nccl, preferred=entry.engine)
            return Placement(gset, fit, engine, False, _placement_reasons(entry, gset, fit, split, engine, ctx, req),
                             req.ubatch)
    return last_miss


def _offload(entry: ModelEntry, model: MemoryModel, want: WantedModel, ctx: Context,
             resident_miss: tuple[GpuSet, Miss] | None) -> Placement | Miss | str:
    """Experts to host RAM on the free board with the most memory; a reason string when impossible."""
    if not isinstance(model, SpecMemory) or not model.spec.n_expert:
        return (f"expert offload needs the model's shape (which tensors are experts); {entry.id} has none in the "
                f"catalog: add arch/hparams or plan it from its GGUF header")
    gset = ctx.pool.largest_free_board()
    if gset is None:
        return "no free NVLink board is left for it"
    family = "upstream" if entry.sliding_window else "ik"
    req = _request(entry, model, want, "ik" if family == "ik" else "upstream", offload=True)
    result = fitting.fit_offload(model, req, gset)
    if isinstance(result, Miss):
        return result
    engine = _engine(ctx.catalog, family, preferred=entry.engine)
    reasons = _offload_reasons(entry, gset, result, engine, req, resident_miss)
    return Placement(gset, result, engine, True, reasons, req.ubatch)


# ---------------------------------------------------------------- reasons


def _mib(value: float) -> str:
    return f"{value:.0f} MiB"


def _ctx_reason(fit: Fit, req: Request) -> str:
    options = ", ".join(f"{cache} {tokens}" for cache, tokens in fit.largest_ctx.items())
    if req.explicit:
        return f"context {fit.ctx} tokens, as asked; cache {fit.cache} (largest context per cache type: {options})"
    return (f"context {fit.ctx} tokens: the largest (up to {req.target_ctx}) that fits, with the best cache type "
            f"that reaches it, {fit.cache} (largest context per cache type: {options})")


def _placement_reasons(entry: ModelEntry, gset: GpuSet, fit: Fit, split: str, engine: EngineEntry, ctx: Context,
                       req: Request) -> list[str]:
    per_card = ", ".join(f"GPU {g}: {_mib(v)} of {m}" for g, v, m in zip(gset.gpus, fit.device_mib, gset.memory_mib))
    reasons = []
    if gset.size == 1:
        reasons.append(
            f"fits one card, {gset.describe()}: {per_card} MiB estimated (weights, KV, compute, CUDA context) with "
            f"{fitting.RESIDENT_MARGIN_MIB} MiB kept free; a model that fits one card is fastest there "
            f"(Gemma 4: 99 tok/s on one card, 90 layer-split, 76 tensor-split on two)")
        if len(gset.board) > 1:
            reasons.append(f"one card of board {list(gset.board)}; the rest stay free for other models")
    else:
        reasons.append(
            f"does not fit one card at {req.min_ctx if not req.explicit else req.target_ctx} tokens of context; "
            f"{gset.size} cards inside one NVLink board, {gset.describe()}: {per_card} MiB estimated; never across "
            f"boards, where every step would cross PCIe/NUMA")
        reasons.append(f"the fattest links free for {gset.size} cards: NVLink x{gset.min_links} per pair "
                       f"(board {list(gset.board)})")
        if split == "layer":
            reasons.append("layer split (-sm layer): an MoE model keeps each layer's experts on one card "
                           "(Qwen3.6 35B on two V100s: 82.8 tok/s, all in VRAM); -sm row crashes for these models")
        else:
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
            reasons.append(f"--tensor-split {_split_arg(fit.shares)}: each card's share of every tensor, in "
                           f"proportion to the memory it has free")
    reasons.append(_ctx_reason(fit, req))
    return reasons


def _offload_reasons(entry: ModelEntry, gset: GpuSet, fit: Fit, engine: EngineEntry, req: Request,
                     resident_miss: tuple[GpuSet, Miss] | None) -> list[str]:
    n_layers = fit.cpu_moe_layers
    best = ""
    if resident_miss is not None:
        where, miss = resident_miss
        best = (f" (the largest, {where.describe()}, needs {', '.join(_mib(v) for v in miss.need_mib)} at {miss.ctx} "
                f"tokens; it would hold {miss.largest_ctx} tokens at most)")
    required = req.target_ctx if req.explicit else req.min_ctx
    reasons = [
        f"no free board holds {entry.id} entirely with {required} tokens of context{best}; it is a "
        f"mixture-of-experts model, so its experts spill to host RAM: {gset.describe()} keeps the attention, shared "
        f"weights and KV, and the experts of ~{n_layers} of {fit.moe_layers} layers "
        f"({_mib(fit.device_mib[-1])} of host RAM in all) run on the CPU",
    ]
    if engine.family == "ik":
        reasons.append(f"ik_llama.cpp with --fit --fit-margin {fit.fit_margin}: the engine sizes the offload itself and "
                       f"keeps {fit.fit_margin} MiB free per card (the kit's margin; 2048 above 131072 tokens); its "
                       f"CPU kernels for the offloaded experts are faster than upstream's")
    else:
        reasons.append(f"--n-cpu-moe {n_layers} on upstream llama.cpp: the sliding-window cache rules out ik_llama.cpp")
    reasons.append(_ctx_reason(fit, req))
    reasons.append("cache q8_0 or smaller with offload: every MiB of KV on the card pushes more experts to the CPU "
                   "and slows every turn")
    return reasons


def _swa_reason(entry: ModelEntry, model: MemoryModel, ctx_tokens: int) -> str | None:
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


def _split_arg(shares: Sequence[float]) -> str:
    total = sum(shares) or 1.0
    return ",".join(f"{share / total:.3g}" for share in shares)


def _tensor_split(fit: Fit, engine: EngineEntry, service: Service) -> str:
    """``--tensor-split`` as each engine reads it.

    Upstream's layer split counts layer slots, so the planner's whole-layer counts go verbatim;
    ik_llama.cpp balances layers by their bytes itself, so it gets each card's usable memory;
    tensor split divides every tensor by the shares.
    """
    if service.split_mode == "layer" and engine.family == "ik":
        return ",".join(str(m) for m in fit.card_mib)
    if service.split_mode == "layer":
        return ",".join(f"{share:g}" for share in fit.shares)
    return _split_arg(fit.shares)


def _join(folder: str, name: str) -> str:
    """A path on the box: Windows folders (C:\\...) keep their backslashes."""
    sep = "\\" if "\\" in folder else "/"
    return folder.rstrip("/\\") + sep + name


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


def _env(place: Placement, ctx: Context) -> tuple[dict[str, str], list[str]]:
    """CUDA_VISIBLE_DEVICES pinning (and the device order and all-reduce it depends on), with reasons."""
    if place.gpus is None:
        return {}, []
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, place.gpus.gpus))}
    reason = f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}: the service sees only its own cards"
    if ctx.pool.mixed:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        reason += ("; CUDA_DEVICE_ORDER=PCI_BUS_ID because the box mixes GPU models and CUDA would otherwise number "
                   "them fastest-first, unlike nvidia-smi")
    if place.fit.split_mode == "tensor" and place.engine.nccl:
        env["GGML_CUDA_ALLREDUCE"] = "nccl"
    return env, [reason]


def _auth_reason(engine: EngineEntry) -> str:
    """The role adds the key and slot flags (it knows where the key file is); say how this engine gets them."""
    unread = "" if engine.api_key.env else f"; {engine.id} reads no API key from the environment"
    return (f"API key required: {engine.api_key.file_flag} reads the box's key file through a systemd credential, "
            f"never on the command line{unread}; {' '.join(engine.no_slots_flags) or 'no flag'} turns the slot "
            f"endpoints off unless the instance sets slots: true")


def _args(service: Service, entry: ModelEntry, place: Placement, model_dir: str, cram: bool) -> list[str]:
    """The full llama-server command line, in the flags the chosen engine version accepts."""
    engine, fit = place.engine, place.fit
    args = [
        "--model", _join(model_dir, entry.file),
        "--alias", entry.id,
        "--host", service.host,
        "--port", str(service.port),
        "--ctx-size", str(service.ctx),
        "--parallel", str(service.parallel),
        "--threads", str(service.threads),
        "--batch-size", str(service.batch),
        "--ubatch-size", str(service.ubatch),
        "--cache-type-k", service.cache_type_k,
        "--cache-type-v", service.cache_type_v,
        "--jinja",
        "--metrics",
    ]
    if service.parallel > 1:
        args += ["--cont-batching"] + ([] if engine.family == "ik" else ["--kv-unified"])
    if service.n_gpu_layers:
        args += ["--n-gpu-layers", str(service.n_gpu_layers), "--flash-attn", "on"]
    if len(service.gpus) > 1:
        args += ["--split-mode", service.split_mode, "--tensor-split", _tensor_split(fit, engine, service)]
    if place.offload:
        args += (["--fit", "--fit-margin", str(fit.fit_margin)] if engine.family == "ik"
                 else ["--n-cpu-moe", str(fit.cpu_moe_layers)])
    if service.spec_decoding:
        args += ["--spec-type", service.spec_decoding]
    if service.template:
        windows = "\\" in model_dir  # a Windows box: its model folder is a drive path
        args += ["--chat-template-file", _join(WINDOWS_TEMPLATE_DIR if windows else TEMPLATE_DIR, service.template)]
    if cram:
        args += ["-cram", str(CACHE_RAM_MIB)]
    return args + engine.load_flags.get("mlock" if place.offload else "mmap", [])


def _service(index: int, name: str, want: WantedModel, entry: ModelEntry, model: MemoryModel, place: Placement,
             ctx: Context, host: str, port: int, model_dir: str) -> tuple[Service, float]:
    """The service for a placement, with its arguments and every reason; returns it and its host RAM."""
    fit, engine, gset = place.fit, place.engine, place.gpus
    reasons = list(place.reasons)
    swa = _swa_reason(entry, model, fit.ctx)
    threads, threads_reason = _threads(ctx, place)
    spec_decoding, mtp_reason = _mtp(entry, model, engine)
    env, env_reasons = _env(place, ctx)
    reasons += [r for r in (swa, threads_reason, _ubatch_reason(place), _slots_reason(want.agents, engine), mtp_reason,
                            _template_reason(entry)) if r]
    reasons += env_reasons
    reasons.append(f"port {port}: the box's base port plus the model's place ({index}) in the wanted list")
    reasons.append(_auth_reason(engine))
    cpu_mib = fit.device_mib[-1]
    cram = engine.family == "ik" and gset is not None and (
        ctx.ram_free_mib is None or ctx.ram_free_mib - cpu_mib >= CACHE_RAM_MIB + HOST_RESERVE_MIB)
    if cram:
        reasons.append(f"-cram {CACHE_RAM_MIB}: up to 16 GiB of prompt cache in host RAM, so agents' 22-24k-token "
                       f"system prompts restore instead of being prefilled again")
    if place.offload:
        reasons.append(f"{' '.join(engine.load_flags.get('mlock', []))}: the experts in host RAM must never be paged "
                       f"out")
    reasons.append(f"memory estimated from {getattr(model, 'source', 'the catalog')}")
    reasons += [f"note: {note}" for note in model.notes]
    memory = {f"cuda{g}": round(v) for g, v in zip(gset.gpus, fit.device_mib)} if gset else {}
    memory["cpu"] = round(cpu_mib)
    layers = (model.spec.n_layer_all + 1) if model.spec is not None else 0
    service = Service(
        name=name, model=entry.id, model_file=entry.file, engine=engine.id, gpus=list(gset.gpus) if gset else [],
        split_mode=fit.split_mode if gset is not None and gset.size > 1 else "none", ctx=fit.ctx,
        parallel=want.agents, kv_unified=want.agents > 1 or engine.family == "ik", cache_type_k=fit.cache,
        cache_type_v=fit.cache, ubatch=place.ubatch, batch=BATCH, threads=threads,
        n_gpu_layers=max(99, layers) if gset is not None else 0, cpu_offload=place.offload,
        spec_decoding=spec_decoding, template=entry.template, host=host, port=port, env=env,
        memory=ServiceMemory(per_device_mib=memory), reasons=reasons,
    )
    service.args = _args(service, entry, place, model_dir, cram)
    return service, cpu_mib + (CACHE_RAM_MIB if cram else 0)


# ---------------------------------------------------------------- refusals


def _refusal(entry: ModelEntry, model: MemoryModel, miss: Miss | None, gset: GpuSet | None, why: str = "") -> str:
    weights = fitting.weights_mib(model)
    if miss is None:
        return f"{entry.id} ({weights} MiB weights): {why or 'no usable V100 is free on this box'}"
    need = ", ".join(_mib(v) for v in miss.need_mib)
    budget = ", ".join(_mib(v) for v in miss.budget_mib)
    where = gset.describe() if gset is not None else "host RAM"
    largest = (f"the largest context that would fit is {miss.largest_ctx} tokens" if miss.largest_ctx
               else "not even the weights fit")
    detail = f" {miss.detail}" if miss.detail else ""
    text = (f"{entry.id} ({weights} MiB weights) does not fit: on {where}{detail} it needs {need} at {miss.ctx} "
            f"tokens of context, against {budget} usable; {largest}")
    return text + (f"; {why}" if why else "")


# ---------------------------------------------------------------- the box


def _place_gpu(entry: ModelEntry, model: MemoryModel, want: WantedModel, ctx: Context) -> Placement | str:
    if not ctx.pool.free:
        return (f"{entry.id} ({fitting.weights_mib(model)} MiB weights): every V100 on this box is already given to a "
                f"larger model planned first; list fewer models or add cards")
    resident = _resident(entry, model, want, ctx)
    if isinstance(resident, Placement):
        return resident
    gset, miss = resident if resident else (None, None)
    if not entry.moe:
        why = ("a dense model is split by tensor across the cards of one board at most; expert offload only helps "
               "mixture-of-experts models")
        return _refusal(entry, model, miss, gset, why)
    offload = _offload(entry, model, want, ctx, resident or None)
    if isinstance(offload, Placement):
        ram_need = offload.fit.device_mib[-1] + HOST_RESERVE_MIB
        if ctx.ram_free_mib is not None and ram_need > ctx.ram_free_mib:
            return (f"{entry.id} ({fitting.weights_mib(model)} MiB weights) does not fit any free board, and offloading "
                    f"its experts needs {_mib(offload.fit.device_mib[-1])} of host RAM plus {HOST_RESERVE_MIB} MiB "
                    f"for the system, but only {_mib(ctx.ram_free_mib)} is free; add RAM or a board with "
                    f"{fitting.weights_mib(model)} MiB of GPU memory")
        return offload
    if isinstance(offload, Miss):
        why = "the rest of the model does not fit the cards even with every expert in host RAM"
        return _refusal(entry, model, offload, ctx.pool.largest_free_board(), why)
    return _refusal(entry, model, miss, gset, offload)


def _place_cpu(entry: ModelEntry, model: MemoryModel, want: WantedModel, ctx: Context) -> Placement | str:
    req = _request(entry, model, want, "upstream", cpu=True)
    budget = (ctx.ram_free_mib - HOST_RESERVE_MIB) if ctx.ram_free_mib is not None else float("inf")
    result = fitting.fit_cpu(model, req, budget)
    if isinstance(result, Miss):
        return _refusal(entry, model, result, None)
    engine = _engine(ctx.catalog, "upstream", cpu=True)
    ignored = ", ".join(f"GPU {g.index} ({g.name})" for g in ctx.pool.ignored)
    reasons = ["no V100 on this box: serving on the CPU with the CPU engine build"
               + (f" ({ignored} cannot run the sm_70 builds)" if ignored else ""),
               _ctx_reason(result, req)]
    return Placement(None, result, engine, False, reasons, req.ubatch)


def plan_models(wanted: Sequence[WantedModel], profile: HardwareProfile, catalog: Catalog, *, host: str = "127.0.0.1",
                base_port: int = 8001, model_dir: str = "/var/lib/llama/models",
                headers: Mapping[str, str | GGUFHeader] | None = None) -> ServePlan:
    """Plan every wanted model on one box; models that cannot be placed are listed with the numbers.

    ``headers`` maps catalog ids to a GGUF path/URL (or a header already read) whose header is used
    instead of the catalog's hyperparameters.
    """
    problem = profile.gpu_index_problem()
    if problem:  # the indices become CUDA_VISIBLE_DEVICES: never plan on a profile that misnames the GPUs
        raise ProbeError(f"the hardware profile cannot be planned for: {problem}; probe the box again")
    headers = headers or {}
    entries = [catalog.model(want.id) for want in wanted]
    models = [memory_model(entry, headers.get(entry.id)) for entry in entries]
    pool = GpuPool(profile)
    ctx = Context(profile, catalog, pool, float(profile.memory_mib) if profile.memory_mib else None)
    names = _names(entries)
    unknown = ", ".join(f"GPU {g.index}" for g in profile.gpus if g.is_v100 and not g.memory_mib)
    results: dict[int, Service | Unplaced] = {}
    order = sorted(range(len(wanted)), key=lambda i: (-fitting.weights_mib(models[i]), i))
    for i in order:
        entry, model, want = entries[i], models[i], wanted[i]
        if pool.gpus:
            place = _place_gpu(entry, model, want, ctx)
        elif unknown:
            place = (f"{entry.id}: the probe saw V100s ({unknown}) but not their memory, so nothing can be sized; "
                     f"re-run the probe (nvidia-smi output was cut short or failed)")
        else:
            place = _place_cpu(entry, model, want, ctx)
        if isinstance(place, str):
            results[i] = Unplaced(model=entry.id, reason=place)
            continue
        service, ram = _service(i, names[i], want, entry, model, place, ctx, host, base_port + i, model_dir)
        if place.gpus is not None:
            pool.take(place.gpus.gpus)
        if ctx.ram_free_mib is not None:
            ctx.ram_free_mib -= ram
        results[i] = service
    services = [r for _, r in sorted(results.items()) if isinstance(r, Service)]
    unplaced = [r for _, r in sorted(results.items()) if isinstance(r, Unplaced)]
    return ServePlan(fits=not unplaced, services=services, unplaced=unplaced)


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
    """The serving plan for a fleet box: its wanted models on its probed hardware."""
    wanted = box.models if wanted is None else wanted
    if not wanted:
        raise PlanError(f"box {box.name}: no models wanted; add 'models:' with catalog ids to the fleet file")
    return plan_models(wanted, profile, catalog, host=box.bind, base_port=box.base_port,
                       model_dir=box.effective_model_dir, headers=headers)
