"""Does a model fit a GPU set (or the CPU), at which context and cache type, and with what to spare?

Every answer comes from the memory estimator (``controller.stages.estimate``) under the exact settings
the service will run with, against each device's memory less a margin:

* fully resident: the estimate (which already counts ~400 MiB of CUDA context per device) plus
  ``RESIDENT_MARGIN_MIB`` must fit every card. For the architectures whose graph the estimator
  mirrors, the compute buffers are the engine's own (its scheduler and allocator replayed on the
  model's graph: equal to what the CUDA server allocated in every recorded case), so the margin only
  has to hold what no buffer reports: the CUDA context, cuBLAS workspaces and the CUDA memory pool's
  scratch beyond the 400 MiB counted (``MEASURED_UNACCOUNTED_MIB``), and the driver's reservation; for
  other models it also absorbs the compute formula's error (``margin_reason`` says which per card);
* expert offload (ik_llama.cpp ``--fit``): the engine itself keeps ``--fit-margin`` MiB free on
  each card and moves the experts of as many layers as needed to host RAM; the plan predicts how
  many, and refuses when even the non-expert weights plus KV and compute do not fit.

Context comes first (the largest up to what was asked, or exactly what was asked), then the best
cache type at that context: f16, then q8_0; q4_0 only when neither reaches the context required.
A layer split moves whole layers, so the planner chooses how many go on each card.

The host's share of a GPU plan (the token embeddings, any layers or experts left on the CPU, and the
page-locked ``CUDA_Host`` compute and output buffers the CPU backend uses when a GPU exists) is the last
entry of every ``device_mib``: host RAM the box must have besides the system's reserve.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from controller.model.rules import DRIVER_BRANCHES
from controller.stages.estimate.memory import CUDA_OVERHEAD_MIB, MIB, EstimateInputError, Settings, resolve_settings
from controller.stages.planner.specs import MemoryModel, SizedMemory, SpecMemory
from controller.stages.planner.topology import GpuSet

RESIDENT_MARGIN_MIB = 768
# GPU memory the CUDA server used beyond its reported buffers (weights, KV, compute): the "unaccounted"
# column of the memory breakdown in the ten recorded cases of ../shared/fixtures/gpu-h100-580 (an H100 on the
# last driver branch that runs Volta):
# 595-600 MiB, 696 MiB where flash attention ran on the CPU and every layer's K/V crossed to the host.
MEASURED_UNACCOUNTED_MIB = (595, 696)
FIT_MARGIN_MIB = 1664  # the kit's --fit-margin for Qwen on one 16 GB V100
FIT_MARGIN_LONG_MIB = 2048  # the kit's margin above 131072 tokens of context
LONG_CTX = 131072
CACHE_PREFERENCE = ("f16", "q8_0", "q4_0")
OFFLOAD_CACHES = ("q8_0", "q4_0")  # every MiB of KV on the card pushes experts to the CPU
QUALITY_FLOOR = "q8_0"
CTX_STEP = 4096  # chosen (not asked-for) contexts are rounded down to this
KV_CELL = 256


@dataclass(frozen=True)
class Request:
    """What the service must offer: engine semantics, slots, micro-batch and context bounds."""

    engine: str  # estimator engine: "upstream" or "ik"
    parallel: int
    ubatch: int
    target_ctx: int
    min_ctx: int
    explicit: bool  # the context was asked for: exactly it, or no fit
    mtp: bool = False  # the MTP draft head keeps its own KV (ik_llama.cpp)
    caches: tuple[str, ...] = ()  # cache types to consider, best first; empty: the defaults for the placement


@dataclass
class Fit:
    """A configuration that fits, with the numbers the plan reports."""

    ctx: int
    cache: str
    split_mode: str
    shares: tuple[float, ...]
    device_mib: list[float]  # GPUs in set order, then the CPU
    largest_ctx: dict[str, int]  # per cache type, up to the target
    cpu_moe_layers: int = 0  # layers whose experts are in host RAM (expert offload)
    moe_layers: int = 0
    card_mib: tuple[int, ...] = ()  # memory of each card (ik_llama.cpp's --tensor-split)
    fit_margin: int = 0
    host_pinned_mib: float = 0.0  # of device_mib[-1]: page-locked CUDA_Host compute and output buffers
    compute_model: str = ""  # how the compute buffers were sized: "graph", "formula" or "allowance"


@dataclass
class Miss:
    """Why nothing fitted, in numbers: what the smallest acceptable setting needs per device."""

    need_mib: list[float]  # per GPU (or [CPU]) at the smallest acceptable context
    budget_mib: list[float]
    ctx: int
    largest_ctx: int  # 0 when even the weights do not fit
    detail: str = ""


def settings(model: MemoryModel, req: Request, gpus: GpuSet | None, ctx: int, cache: str, split: str,
             shares: tuple[float, ...] = (), cpu_moe: bool = False) -> Settings:
    """The server settings the service would run with, as the estimator takes them.

    ``shares`` are the split proportions (passed where the estimator expects per-GPU memory: it
    splits by their ratio). Only the upstream CPU backend repacks CPU-resident weights.
    """
    card_shares = tuple(shares or (gpus.memory_mib if gpus else ()))
    if model.spec is None:  # a model known by its size: no engine defaults to resolve
        return Settings(
            engine=req.engine, ctx=ctx, parallel=req.parallel, kv_unified=True, cache_type_k=cache,
            cache_type_v=cache, ubatch=req.ubatch, batch=2048, flash_attn=True, gpus=tuple(gpus.gpus) if gpus else (),
            gpu_mem_mib=card_shares, split_mode=split, n_gpu_layers=999, cpu_moe=cpu_moe)
    return resolve_settings(
        model.spec, engine=req.engine, ctx=ctx, parallel=req.parallel, kv_unified=req.parallel > 1,
        cache_type_k=cache, cache_type_v=cache, ubatch=req.ubatch, batch=2048, flash_attn="on",
        gpus=list(gpus.gpus) if gpus else [], gpu_mem_mib=list(card_shares), split_mode=split, cpu_moe=cpu_moe,
        cpu_repack=req.engine == "upstream")


def device_mib(model: MemoryModel, s: Settings, mtp: bool) -> list[float]:
    """Per-device MiB, plus the MTP head's own KV on the card holding the last layer."""
    values = model.device_mib(s)
    if mtp and isinstance(model, SpecMemory) and s.gpus:
        result = model.rest(s)
        full = max(1, result.kv.layers - result.kv.swa_layers)
        values[len(s.gpus) - 1] += result.kv.bytes_per_token / full * result.kv.cells / MIB
    return values


