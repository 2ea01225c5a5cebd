"""Predict the memory a llama.cpp server will allocate, per device, from a GGUF header alone.

Three buffers dominate and each follows a rule read from the engine's source (llama.cpp 0c1e570,
the CPU test build, and ik_llama.cpp where it differs):

* weights: every tensor's bytes, placed where the loader puts it — the token embeddings with the
  input layer (always CPU), blocks by ``-ngl`` and the split mode, the output layer on the GPU only
  when ``-ngl`` covers it, routed experts on the CPU with ``--cpu-moe``;
* KV cache: per layer kind — full attention for the whole context, sliding-window layers sized by
  the window on upstream (its iSWA cache) but not on ik_llama.cpp, recurrent layers a fixed state
  per sequence, MLA a single compressed K; cells rounded up to 256; one stream (unified) or one per
  sequence; quantised cache types by their block size;
* compute: each backend's buffer for the worst-case graph of one micro-batch (ubatch tokens against
  every cell of the cache). For the architectures whose graph is mirrored (``controller.stages.estimate.graph``)
  on the upstream engine, the graph is built tensor by tensor and run through the engine's own
  scheduler and allocator rules (``controller.stages.estimate.sched``): which backend runs each node (weights
  in host memory are copied to the GPU for prompt-sized batches), which inputs each split copies, what
  is alive at once. With a GPU, the CPU backend's buffer is pinned host memory (``CUDA_Host``): the graph
  inputs (token ids, the KQ mask, the token embeddings) and whatever runs on the CPU. Other models
  and ik_llama.cpp use a formula fitted to the CPU server's buffers.

GPUs also carry the CUDA context and cuBLAS workspaces, which no GGUF describes: a fixed
per-device overhead is added so that a plan leaves room for it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from controller.stages.estimate import graph as graph_model
from controller.stages.estimate.ggml import BufferType
from controller.stages.estimate.model import (
    Layer,
    ModelSpec,
    cache_type,
    is_expert_tensor,
    is_input_tensor,
    tensor_layer,
)
from controller.stages.estimate.sched import MAX_COPIES, Backend, Scheduler

MIB = 1024 * 1024
KV_PAD = 256  # llama.cpp pads the context and the SWA cache to 256 cells (llama-context.cpp, llama-kv-cache-iswa.cpp)
IK_PAD_FA, IK_PAD_NO_FA = 256, 32  # ik_llama.cpp pads the cache to 256 cells with flash attention, 32 without
TENSOR_ALIGN = 32  # GGUF tensor data alignment; mapped CPU weights include it
CUDA_ROW_PADDING = 512  # ggml-cuda MATRIX_ROW_PADDING: quantised tensors get a partial row of padding
CUDA_OVERHEAD_MIB = 400.0  # CUDA context + cuBLAS workspace per device on a V100 (observed 300-450 MiB)
ENGINES = ("upstream", "ik")
SPLIT_MODES = ("none", "layer", "tensor")


class EstimateInputError(ValueError):
    """Settings that the engine itself would reject (bad cache type, mismatched GPU lists)."""


@dataclass(frozen=True)
class Settings:
    """Server settings after the engine's defaults are applied (what the server would actually use)."""

    engine: str
    ctx: int
    parallel: int
    kv_unified: bool
    cache_type_k: str
    cache_type_v: str
    ubatch: int
    batch: int
    flash_attn: bool
    gpus: tuple[int, ...]
    gpu_mem_mib: tuple[float, ...]
    split_mode: str
    n_gpu_layers: int
    cpu_moe: bool
    cpu_repack: bool = True


