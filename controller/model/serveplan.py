"""The serving plan: which llama-server runs where, with which arguments, and why.

This is the JSON contract of ``controller plan --json``; extend it, never rename fields.

The plan is complete: it carries every decision the roles act on, resolved (the engine packs and
model files with their addresses and checksums, mlock, NCCL, the OS and its folders, the chat
template file, the driver), so rendering the inventory is a projection of it and never decides again.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServiceMemory(_Model):
    per_device_mib: dict[str, int] = Field(default_factory=dict)  # "cuda0", "cpu", ...


class Download(_Model):
    """One file a role fetches, resolved for the box: from its mirror or the publisher's address.

    ``url`` is None when the box names no address for it; ``sha256`` None when nothing pins it.
    Rendering refuses both where the file would run on the box.
    """

    id: str
    version: str | None = None
    file: str
    url: str | None = None
    sha256: str | None = None
    sha256sums_url: str | None = None  # an engine pack without a pinned sha256: the mirror's SHA256SUMS
    what: str = ""  # the fleet setting that gives its address, e.g. "mirror.engines"
    cache: str | None = None  # the LAN cache host ``url`` goes through (the fleet's cache.host)
    fallback_url: str | None = None  # upstream, used when the cache is down and the fleet allows it


class EnginePack(_Model):
    """An engine build the box installs: one slot (folder) per engine, one pinned version in it."""

    id: str  # engine catalog id, e.g. "upstream-02182fc"
    slot: str  # install folder shared by every version: "upstream", "ik", "cpu"
    commit: str
    family: str
    platform: str  # "linux-x86_64" or "windows-x86_64"
    nccl: bool = False
    api_key_flag: str = "--api-key-file"
    no_slots_flags: list[str] = Field(default_factory=list)
    download: Download | None = None  # None: the engine has no release pack for this platform
    cuda_archs: list[int] = Field(default_factory=list)  # what the build carries code for; a source build targets them


class ModelFile(_Model):
    """A GGUF the box downloads into its model folder."""

    id: str  # catalog id
    file: str
    url: str | None = None
    sha256: str | None = None
    size_bytes: int | None = None
    token: bool = False  # also send the hub token to this (mirror) address: the fleet's mirror.models_token
    cache: str | None = None  # the LAN cache host ``url`` goes through (the fleet's cache.host)
    fallback_url: str | None = None  # upstream, used when the cache is down and the fleet allows it


class DriverPlan(_Model):
    """What the driver role does on the box, and why."""

    manage: bool = True
    branch: int | None = None  # Linux driver branch
    allow_reboot: bool = False
    nccl: bool = False  # install NCCL: a service all-reduces over NVLink with it
    installs: bool = False  # the box has a V100 and the role manages its driver (keeps or installs it)
    mode: Literal["tcc", "mcdm"] | None = None  # Windows driver model for the V100s
    installer: Download | None = None  # Windows: the pinned data-center driver
    reasons: list[str] = Field(default_factory=list)


class DraftService(_Model):
    """The draft model a service decodes speculatively with (``controller.stages.planner.draft``).

    ``args_added`` are the flags the draft adds to the service's ``args`` (already in them);
    ``memory`` is the draft's own share (its weights, its own KV cache and compute) of the service's
    memory. A pair the engine would refuse is kept with ``compatible: false``, no flags and the reason,
    and its file is never downloaded."""

    model: str  # catalog id of the draft
    model_file: str
    args_added: list[str] = Field(default_factory=list)
    memory: ServiceMemory = Field(default_factory=ServiceMemory)
    compatible: bool = True
    reasons: list[str] = Field(default_factory=list)


class OnDemandModel(_Model):
    """One model of an on-demand group: planned as if it ran alone on the group's cards, spelled as a section of
    the router's preset file (``preset``: each key a long flag name without its dashes, each value its argument,
    ``true`` for a flag without one)."""

    id: str
    model_file: str
    template: str | None = None
    ctx: int
    parallel: int = 1
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    gpus: list[int] = Field(default_factory=list)
    split_mode: Literal["none", "layer", "tensor"] = "none"
    cpu_offload: bool = False
    preset: dict[str, str] = Field(default_factory=dict)
    memory: ServiceMemory = Field(default_factory=ServiceMemory)
    draft: DraftService | None = None
    reasons: list[str] = Field(default_factory=list)


class OnDemandPlan(_Model):
    """A service in router mode: its models load when a request names them (``controller.stages.planner.core``)."""

    group: str
    max_loaded: int  # --models-max: how many of them may be loaded at once
    preset_file: str  # where the role writes the preset on the box
    key_file_env: str = "LLAMA_ARG_API_KEY_FILE"  # the variable the router and its models' servers read the key from
    models: list[OnDemandModel] = Field(default_factory=list)
    reasons: list[str] = Field(default_factory=list)


class Service(_Model):
    name: str  # systemd unit / Windows service suffix, e.g. "llama-gemma4-26b-a4b-qat-q4_0"
    model: str  # catalog id
    models: list[str] = Field(default_factory=list)  # every model id the service answers (one for an ordinary service)
    model_file: str  # file name under the model folder
    engine: str  # engine catalog id, e.g. "upstream-02182fc"
    gpus: list[int] = Field(default_factory=list)
    split_mode: Literal["none", "layer", "tensor"] = "none"
    ctx: int
    parallel: int = 1
    kv_unified: bool = False
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    ubatch: int = 512
    batch: int = 2048
    threads: int | None = None
    n_gpu_layers: int = 0
    cpu_offload: bool = False
    spec_decoding: str | None = None
    template: str | None = None  # chat template file name, applied with --jinja
    host: str = "127.0.0.1"
    port: int
    args: list[str] = Field(default_factory=list)  # the full llama-server argument list
    env: dict[str, str] = Field(default_factory=dict)
    memory: ServiceMemory = Field(default_factory=ServiceMemory)
    reasons: list[str] = Field(default_factory=list)
    mlock: bool = False  # the weights are locked in RAM (expert offload): the service may lock memory
    nccl: bool = False  # tensor split all-reduces through NCCL (GGML_CUDA_ALLREDUCE=nccl)
    template_file: str | None = None  # the chat template's path on the box
    draft: DraftService | None = None  # speculative decoding with a draft model; None: no draft model
    gpu_minors: list[int] = Field(default_factory=list)  # Linux device nodes of ``gpus`` (/dev/nvidia<minor>), in order
    memory_deny_write_execute: bool = False  # the unit refuses writable+executable memory: nothing compiles at run time
    on_demand: OnDemandPlan | None = None  # router mode: ``models`` load on demand; None: one model, always loaded

    def per_model(self) -> list[Service]:
        """The service as a client of each model it answers sees it: itself, or for an on-demand group one view per
        model (its id, context and cache; the same name, port and key)."""
        if self.on_demand is None:
            return [self]
        return [self.model_copy(update={"model": item.id, "models": [item.id], "model_file": item.model_file,
                                        "ctx": item.ctx, "parallel": item.parallel, "cache_type_k": item.cache_type_k,
                                        "cache_type_v": item.cache_type_v, "template": item.template,
                                        "cpu_offload": item.cpu_offload, "draft": item.draft})
                for item in self.on_demand.models]


class Unplaced(_Model):
    model: str
    reason: str


class IdleGpu(_Model):
    """A card of the box that no service uses, and why (no engine build for it, or nothing left to place)."""

    index: int
    name: str
    arch: int | None = None  # CUDA architecture, e.g. 86 for an RTX 3090
    reason: str


class GatewayRoute(_Model):
    """A model id and the planned service that answers it: on the gateway's own box or another box of the fleet."""

    model: str
    box: str
    service: str  # its unit name (on the gateway's own box, the role reads its key file by this name)
    host: str  # the address the gateway connects to (loopback for its own box)
    port: int
    local: bool