def _host_detail(model: MemoryModel, s: Settings) -> tuple[float, str]:
    """The page-locked part of the host's share, and how the compute buffers were sized."""
    if isinstance(model, SpecMemory):
        result = model.rest(s)
        plan = result.compute_plan
        return result.host_pinned_mib, plan.model if plan is not None else "formula"
    return 0.0, "allowance"


def margin_reason(fit: Fit, card_ids: tuple[int, ...], family: str = "ik") -> str:
    """Per card: the estimate, what stays free, and why that is enough (``family``: the engine's, for an offload)."""
    free = [m - v for v, m in zip(fit.device_mib, fit.card_mib)]
    cards = ", ".join(f"GPU {g}: {v:.0f} of {m} MiB, {f:.0f} MiB free"
                      for g, v, m, f in zip(card_ids, fit.device_mib, fit.card_mib, free))
    low, high = MEASURED_UNACCOUNTED_MIB
    spare = CUDA_OVERHEAD_MIB + RESIDENT_MARGIN_MIB - high
    if fit.fit_margin and family == "ik":
        kept = (f"ik_llama.cpp's --fit keeps {fit.fit_margin} MiB free on each card itself and moves experts to "
                f"the host until it does")
    elif fit.fit_margin:
        kept = (f"{fit.fit_margin} MiB is kept free on each card: --n-cpu-moe puts the experts of enough layers in "
                f"host RAM to leave it")
    else:
        kept = f"at least {RESIDENT_MARGIN_MIB} MiB is kept free on each card beyond the estimate"
    if fit.compute_model == "graph":
        why = (f"the estimate's compute buffers are the ones llama.cpp reserves (its scheduler and allocator "
               f"replayed on this model's graph; equal to the CUDA server's in every recorded case) and weights "
               f"and KV follow the loader's rules, so the margin only holds what no buffer reports: the CUDA "
               f"context, cuBLAS workspaces and the memory pool's scratch, measured at {low}-{high} MiB in all on "
               f"an H100 with the R{DRIVER_BRANCHES[-1]} driver, against the {CUDA_OVERHEAD_MIB:.0f} MiB counted plus this margin ({spare:.0f} MiB "
               f"to spare at the worst measured)")
    elif fit.compute_model == "formula":
        why = (f"this architecture's compute buffers come from a formula fitted to the CPU server (within 10 % "
               f"or 32 MiB there, not checked against CUDA), so the margin also absorbs its error on top of the "
               f"CUDA context and pool beyond the {CUDA_OVERHEAD_MIB:.0f} MiB counted (measured {low}-{high} MiB "
               f"in all on an H100 with the R{DRIVER_BRANCHES[-1]} driver)")
    else:
        why = ("without the model's shape the compute buffers are a flat allowance per card; the margin covers "
               "what the allowance misses")
    return f"memory per card: {cards}; {kept}: {why}"