def resolve_settings(
    spec: ModelSpec,
    *,
    engine: str = "upstream",
    ctx: int | None = None,
    parallel: int | None = None,
    kv_unified: bool | None = None,
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
    ubatch: int | None = None,
    batch: int | None = None,
    flash_attn: str | bool | None = None,
    gpus: tuple[int, ...] | list[int] = (),
    gpu_mem_mib: tuple[float, ...] | list[float] = (),
    split_mode: str = "layer",
    n_gpu_layers: int | None = None,
    cpu_moe: bool = False,
    cpu_repack: bool = True,
) -> Settings:
    """Fill unset options with the engine's defaults for the pinned versions.

    Upstream llama-server (0c1e570, tools/server/server.cpp): with ``--parallel`` unset it runs
    4 slots over one unified KV cache; an explicit ``--parallel`` keeps per-slot caches unless
    ``--kv-unified`` is given. ``-c 0``/unset means the training context, per slot when the slots
    have their own caches (``--fit``, on by default, common/fit.cpp). Flash attention
    ``auto`` resolves to on for the CPU and CUDA backends. ik_llama.cpp (common.h): 1 slot, one
    cache shared by all slots, flash attention on.
    """
    if engine not in ENGINES:
        raise EstimateInputError(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
    if split_mode not in SPLIT_MODES:
        raise EstimateInputError(f"split mode {split_mode!r} is not one of {', '.join(SPLIT_MODES)}")
    for name in (cache_type_k, cache_type_v):
        try:
            cache_type(name)
        except ValueError as exc:
            raise EstimateInputError(str(exc)) from None
    gpus = tuple(gpus)
    mem = tuple(float(m) for m in gpu_mem_mib)
    if mem and len(mem) != len(gpus):
        raise EstimateInputError(f"--gpu-mem-mib has {len(mem)} values for {len(gpus)} GPUs; give one per GPU")
    if engine == "upstream":
        if parallel is None:
            parallel, unified = 4, True if kv_unified is None else kv_unified
        else:
            unified = bool(kv_unified)
    else:
        parallel, unified = parallel or 1, True
    if flash_attn is None or flash_attn == "auto":
        fa = True
    else:
        fa = flash_attn in (True, "on", "1", "true")
    if ctx:
        n_ctx = ctx
    elif engine == "upstream" and not unified:
        # --fit (on by default) resolves an unset context to the training context per stream (common/fit.cpp)
        n_ctx = spec.n_ctx_train * max(parallel, 1)
    else:
        n_ctx = spec.n_ctx_train
    batch = batch or 2048
    return Settings(
        engine=engine, ctx=n_ctx, parallel=max(parallel, 1), kv_unified=unified,
        cache_type_k=cache_type_k.lower(), cache_type_v=cache_type_v.lower(), ubatch=ubatch or 512, batch=batch,
        flash_attn=fa, gpus=gpus, gpu_mem_mib=mem, split_mode=split_mode,
        n_gpu_layers=(spec.n_layer_all + 1 if gpus else 0) if n_gpu_layers is None or n_gpu_layers < 0 else n_gpu_layers,
        cpu_moe=cpu_moe, cpu_repack=cpu_repack,
    )


def row_bytes(qtype: GGMLQuantizationType, width: int) -> int:
    """Bytes of one row of ``width`` elements in a (possibly block-quantised) type."""
    block, size = GGML_QUANT_SIZES[qtype]
    if width % block:
        raise EstimateInputError(f"a {qtype.name} cache needs head widths divisible by {block}; this model has {width}")
    return width // block * size


def _pad(value: int, to: int) -> int:
    return -(-value // to) * to


# ---------------------------------------------------------------- layer placement


@dataclass(frozen=True)
class Placement:
    """Device index (into the device list, CPU last) of each block, the output layer and the input layer."""

    devices: list[str]
    layer_device: list[int]
    output_device: int
    cpu: int
    shares: list[float]  # fraction of each split tensor per GPU (split mode tensor)


def place_layers(spec: ModelSpec, s: Settings) -> Placement:
    """Assign blocks to devices as llama_model::load_tensors does.

    The last ``-ngl`` of the n_layer+1 slots (blocks, then the output layer) go to the GPUs; with
    split mode layer the GPU slots are cut in proportion to each GPU's memory (the engine uses free
    memory, or ``--tensor-split``), with split mode none they all go to the first GPU.
    """
    names = [f"CUDA{k}" for k in range(len(s.gpus))] + ["CPU"]
    cpu = len(names) - 1
    n_all = spec.n_layer_all
    if not s.gpus:
        return Placement(names, [cpu] * n_all, cpu, cpu, [])
    weights = list(s.gpu_mem_mib) if s.gpu_mem_mib else [1.0] * len(s.gpus)
    total = sum(weights)
    shares = [w / total for w in weights]
    cumulative = [sum(shares[: k + 1]) for k in range(len(shares))]
    n_gpu = min(s.n_gpu_layers, n_all + 1)
    start = n_all + 1 - n_gpu

    def device_of(il: int) -> int:
        if il < start or n_gpu <= 0:
            return cpu
        if s.split_mode == "none" or len(s.gpus) == 1:
            return 0
        frac = (il - start) / n_gpu
        for k, edge in enumerate(cumulative):
            if frac < edge:
                return k
        return len(s.gpus) - 1

    return Placement(names, [device_of(il) for il in range(n_all)], device_of(n_all), cpu, shares)


def _spread(amount: float, device: int, place: Placement, s: Settings, per_device: list[float]) -> None:
    """Add ``amount`` to a device, or across all GPUs by share when split mode tensor splits it."""
    if s.split_mode == "tensor" and device != place.cpu and len(s.gpus) > 1:
        for k, share in enumerate(place.shares):
            per_device[k] += amount * share
    else:
        per_device[device] += amount


# ---------------------------------------------------------------- weights


# Weight types the CPU backend repacks into an interleaved copy on x86 with AVX2 (the kit's CPU
# floor), when a matrix has a multiple of 8 rows (ggml-cpu/repack.cpp, optimal repack type).
CPU_REPACK_TYPES = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.IQ4_NL,
                    GGMLQuantizationType.MXFP4}


def _repacked(tensor_type: int, shape: tuple[int, ...], name: str) -> bool:
    try:
        qtype = GGMLQuantizationType(tensor_type)
    except ValueError:
        return False
    return qtype in CPU_REPACK_TYPES and len(shape) in (2, 3) and shape[1] % 8 == 0 and not is_input_tensor(name)


def weights_per_device(spec: ModelSpec, s: Settings, place: Placement) -> list[float]:
    """Bytes of weights on each device (CPU last), padded as the loader maps them.

    CPU-resident matrices of the repackable types also get an interleaved copy (the
    ``CPU_REPACK`` buffer) while the mapped file stays mapped, so they count twice on the CPU. Only
    without a GPU: with one, the CPU's buffer types start with the GPU's pinned host buffer
    (llama-model.cpp ``make_cpu_buft_list``), which takes every weight before the repack type is tried.
    """
    per_device = [0.0] * len(place.devices)
    embd = 0
    for tensor in spec.tensors:
        size = _pad(tensor.nbytes, TENSOR_ALIGN)
        layer = tensor_layer(tensor.name)
        if is_input_tensor(tensor.name):
            per_device[place.cpu] += size
            if tensor.name == "token_embd.weight":
                embd = size
            continue
        if layer is None:
            device = place.output_device
        elif s.cpu_moe and is_expert_tensor(tensor.name):
            device = place.cpu
        else:
            device = place.layer_device[layer] if layer < len(place.layer_device) else place.output_device
        _spread(size, device, place, s, per_device)
        if device == place.cpu and s.cpu_repack and not s.gpus and _repacked(tensor.ggml_type, tensor.shape, tensor.name):
            per_device[place.cpu] += tensor.nbytes
    if spec.tied_embeddings and embd and place.output_device != place.cpu:
        # The output layer reuses the embedding matrix; offloaded, it is a second copy on the GPU.
        _spread(embd, place.output_device, place, s, per_device)
    return per_device


# ---------------------------------------------------------------- KV cache


@dataclass
class KVPlan:
    """Cells and bytes of the KV cache (and recurrent state) the context will allocate."""

    cells: int
    swa_cells: int
    streams: int
    layers: int
    swa_layers: int
    recurrent_layers: int
    bytes_per_token: int
    total_bytes: int
    per_device: list[float]
    recurrent_bytes: int


def kv_cells(spec: ModelSpec, s: Settings) -> tuple[int, int, int]:
    """(cells per stream, SWA cells per stream, streams) as llama_context and the caches compute them."""
    if s.engine == "ik":
        pad = IK_PAD_FA if s.flash_attn else IK_PAD_NO_FA
        cells = _pad(s.ctx, pad)
        return cells, cells, 1  # ik_llama.cpp has no iSWA cache: SWA layers get the full context
    n_ctx = _pad(s.ctx, KV_PAD)
    if s.kv_unified:
        cells, streams = n_ctx, 1
    else:
        cells, streams = _pad(n_ctx // s.parallel, KV_PAD), s.parallel
    n_ubatch = min(s.ubatch, s.batch, s.ctx)  # llama_context clamps the batches by -c before padding it
    swa = _pad(min(cells, spec.n_swa * (s.parallel if s.kv_unified else 1) + n_ubatch), KV_PAD)
    return cells, swa, streams


def _layer_kv_bytes_per_cell(layer: Layer, spec: ModelSpec, s: Settings, v_width_max: int) -> int:
    k_type, v_type = cache_type(s.cache_type_k), cache_type(s.cache_type_v)
    mla = spec.mla or (s.engine == "ik" and spec.arch.startswith("deepseek") and _ik_mla_width(spec) > 0)
    if mla:
        width = _ik_mla_width(spec) if not spec.mla else layer.k_width
        return row_bytes(k_type, width)
    # Without flash attention V is stored transposed and padded to the widest layer.
    v_width = layer.v_width if s.flash_attn else v_width_max
    return row_bytes(k_type, layer.k_width) + row_bytes(v_type, v_width)


def _cuda_padding(cache: str, width: int, rows: int) -> int:
    """Bytes a CUDA buffer adds to one cache tensor: a quantised tensor gets one more partial row, up to
    512 elements (``ggml_backend_cuda_buffer_type_get_alloc_size``), and every tensor starts on 128 bytes."""
    qtype = cache_type(cache)
    block, size = GGML_QUANT_SIZES[qtype]
    nbytes = rows * row_bytes(qtype, width) if width % block == 0 else 0
    extra = 0
    if block > 1 and width % CUDA_ROW_PADDING:
        extra = (CUDA_ROW_PADDING - width % CUDA_ROW_PADDING) // block * size
    return _pad(nbytes + extra, 128) - nbytes


def _ik_mla_width(spec: ModelSpec) -> int:
    """ik_llama.cpp's MLA cache holds the compressed latent plus the rope part (kv_lora_rank + n_rot)."""
    return spec.kv_lora_rank + spec.n_rot if spec.kv_lora_rank else 0


def kv_plan(spec: ModelSpec, s: Settings, place: Placement) -> KVPlan:
    """Bytes of K/V per device for the main context (MTP heads have their own, smaller, context)."""
    cells, swa_cells, streams = kv_cells(spec, s)
    per_device = [0.0] * len(place.devices)
    attn = [layer for layer in spec.layers if layer.kind in ("full", "swa")]
    v_width_max = max((layer.v_width for layer in attn), default=0)
    total = bytes_per_token = 0
    mla = spec.mla or (s.engine == "ik" and spec.arch.startswith("deepseek") and _ik_mla_width(spec) > 0)
    for layer in attn:
        per_cell = _layer_kv_bytes_per_cell(layer, spec, s, v_width_max)
        n = swa_cells if layer.kind == "swa" else cells
        size = per_cell * n * streams
        if layer.kind == "full" or s.engine == "ik":
            bytes_per_token += per_cell
        device = place.layer_device[layer.index]
        if device != place.cpu and not mla:
            v_width = layer.v_width if s.flash_attn else v_width_max
            size += _cuda_padding(s.cache_type_k, layer.k_width, n * streams)
            size += _cuda_padding(s.cache_type_v, v_width, n * streams)
        total += size
        _spread(size, device, place, s, per_device)
    recurrent = [layer for layer in spec.layers if layer.kind == "recurrent"]
    state_bytes = 0
    for layer in recurrent:
        size = (spec.recurrent_r + spec.recurrent_s) * 4 * s.parallel
        state_bytes += size
        _spread(size, place.layer_device[layer.index], place, s, per_device)
    return KVPlan(
        cells=cells, swa_cells=swa_cells if any(layer.kind == "swa" for layer in attn) else 0, streams=streams,
        layers=len(attn), swa_layers=sum(1 for layer in attn if layer.kind == "swa"),
        recurrent_layers=len(recurrent), bytes_per_token=bytes_per_token, total_bytes=total + state_bytes,
        per_device=per_device, recurrent_bytes=state_bytes,
    )


# ---------------------------------------------------------------- compute buffers


def compute_bytes(spec: ModelSpec, s: Settings, cells: int, swa_cells: int, streams: int) -> dict[str, float]:
    """Peak bytes of the worst-case micro-batch graph, split into the phases that can set it.

    The reserve pass (llama-context.cpp sched_reserve) builds the graph for T = min(ubatch, n_ctx)
    tokens against every cell of the cache, with one output row per slot (the server sets
    n_outputs_max to --parallel). ggml-alloc frees each tensor after its last use, so the buffer is
    the KQ masks (inputs, alive throughout) plus the largest of three phases, in units of
    E = n_embd*T*4 and Q = n_head*head_dim*T*4:

    * attention: 3E + 2Q with flash attention (layer input, its norm, the output; Q and the FA
      result); without it the scores n_head*n_kv*T*4 + 3E + 3Q;
    * FFN: gate, up and their product (3F, F = n_ff*T*4; for MoE F = n_used*n_ff_exp*T*4) beside
      2E, plus up to 2E the allocator cannot reuse while F > E; MoE also holds n_used expert
      outputs before summing them, (4 + n_used)E;
    * output: the logits, n_vocab * n_outputs * 4.

    The coefficients were fitted to the 0c1e570 CPU server's reported buffers across n_embd,
    n_ff, heads, experts, ubatch and context (benchmarks/estimate_accuracy.py checks them).
    """
    t = min(s.ubatch, s.batch, s.ctx)
    f32 = 4
    attn = [layer for layer in spec.layers if layer.kind in ("full", "swa")]
    has_full = any(layer.kind == "full" for layer in attn)
    has_swa = any(layer.kind == "swa" for layer in attn)
    n_head = max((layer.n_head for layer in attn), default=0)
    q_width = max((layer.n_head * max(layer.head_k, layer.head_v) for layer in attn), default=spec.n_embd)
    kv_width = max((layer.k_width for layer in attn), default=0)
    n_kv = cells if has_full or not has_swa else swa_cells
    e = spec.n_embd * t * f32
    q = q_width * t * f32
    mask_elem = 2 if s.flash_attn else 4  # flash attention takes an f16 mask
    masks = (cells * t * mask_elem if has_full else 0) + (swa_cells * t * mask_elem if has_swa else 0)
    if s.flash_attn:
        # an f32/bf16 cache is cast to f16 for the FA kernel, one layer at a time
        cast = n_kv * kv_width * 2 if s.cache_type_k in ("f32", "bf16") else 0
        attention = 3 * e + 2 * q + cast
    else:
        attention = n_head * n_kv * t * f32 + 3 * e + 3 * q
    if spec.n_expert:
        f = spec.n_expert_used * (spec.n_ff_exp or spec.n_ff) * t * f32
        ffn = max(3 * f + 2 * e + 2 * min(max(f - e, 0), e), (4 + spec.n_expert_used) * e)
    else:
        f = spec.n_ff * t * f32
        ffn = 3 * f + 2 * e + 2 * min(max(f - e, 0), e)
    n_outputs = min(t, s.parallel)
    output = 2 * e + spec.n_vocab * n_outputs * f32
    if not attn:
        masks = attention = 0
    return {"attention": attention, "ffn": ffn, "output": output, "masks": masks,
            "total": max(attention, ffn, output) + masks}


def cuda_fa_f16_bytes(spec: ModelSpec, s: Settings, cells: int, streams: int) -> int:
    """CUDA flash attention converts a K or V cache that is not f16 to f16 inside its result's allocation.

    For a prompt-sized batch the engine's kernels read f16 only (fattn.cu
    ``ggml_cuda_flash_attn_ext_get_alloc_size``), so one layer's K and V of every cell of every stream
    are converted into the compute buffer. Used by the formula; the graph model sizes it per node.
    """
    if not s.flash_attn:
        return 0
    attn = [layer for layer in spec.layers if layer.kind in ("full", "swa")]
    k = max((layer.k_width for layer in attn), default=0) if s.cache_type_k != "f16" else 0
    v = max((layer.v_width for layer in attn), default=0) if s.cache_type_v != "f16" else 0
    return cells * streams * (k + v) * 2


@dataclass
class ComputePlan:
    """Each device's compute buffer (GPUs, then the host), and how it was worked out."""

    per_device: list[float]
    model: str  # "graph": the engine's scheduler and allocator over the mirrored graph; "formula" otherwise
    pinned: bool  # the host's buffer is CUDA pinned memory (a GPU backend exists)
    splits: int = 0
    nodes: int = 0
    notes: list[str] = field(default_factory=list)


def _pipeline_parallel(spec: ModelSpec, s: Settings) -> bool:
    """llama_context: several GPUs, every layer and the output offloaded, layer split, no tensor overrides."""
    return len(s.gpus) > 1 and s.n_gpu_layers > spec.n_layer_all and s.split_mode == "layer" and not s.cpu_moe


def compute_plan(spec: ModelSpec, s: Settings, place: Placement, kv: KVPlan, compress: bool = True) -> ComputePlan:
    """The compute buffers of the reserve pass: the engine's graph where it is mirrored, else the formula.

    ``compress=False`` builds every layer (``graph.layer_plan`` otherwise shortens repeating stretches).
    """
    if s.engine == "upstream" and graph_model.supported(spec):
        return _graph_plan(spec, s, place, kv, compress)
    return _formula_plan(spec, s, place, kv)


def _graph_plan(spec: ModelSpec, s: Settings, place: Placement, kv: KVPlan, compress: bool) -> ComputePlan:
    n_gpu = len(s.gpus)
    tensor_split = s.split_mode == "tensor" and n_gpu > 1
    n_backends = 1 if tensor_split else n_gpu
    backends = [Backend(f"CUDA{k}", True, BufferType(f"CUDA{k}", False)) for k in range(n_backends)]
    host = BufferType("CUDA_Host" if n_gpu else "CPU", True)
    backends.append(Backend("CPU", False, host))
    cpu = len(backends) - 1

    def backend(device: int) -> int:
        if device == place.cpu:
            return cpu
        return 0 if tensor_split else device

    shape = graph_model.shape_for(spec, s.ctx, s.ubatch, s.batch, s.parallel, s.kv_unified, kv.cells,
                                  kv.swa_cells, s.flash_attn, s.cache_type_k, s.cache_type_v)
    n_copies = MAX_COPIES if _pipeline_parallel(spec, s) else 1
    layer_device = [backend(d) for d in place.layer_device[:spec.n_layer]]

    def reserve(compress: bool) -> tuple[list[int], Scheduler, graph_model.Built]:
        built = graph_model.build_graph(spec, shape, layer_device, backend(place.output_device), cpu,
                                        [b.buft for b in backends], n_gpu > 0 and s.n_gpu_layers > spec.n_layer_all,
                                        compress=compress)
        sched = Scheduler(backends, op_offload=True, n_copies=n_copies)
        for tensor, device in built.pins:
            sched.pin(tensor, device)
        return sched.reserve(built.graph), sched, built

    sizes, sched, built = reserve(compress)
    if compress and n_copies > 1 and sched.n_splits > len(set(layer_device)) + 2:
        # pipeline parallelism keeps every copy of every split input: splits inside the layers (an op no GPU
        # runs) make the buffers grow with each layer, which a shortened graph would not show
        sizes, sched, built = reserve(False)
    per_device = [0.0] * len(place.devices)
    for k in range(n_gpu):
        per_device[k] = float(sizes[0 if tensor_split else k])
    per_device[place.cpu] = float(sizes[cpu])
    notes = []
    if tensor_split:
        notes.append("split mode tensor: each GPU is given the compute buffer of the whole graph on one GPU")
    return ComputePlan(per_device, "graph", n_gpu > 0, sched.n_splits, len(built.graph.nodes), notes)


def _formula_plan(spec: ModelSpec, s: Settings, place: Placement, kv: KVPlan) -> ComputePlan:
    graph = compute_bytes(spec, s, kv.cells, kv.swa_cells, kv.streams)
    compute = [0.0] * len(place.devices)
    gpu_used = sorted({d for d in place.layer_device + [place.output_device] if d != place.cpu})
    if s.split_mode == "tensor" and len(s.gpus) > 1 and gpu_used:
        gpu_used = list(range(len(s.gpus)))
    f16 = cuda_fa_f16_bytes(spec, s, kv.cells, kv.streams) if s.engine == "upstream" else 0
    for device in gpu_used:
        compute[device] = graph["total"] + f16
    t = min(s.ubatch, s.batch, s.ctx)
    if not gpu_used or place.output_device == place.cpu or any(d == place.cpu for d in place.layer_device):
        compute[place.cpu] = graph["total"]
    else:
        # Fully offloaded: the host keeps the graph inputs (the KQ masks, the token ids) and the token
        # embeddings it looks up for the GPU, twice (the raw-embeddings input and the lookup).
        compute[place.cpu] = graph["masks"] + 2 * t * spec.n_embd * 4 + spec.n_vocab * 4 * s.parallel
    notes = []
    if s.gpus:
        notes.append(f"compute buffers: {spec.arch} on {s.engine} is sized with a formula fitted to the CPU server, "
                     "not with the engine's graph; the margin in a plan covers the difference")
    return ComputePlan(compute, "formula", bool(s.gpus), notes=notes)


def output_bytes(spec: ModelSpec, s: Settings) -> int:
    """The logits buffer llama_context reserves for one output per slot (``output_reserve``), on the host."""
    return spec.n_vocab * 4 * max(s.parallel, 1)


# ---------------------------------------------------------------- the whole estimate


@dataclass
class DeviceEstimate:
    name: str
    weights_mib: float
    kv_mib: float
    compute_mib: float
    overhead_mib: float
    total_mib: float
    capacity_mib: float | None = None
    output_mib: float = 0.0  # the logits buffer (host only), counted in the total
    pinned_mib: float = 0.0  # of the total, page-locked host memory (CUDA_Host): compute and output buffers

    @property
    def fits(self) -> bool | None:
        return None if self.capacity_mib is None else self.total_mib <= self.capacity_mib


@dataclass
class Estimate:
    spec: ModelSpec
    settings: Settings
    kv: KVPlan
    weights: list[float]
    compute: list[float]
    devices: list[DeviceEstimate]
    notes: list[str] = field(default_factory=list)
    compute_plan: ComputePlan | None = None

    @property
    def host_pinned_mib(self) -> float:
        """Page-locked host memory (CUDA_Host) the server takes beyond its weights: it cannot be swapped out."""
        return sum(d.pinned_mib for d in self.devices)

    @property
    def total_mib(self) -> float:
        return sum(d.total_mib for d in self.devices)

    def to_json(self) -> dict[str, Any]:
        """The ``controller estimate --json`` contract (issue 4); extra keys extend it, none rename it."""
        names = [d.name for d in self.devices]
        plan = self.compute_plan
        return {
            "model": {
                "arch": self.spec.arch, "n_layer": self.spec.n_layer, "n_ctx_train": self.spec.n_ctx_train,
                "params": self.spec.params, "file_type": self.spec.file_type, "size_bytes": self.spec.size_bytes,
            },
            "settings": asdict(self.settings),
            "weights": {"total_mib": _mib(sum(self.weights)), "per_device": dict(zip(names, map(_mib, self.weights)))},
            "kv": {
                "total_mib": _mib(self.kv.total_bytes), "cells": self.kv.cells, "swa_cells": self.kv.swa_cells,
                "layers": self.kv.layers, "swa_layers": self.kv.swa_layers, "bytes_per_token": self.kv.bytes_per_token,
                "streams": self.kv.streams, "recurrent_layers": self.kv.recurrent_layers,
                "recurrent_mib": _mib(self.kv.recurrent_bytes),
            },
            "compute": {
                "total_mib": _mib(sum(self.compute)), "per_device": dict(zip(names, map(_mib, self.compute))),
                "model": plan.model if plan else "formula", "splits": plan.splits if plan else 0,
            },
            "host_pinned": self._pinned_json(),
            "devices": [
                {"name": d.name, "weights_mib": round(d.weights_mib, 2), "kv_mib": round(d.kv_mib, 2),
                 "compute_mib": round(d.compute_mib, 2), "overhead_mib": round(d.overhead_mib, 2),
                 "output_mib": round(d.output_mib, 2), "pinned_mib": round(d.pinned_mib, 2),
                 "total_mib": round(d.total_mib, 2), "capacity_mib": d.capacity_mib, "fits": d.fits}
                for d in self.devices
            ],
            "total_mib": round(self.total_mib, 2),
            "notes": self.notes,
        }


    def _pinned_json(self) -> dict[str, Any] | None:
        """The CUDA_Host buffers: host RAM the box must have besides the weights and the host's KV."""
        if not self.settings.gpus:
            return None
        host = self.devices[-1]
        return {"buffer": "CUDA_Host", "compute_mib": round(host.compute_mib, 2),
                "output_mib": round(host.output_mib, 2), "total_mib": round(host.pinned_mib, 2)}


def _mib(value: float) -> float:
    return round(value / MIB, 2)


def estimate(spec: ModelSpec, s: Settings) -> Estimate:
    """Weights, KV and compute per device for a model under resolved settings."""
    notes = list(spec.notes)
    place = place_layers(spec, s)
    weights = weights_per_device(spec, s, place)
    kv = kv_plan(spec, s, place)
    plan = compute_plan(spec, s, place, kv) if spec.layers else ComputePlan([0.0] * len(place.devices), "none", False)
    compute = plan.per_device
    notes += plan.notes
    if any(layer.kind == "recurrent" for layer in spec.layers):
        notes.append("compute buffers of recurrent (state) layers are not modelled; the estimate covers attention and FFN")
    if not s.flash_attn and (s.cache_type_v not in ("f16", "f32", "bf16")):
        notes.append("a quantised V cache needs flash attention; the engine will refuse these settings")
    if not spec.layers:
        notes.append("no layer information: KV cache and compute could not be estimated")
    output = output_bytes(spec, s)
    devices = []
    for k, name in enumerate(place.devices):
        overhead = CUDA_OVERHEAD_MIB if k != place.cpu else 0.0
        capacity = s.gpu_mem_mib[k] if k != place.cpu and s.gpu_mem_mib else None
        out = output if k == place.cpu else 0
        total = (weights[k] + kv.per_device[k] + compute[k] + out) / MIB + overhead
        pinned = (compute[k] + out) / MIB if k == place.cpu and plan.pinned else 0.0
        devices.append(DeviceEstimate(name, weights[k] / MIB, kv.per_device[k] / MIB, compute[k] / MIB,
                                      overhead, total, capacity, out / MIB, pinned))
    return Estimate(spec, s, kv, weights, compute, devices, notes, plan)


def largest_fitting_context(spec: ModelSpec, s: Settings, budget_mib: float) -> int:
    """Largest context (multiple of 256) whose GPU total stays within ``budget_mib`` on every GPU."""
    low, high = 0, max(spec.n_ctx_train, KV_PAD) // KV_PAD
    while low < high:
        mid = (low + high + 1) // 2
        trial = estimate(spec, _with_ctx(s, mid * KV_PAD))
        if all(d.total_mib <= budget_mib for d in trial.devices if d.name != "CPU"):
            low = mid
        else:
            high = mid - 1
    return low * KV_PAD


def _with_ctx(s: Settings, ctx: int) -> Settings:
    values = asdict(s)
    values["ctx"] = ctx
    values["gpus"], values["gpu_mem_mib"] = s.gpus, s.gpu_mem_mib
    return Settings(**values)


__all__ = [
    "CUDA_OVERHEAD_MIB", "ComputePlan", "Estimate", "EstimateInputError", "KVPlan", "Settings", "estimate", "kv_cells",
    "largest_fitting_context", "place_layers", "resolve_settings", "row_bytes",
]
