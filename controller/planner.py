"""Plan which llama-server runs where: one service per wanted model, on one GPU or on the CPU.

This is the first planner: a model goes on the first V100 that holds it with room for its cache,
otherwise on the CPU when the box has no V100 at all, otherwise it is left unplaced with the
numbers. Multi-GPU boards and expert offload come with the full planner.
"""

from __future__ import annotations

import re

from controller.catalog import Catalog, EngineEntry, ModelEntry
from controller.errors import PlanError
from controller.fleet import Box, WantedModel
from controller.profile import HardwareProfile
from controller.serveplan import ServePlan, Service, ServiceMemory, Unplaced

MIB = 1024 * 1024
GPU_HEADROOM_MIB = 1536  # KV cache at the default context, compute buffers and the CUDA context
CPU_ENGINE = "cpu-0c1e570"
GPU_ENGINES = {"upstream": "upstream-02182fc", "ik": "ik-022bd00a"}
DEFAULT_CTX = {"gpu": 32768, "cpu": 8192}
TEMPLATE_DIR = "/etc/llama/templates"


def service_name(model_id: str) -> str:
    return "llama-" + re.sub(r"[^a-z0-9._-]+", "-", model_id.lower())


def _engine_for(model: ModelEntry, catalog: Catalog, on_gpu: bool) -> EngineEntry:
    if not on_gpu:
        return catalog.engine(CPU_ENGINE)
    if model.engine in catalog.engines:
        return catalog.engine(model.engine)
    try:
        return catalog.engine(GPU_ENGINES[model.engine])
    except KeyError:
        raise PlanError(f"model {model.id}: unknown engine {model.engine!r}; use upstream, ik or an engine id") from None


def _physical_cores(profile: HardwareProfile) -> int:
    return profile.cpu.cores or max(1, (profile.cpu.threads or 2) // 2)


def _args(service: Service, model: ModelEntry, model_dir: str, engine: EngineEntry) -> list[str]:
    args = [
        "--model", f"{model_dir.rstrip('/')}/{model.file}",
        "--alias", model.id,
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
    if service.kv_unified:
        args.append("--kv-unified")
    if service.n_gpu_layers:
        args += ["--n-gpu-layers", str(service.n_gpu_layers), "--flash-attn", "on"]
    if service.template:
        args += ["--chat-template-file", f"{TEMPLATE_DIR}/{service.template}"]
    args += engine.load_flags.get("mmap", [])
    return args


def plan_box(box: Box, profile: HardwareProfile, catalog: Catalog, wanted: list[WantedModel] | None = None) -> ServePlan:
    wanted = box.models if wanted is None else wanted
    if not wanted:
        raise PlanError(f"box {box.name}: no models wanted; add 'models:' with catalog ids to the fleet file")
    v100s = [gpu for gpu in profile.gpus if gpu.is_v100 and gpu.memory_mib]
    free_mib = {gpu.index: gpu.memory_mib or 0 for gpu in v100s}
    cores = _physical_cores(profile)
    services: list[Service] = []
    unplaced: list[Unplaced] = []
    for offset, want in enumerate(wanted):
        model = catalog.model(want.id)
        size_mib = -(-(model.size_bytes or 0) // MIB)
        need_mib = size_mib + GPU_HEADROOM_MIB
        gpu = next((index for index, free in free_mib.items() if free >= need_mib), None)
        reasons: list[str] = []
        if v100s and gpu is None:
            largest = max(free_mib.values())
            unplaced.append(Unplaced(
                model=model.id,
                reason=f"needs {need_mib} MiB on one GPU ({size_mib} MiB weights + {GPU_HEADROOM_MIB} MiB "
                       f"for cache and buffers); the largest free V100 has {largest} MiB",
            ))
            continue
        on_gpu = gpu is not None
        engine = _engine_for(model, catalog, on_gpu)
        if on_gpu:
            free_mib[gpu] -= need_mib
            threads = min(6, max(1, cores // 2)) if cores >= 2 else 1
            reasons.append(f"fits one V100 (GPU {gpu}): {need_mib} MiB of {profile.gpus[gpu].memory_mib} MiB")
            reasons.append(f"threads {threads}: the model is GPU-resident, more threads only add contention")
            memory = ServiceMemory(per_device_mib={f"cuda{gpu}": need_mib})
        else:
            threads = cores
            reasons.append("no V100 on this box: serving on the CPU with the CPU engine build")
            reasons.append(f"threads {threads}: one per physical core")
            memory = ServiceMemory(per_device_mib={"cpu": size_mib + 256})
        ctx = want.ctx or DEFAULT_CTX["gpu" if on_gpu else "cpu"]
        service = Service(
            name=service_name(model.id),
            model=model.id,
            model_file=model.file,
            engine=engine.id,
            gpus=[gpu] if on_gpu else [],
            ctx=ctx,
            parallel=want.agents,
            kv_unified=want.agents > 1,
            cache_type_k="q8_0" if on_gpu else "f16",
            cache_type_v="q8_0" if on_gpu else "f16",
            ubatch=1024 if on_gpu else 512,
            batch=2048,
            threads=threads,
            n_gpu_layers=99 if on_gpu else 0,
            template=model.template,
            host=box.bind,
            port=box.base_port + offset,
            env={"CUDA_VISIBLE_DEVICES": str(gpu)} if on_gpu else {},
            memory=memory,
            reasons=reasons,
        )
        if want.agents > 1:
            service.reasons.append(f"--parallel {want.agents} with a unified KV cache: agents share the prompt prefix")
        service.args = _args(service, model, box.effective_model_dir, engine)
        services.append(service)
    return ServePlan(fits=not unplaced, services=services, unplaced=unplaced)