def host_reason(fit: Fit) -> str:
    """The host RAM a GPU plan takes: its share of the weights and the page-locked buffers."""
    host = fit.device_mib[-1] if fit.device_mib else 0.0
    text = f"host RAM: {host:.0f} MiB for this service (token embeddings and anything left on the CPU"
    if fit.host_pinned_mib:
        text += (f", of which {fit.host_pinned_mib:.0f} MiB is page-locked CUDA_Host memory: the graph inputs the "
                 f"GPU reads (KQ mask, token ids, embeddings of a micro-batch) and the logits, which cannot be "
                 f"swapped out")
    return text + "); counted against the box's free RAM with the system's reserve"


def _fits(values: list[float], budgets: list[float]) -> bool:
    return all(v <= b for v, b in zip(values, budgets))


def _largest(ok: Callable[[int], bool], target: int) -> int:
    """The largest context (the target, or a multiple of 256 below it) that ``ok`` accepts; 0 for none.

    Memory grows with the context, so a binary search over 256-cell steps finds it.
    """
    if ok(target):
        return target
    low, high = 0, target // KV_CELL
    while low < high:
        mid = (low + high + 1) // 2
        if ok(mid * KV_CELL):
            low = mid
        else:
            high = mid - 1
    return low * KV_CELL


def largest_ctx(model: MemoryModel, req: Request, gpus: GpuSet | None, cache: str, split: str,
                shares: tuple[float, ...], budgets: list[float], cpu_moe: bool = False) -> int:
    """The largest context (at most the target) whose estimate fits every card's budget."""
    def ok(ctx: int) -> bool:
        s = settings(model, req, gpus, ctx, cache, split, shares, cpu_moe)
        return _fits(device_mib(model, s, req.mtp), budgets)

    return _usable(ok, req.target_ctx)


def _usable(ok: Callable[[int], bool], target: int) -> int:
    """``_largest``, or 0 for a cache type this model's heads cannot use (a quantised cache needs head widths
    divisible by its block: a model with 16-wide heads gets f16, never a crash)."""
    try:
        return _largest(ok, target)
    except EstimateInputError:
        return 0


def _smallest_usable(caches: tuple[str, ...], need: Callable[[str], list[float]]) -> list[float]:
    """What the smallest cache type this model can use needs: the figures a "does not fit" line quotes."""
    for cache in reversed(caches):
        try:
            return need(cache)
        except EstimateInputError:
            continue
    return need("f16")


def _chosen_ctx(largest: int, req: Request) -> int:
    if req.explicit or largest >= req.target_ctx:
        return min(largest, req.target_ctx)
    return largest // CTX_STEP * CTX_STEP if largest >= CTX_STEP else largest


def _pick(largest: dict[str, int], req: Request) -> tuple[str, int] | None:
    """Largest context first (up to the target), then the best cache type that reaches it.

    Types below ``QUALITY_FLOOR`` (q4_0: its K cache measurably hurts answers; the kit never uses it
    on one card) are taken only when no better type reaches the required context.
    """
    required = req.target_ctx if req.explicit else req.min_ctx
    order = list(largest)
    floor = order.index(QUALITY_FLOOR) + 1 if QUALITY_FLOOR in order else len(order)
    for pool in (order[:floor], order):
        best = max((largest[c] for c in pool), default=0)
        if best >= required:
            cache = next(c for c in pool if largest[c] == best)
            return cache, _chosen_ctx(best, req)
    return None


def _overflow(model: MemoryModel, req: Request, gpus: GpuSet, split: str, shares: tuple[float, ...], ctx: int,
              budgets: list[float]) -> tuple[float, ...]:
    """Each card's estimate less its budget, worst first (the objective the balancing lowers)."""
    s = settings(model, req, gpus, ctx, "q8_0", split, shares)
    values = device_mib(model, s, req.mtp)[: gpus.size]
    return tuple(sorted((v - b for v, b in zip(values, budgets)), reverse=True))


