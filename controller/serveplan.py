"""The serving plan: which llama-server runs where, with which arguments, and why.

This is the JSON contract of ``controller plan --json``; extend it, never rename fields.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServiceMemory(_Model):
    per_device_mib: dict[str, int] = Field(default_factory=dict)  # "cuda0", "cpu", ...


class Service(_Model):
    name: str  # systemd unit / Windows service suffix, e.g. "llama-gemma4-26b-a4b-qat-q4_0"
    model: str  # catalog id
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


class Unplaced(_Model):
    model: str
    reason: str


class ServePlan(_Model):
    fits: bool
    services: list[Service] = Field(default_factory=list)
    unplaced: list[Unplaced] = Field(default_factory=list)
