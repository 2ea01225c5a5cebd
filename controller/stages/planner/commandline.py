"""The llama-server command line and environment that carry a placement out on the pinned engine version.

Placement (``controller.stages.planner.placement``) decides where and how much; this module only spells
those decisions in the flags the chosen engine build accepts, so a new engine version changes this
file and the engine catalog, never the placement rules.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from controller.model.catalog import EngineEntry
from controller.model.profile import Gpu
from controller.model.serveplan import Service
from controller.stages.planner.fit import Fit
from controller.stages.planner.placement import Placement, split_fractions

CACHE_RAM_MIB = 16384  # the kit's -cram for ik_llama.cpp
_UUID = re.compile(r"GPU-[0-9A-Fa-f-]+")  # what nvidia-smi prints and CUDA_VISIBLE_DEVICES takes


def tensor_split(fit: Fit, engine: EngineEntry, split_mode: str) -> str:
    """``--tensor-split`` as each engine reads it.

    Upstream's layer split counts layer slots, so the planner's whole-layer counts go verbatim;
    ik_llama.cpp balances layers by their bytes itself, so it gets each card's usable memory;
    tensor split divides every tensor by the shares.
    """
    if split_mode == "layer" and engine.family == "ik":
        return ",".join(str(m) for m in fit.card_mib)
    if split_mode == "layer":
        return ",".join(f"{share:g}" for share in fit.shares)
    return split_fractions(fit.shares)


def environment(place: Placement, cards: Sequence[Gpu]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES pinning, and the all-reduce it depends on.

    ``cards`` are the profile's GPUs of the placement, in its order. Each is named by its UUID, which is the
    card whatever the numbering; CUDA numbers them in the order given (CUDA0 is the first). A card without a
    UUID leaves only nvidia-smi's indices, which mean the same cards to CUDA only with CUDA_DEVICE_ORDER=PCI_BUS_ID
    (CUDA's default numbers the fastest first, nvidia-smi by PCI bus).
    """
    if place.gpus is None:
        return {}
    if cards and all(card.uuid and _UUID.fullmatch(card.uuid) for card in cards):
        env = {"CUDA_VISIBLE_DEVICES": ",".join(str(card.uuid) for card in cards)}
    else:
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, place.gpus.gpus)), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    if place.fit.split_mode == "tensor" and place.engine.nccl:
        env["GGML_CUDA_ALLREDUCE"] = "nccl"
    return env


def command_line(service: Service, place: Placement, model_path: str, cram: bool) -> list[str]:
    """The full llama-server argument list, in the flags the chosen engine version accepts."""
    engine, fit = place.engine, place.fit
    args = [
        "--model", model_path,
        "--alias", service.model,
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
        args += ["--split-mode", service.split_mode, "--tensor-split", tensor_split(fit, engine, service.split_mode)]
    if place.offload:
        args += (["--fit", "--fit-margin", str(fit.fit_margin)] if engine.family == "ik"
                 else ["--n-cpu-moe", str(fit.cpu_moe_layers)])
    if service.spec_decoding:
        args += ["--spec-type", service.spec_decoding]
    if service.template_file:
        args += ["--chat-template-file", service.template_file]
    if cram:
        args += ["-cram", str(CACHE_RAM_MIB)]
    return args + load_flags(engine, mlock=service.mlock)


def draft_args(engine: EngineEntry, draft_path: str, service: Service, n_max: int, n_min: int,
               gpu_layers: int) -> list[str]:
    """The draft model's flags in the engine version's spelling (``engines.yml`` ``draft:``): the file, how
    many tokens to draft, its cache types (the target's), and on a card its layers and device.

    The service sees only its own cards (CUDA_VISIBLE_DEVICES), so the draft's device is CUDA0, the first
    of them; a CPU service offloads nothing. Neither pinned upstream version has a draft context flag: the
    draft's context is the target's ``--ctx-size``."""
    flags = engine.draft
    if flags is None:
        raise ValueError(f"{engine.id} has no draft flags in the engine catalog")
    args = [*flags.enable, flags.model, draft_path, flags.n_max, str(n_max), flags.n_min, str(n_min),
            flags.cache_type_k, service.cache_type_k, flags.cache_type_v, service.cache_type_v]
    if service.gpus:
        args += [flags.gpu_layers, str(gpu_layers), flags.device, "CUDA0"]
    if flags.ctx:
        args += [flags.ctx, str(service.ctx)]
    return args


def load_flags(engine: EngineEntry, *, mlock: bool) -> list[str]:
    """How the engine loads the weights: locked in RAM (offloaded experts must never page out) or mapped."""
    return list(engine.load_flags.get("mlock" if mlock else "mmap", []))


ROUTER_OWNED = ("--alias", "--host", "--port")  # the router gives each model's server these itself
# Seconds the router waits for a model server it unloads to exit before killing it. On an H100 (driver 580, the test
# engine's commit built for CUDA) servers told to exit were still there at the default 10 s in 2 of 3 evictions, so
# every swap waited 10 s (tests/fixtures/gpu_check/router-load-h100-580); nothing is in flight when it unloads one.
GPU_STOP_TIMEOUT_S = 3
_INI_UNSAFE = re.compile(r"[\r\n]|\s[;#]")  # a value the preset's INI parser would cut short


def preset_section(args: Sequence[str]) -> dict[str, str]:
    """A model's llama-server arguments as its section of the router's preset: each long flag without its dashes,
    its argument as the value (``true`` for a flag that takes none); the flags the router owns are left out."""
    section: dict[str, str] = {}
    words = list(args)
    index = 0
    while index < len(words):
        flag = words[index]
        if not flag.startswith("-"):
            raise ValueError(f"{flag!r} in a model's arguments follows no flag")
        has_value = index + 1 < len(words) and not words[index + 1].startswith("--")
        value = words[index + 1] if has_value else "true"
        index += 2 if has_value else 1
        if flag in ROUTER_OWNED:
            continue
        if _INI_UNSAFE.search(value):
            raise ValueError(f"{flag} {value!r} cannot be written in the router's preset file (a line break, or ; or # "
                             f"after a space, would end it early); use a model folder without them")
        section[flag.lstrip("-")] = value
    return section


def router_args(engine: EngineEntry, preset_file: str, max_loaded: int, host: str, port: int) -> list[str]:
    """The router's own command line: every model's flags are in its preset section, since a flag given here
    would apply to every model."""
    if engine.router is None:
        raise ValueError(f"{engine.id} has no router mode in the engine catalog")
    return [engine.router.preset, preset_file, engine.router.max_loaded, str(max_loaded), "--host", host,
            "--port", str(port)]