def _count_shares(counts: list[int]) -> tuple[float, ...]:
    """Split proportions that put exactly ``counts`` layer slots on each card.

    llama.cpp gives slot j (of n) to the first card whose cumulative split exceeds j/n; putting each
    boundary half a slot early keeps float rounding from moving a layer across it.
    """
    shares = [float(c) for c in counts]
    shares[0] -= 0.5
    shares[-1] += 0.5
    return tuple(shares)


def _cascade(counts: list[int], worst: int, step: int, objective, best: tuple[float, ...]):
    """Pass one layer slot from ``worst`` along its neighbours in one direction until a card absorbs it.

    Returns (objective, counts) for the first hop that lowers the objective, or None.
    """
    moved = list(counts)
    here = worst
    while 0 <= here + step < len(moved) and moved[here] > 1:
        moved[here] -= 1
        moved[here + step] += 1
        score = objective(moved)
        if score < best:
            return score, moved
        here += step
    return None


def balanced_shares(model: MemoryModel, req: Request, gpus: GpuSet, split: str, budgets: list[float]) -> tuple[float, ...]:
    """Split proportions that leave each card as much of its budget free as the layers allow.

    Layer split moves whole layers: start from a split by memory and move boundary layers from the
    most overloaded card to a neighbour while that lowers the worst overflow (the last card also
    holds the output layer, the first often one layer too many). Tensor split divides every
    tensor: scale each card's share by how far its estimate is from its budget.
    """
    memory = tuple(float(m) for m in gpus.memory_mib)
    if gpus.size == 1 or not isinstance(model, SpecMemory):
        return memory
    ctx = req.target_ctx if req.explicit else req.min_ctx
    if split == "tensor":
        shares = memory
        for _ in range(4):
            s = settings(model, req, gpus, ctx, "q8_0", split, shares)
            values = device_mib(model, s, req.mtp)[: gpus.size]
            raw = [share * budget / max(value, 1.0) for share, budget, value in zip(shares, budgets, values)]
            shares = tuple(round(r / sum(raw), 4) for r in raw)
        return shares
    slots = model.spec.n_layer_all + 1
    counts = [int(slots * m / sum(memory)) for m in memory]
    for k in sorted(range(gpus.size), key=lambda k: -(slots * memory[k] / sum(memory) - counts[k]))[: slots - sum(counts)]:
        counts[k] += 1
    best = _overflow(model, req, gpus, split, _count_shares(counts), ctx, budgets)
    for _ in range(4 * slots):
        values = settings(model, req, gpus, ctx, "q8_0", split, _count_shares(counts))
        over = [v - b for v, b in zip(device_mib(model, values, req.mtp)[: gpus.size], budgets)]
        worst = max(range(gpus.size), key=lambda k: over[k])
        tried = [move for step in (-1, 1) if (move := _cascade(counts, worst, step, lambda c: _overflow(
            model, req, gpus, split, _count_shares(c), ctx, budgets), best))]
        if not tried:
            break
        best, counts = min(tried)
    return _count_shares(counts)


def fit_resident(model: MemoryModel, req: Request, gpus: GpuSet, split: str) -> Fit | Miss:
    """Every layer on the cards of ``gpus``; context and cache type as large and as good as fit."""
    budgets = [m - RESIDENT_MARGIN_MIB for m in gpus.memory_mib]
    shares = balanced_shares(model, req, gpus, split, budgets) if gpus.size > 1 else ()
    largest = {c: largest_ctx(model, req, gpus, c, split, shares, budgets) for c in req.caches or CACHE_PREFERENCE}
    picked = _pick(largest, req)
    if picked is None:
        return _miss(model, req, gpus, split, shares, budgets, max(largest.values()), "q4_0")
    cache, ctx = picked
    s = settings(model, req, gpus, ctx, cache, split, shares)
    pinned, how = _host_detail(model, s)
    return Fit(ctx, cache, split, shares, device_mib(model, s, req.mtp), largest, card_mib=gpus.memory_mib,
               host_pinned_mib=pinned, compute_model=how)


def _miss(model: MemoryModel, req: Request, gpus: GpuSet | None, split: str, shares: tuple[float, ...],
          budgets: list[float], largest: int, cache: str, cpu_moe: bool = False) -> Miss:
    ctx = req.target_ctx if req.explicit else req.min_ctx
    values = _smallest_usable(CACHE_PREFERENCE[:CACHE_PREFERENCE.index(cache) + 1], lambda c: device_mib(
        model, settings(model, req, gpus, ctx, c, split, shares, cpu_moe), req.mtp))
    need = values[: gpus.size] if gpus else values[-1:]
    return Miss(need, budgets, ctx, largest)