class GatewayPlan(_Model):
    """The box's gateway: one OpenAI and one Anthropic endpoint that route by the request's model name."""

    bind: str
    port: int
    metrics_port: int
    allow_from: list[str] = Field(default_factory=list)
    buffer_bytes: int  # how much of a request body is read to find its model name
    connect_timeout_ms: int
    idle_timeout_s: int
    routes: list[GatewayRoute] = Field(default_factory=list)
    reasons: list[str] = Field(default_factory=list)


class ServePlan(_Model):
    fits: bool
    services: list[Service] = Field(default_factory=list)
    unplaced: list[Unplaced] = Field(default_factory=list)
    os: Literal["linux", "windows"] = "linux"
    model_dir: str | None = None
    template_dir: str | None = None
    engines: list[EnginePack] = Field(default_factory=list)  # one per engine the services use
    models: list[ModelFile] = Field(default_factory=list)  # one per model file the services load
    service_wrapper: Download | None = None  # Windows: WinSW runs each server as a service
    driver: DriverPlan | None = None
    idle_gpus: list[IdleGpu] = Field(default_factory=list)  # the cards no service uses, each with why
    gateway: GatewayPlan | None = None  # the box runs a gateway (the fleet's gateway:)

    def templates(self) -> set[str]:
        """Every chat template a server of the plan loads, on-demand models' included."""
        return {view.template for service in self.services for view in service.per_model() if view.template}