def fit_offload(model: MemoryModel, req: Request, gpus: GpuSet) -> Fit | Miss:
    """Expert offload: non-expert weights, KV and compute on the cards, experts spilling to host RAM.

    ik_llama.cpp's ``--fit`` keeps ``--fit-margin`` MiB free per card; the plan predicts how many
    layers' experts land on the CPU by spreading the estimate's overflow over the per-layer expert size.
    """
    margin = FIT_MARGIN_LONG_MIB if req.target_ctx > LONG_CTX else FIT_MARGIN_MIB
    budgets = [m - margin for m in gpus.memory_mib]
    split = "layer"
    shares = gpus.memory_mib if gpus.size > 1 else ()
    caches = req.caches or OFFLOAD_CACHES
    largest = {c: largest_ctx(model, req, gpus, c, split, shares, budgets, cpu_moe=True) for c in caches}
    picked = _pick(largest, req)
    if picked is None:
        miss = _miss(model, req, gpus, split, shares, budgets, max(largest.values()), "q4_0", cpu_moe=True)
        miss.detail = "with every expert in host RAM"
        return miss
    cache, ctx = picked
    margin = FIT_MARGIN_LONG_MIB if ctx > LONG_CTX else FIT_MARGIN_MIB
    budgets = [m - margin for m in gpus.memory_mib]
    all_cpu = device_mib(model, settings(model, req, gpus, ctx, cache, split, shares, cpu_moe=True), req.mtp)
    resident = device_mib(model, settings(model, req, gpus, ctx, cache, split, shares), req.mtp)
    n = gpus.size
    n_moe_layers = max(1, model.spec.n_layer)
    per_layer_gpu = max(sum(resident[:n]) - sum(all_cpu[:n]), 1e-9) / n_moe_layers
    per_layer_cpu = (all_cpu[n] - resident[n]) / n_moe_layers  # includes a repacked copy where the CPU makes one
    overflow = max(0.0, sum(resident[:n]) - sum(budgets))
    layers = min(n_moe_layers, math.ceil(overflow / per_layer_gpu))
    on_gpu = (n_moe_layers - layers) * per_layer_gpu
    room = [budget - base for base, budget in zip(all_cpu[:n], budgets)]
    gpu_mib = [base + on_gpu * free / max(sum(room), 1e-9) for base, free in zip(all_cpu[:n], room)]
    cpu_mib = resident[n] + layers * per_layer_cpu  # includes the page-locked compute and output buffers
    pinned, how = _host_detail(model, settings(model, req, gpus, ctx, cache, split, shares, cpu_moe=True))
    return Fit(ctx, cache, split, tuple(float(m) for m in shares), gpu_mib + [cpu_mib], largest,
               cpu_moe_layers=layers, moe_layers=n_moe_layers, fit_margin=margin, card_mib=gpus.memory_mib,
               host_pinned_mib=pinned, compute_model=how)


def fit_cpu(model: MemoryModel, req: Request, ram_budget_mib: float) -> Fit | Miss:
    """CPU-only serving: weights, KV and compute in host RAM."""
    budgets = [ram_budget_mib]
    caches = req.caches or CACHE_PREFERENCE

    def cpu_only(cache: str, ctx: int) -> float:
        return device_mib(model, settings(model, req, None, ctx, cache, "none"), False)[-1]

    largest = {cache: _usable(lambda ctx, c=cache: cpu_only(c, ctx) <= ram_budget_mib, req.target_ctx)
               for cache in caches}
    picked = _pick(largest, req)
    if picked is None:
        ctx = req.target_ctx if req.explicit else req.min_ctx
        return Miss(_smallest_usable(CACHE_PREFERENCE, lambda c: [cpu_only(c, ctx)]), budgets, ctx,
                    max(largest.values()))
    cache, ctx = picked
    return Fit(ctx, cache, "none", (), [cpu_only(cache, ctx)], largest)


def weights_mib(model: MemoryModel) -> int:
    """The model file's weights in MiB (rounded up), for refusal messages."""
    size = model.spec.size_bytes if model.spec is not None else model.size_bytes if isinstance(model, SizedMemory) else 0
    return -(-int(size) // MIB)

