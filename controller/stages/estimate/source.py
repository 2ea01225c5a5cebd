"""A model named by the operator (a GGUF path, an http(s) URL or a catalog id): where its header is read
from, its memory estimate under given server options, and a catalog entry for a GGUF known only by its header.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path

from controller.errors import CatalogError, ControllerError
from controller.model.catalog import Catalog, ModelEntry, resolve_catalog_model
from controller.stages.estimate.gguf_header import GGUFHeader, read_header
from controller.stages.estimate.memory import Estimate, EstimateInputError, resolve_settings
from controller.stages.estimate.memory import estimate as run_estimate
from controller.stages.estimate.model import ModelSpec, model_spec


class EstimateError(ControllerError):
    """The estimate options are inconsistent (e.g. GPU lists of different lengths)."""

    exit_code = 2


def resolve_model_source(model: str) -> str:
    """A path or URL to read the GGUF header from; catalog ids go through ``controller.model.catalog``.

    ``controller.model.catalog.resolve_catalog_model(id)`` returns a local path, an http(s) URL, or an entry that
    knows its download URL.
    """
    if model.startswith(("http://", "https://")) or Path(model).exists():
        return model
    if model.endswith(".gguf") or "/" in model:
        raise CatalogError(f"{model}: no such file; give an existing GGUF path, an http(s) URL or a catalog id")
    try:
        entry = resolve_catalog_model(model)
    except CatalogError:
        raise
    except (KeyError, LookupError) as exc:
        raise CatalogError(f"{model!r} is not in the model catalog ({exc}); list the catalog for valid ids") from None
    if isinstance(entry, (str, Path)):
        return str(entry)
    url = getattr(entry, "url", None)
    if callable(url):
        return str(url())
    raise CatalogError(f"catalog entry for {model!r} gives no GGUF location to read the header from")


def estimate_model(model: str, **options: object) -> Estimate:
    """Read MODEL's header and estimate its memory under the given server options."""
    header: GGUFHeader = read_header(resolve_model_source(model))
    return estimate_spec(model_spec(header), **options)


def estimate_spec(spec: ModelSpec, **options: object) -> Estimate:
    """A model's memory under the given server options, from its spec (a header's, or a catalog entry's)."""
    try:
        settings = resolve_settings(spec, **options)  # type: ignore[arg-type]
        return run_estimate(spec, settings)
    except EstimateInputError as exc:
        raise EstimateError(str(exc)) from None


def is_gguf_source(value: str) -> bool:
    """Whether a wanted model names a GGUF file or URL rather than a catalog id."""
    return value.startswith(("http://", "https://")) or value.endswith(".gguf") or Path(value).is_file()


def _plain_name(text: str) -> str:
    """``text`` as a catalog name: runs of other characters become "-", never ".." or a leading dot."""
    return re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._+-]+", "-", text)).lstrip("._+-").rstrip("-")[:200]


def entry_from_header(header: GGUFHeader) -> ModelEntry:
    """A catalog entry for a GGUF known only by its header: shape, engine and features from the header.

    Sliding-window models need upstream (ik_llama.cpp has no iSWA cache); other MoE models prefer
    ik_llama.cpp for its expert offload; the MTP head is there when the header has NextN layers.
    """
    spec = model_spec(header)
    name = re.sub(r"[\x00-\x1f\x7f]", "", re.sub(r"\?.*$", "", header.source).rstrip("/").rsplit("/", 1)[-1])
    model_id = _plain_name(name.removesuffix(".gguf").lower()) or "model"
    sliding = any(layer.kind == "swa" for layer in spec.layers)
    moe = spec.n_expert > 0
    return ModelEntry(
        id=model_id, name=name, repo="local", file=_plain_name(name) or "model.gguf", size_bytes=spec.size_bytes,
        engine="upstream" if sliding or not moe else "ik", moe=moe, mtp=spec.n_layer_all > spec.n_layer,
        sliding_window=sliding, arch=spec.arch, file_type=spec.file_type,
    )


def with_gguf_sources(models: Sequence[str], catalog: Catalog) -> tuple[list[str], Catalog, dict[str, GGUFHeader]]:
    """MODELS as catalog ids: each GGUF path or URL not in CATALOG gets an entry made from its header.

    Returns the ids, the catalog with the added entries, and the headers read (by id), so the planner
    estimates those models from their real headers; only headers are read, nothing is downloaded.
    """
    ids: list[str] = []
    added: dict[str, ModelEntry] = {}
    headers: dict[str, GGUFHeader] = {}
    for model in models:
        if is_gguf_source(model) and model not in catalog.models:
            header = read_header(model)
            entry = entry_from_header(header)
            added[entry.id] = entry
            headers[entry.id] = header
            model = entry.id
        ids.append(model)
    if added:
        catalog = Catalog(models={**catalog.models, **added}, engines=catalog.engines)
    return ids, catalog, headers


def estimate_draft(draft: str, gpus: Sequence[int], gpu_mem_mib: Sequence[float],
                   estimate: Callable[..., Estimate] = estimate_model, **options: object) -> Estimate:
    """The draft model's memory beside a target under the same server options (``controller estimate --draft``).

    llama-server gives the draft the target's context, slots and batches; the plan pins it to the
    target's first card (``--device-draft``) with every layer there, so that is what is estimated.
    ``estimate`` is how a model is estimated (the command's falls back to the catalog).
    """
    options = {key: value for key, value in options.items() if key not in ("split_mode", "n_gpu_layers", "cpu_moe")}
    return estimate(draft, gpus=list(gpus[:1]), gpu_mem_mib=list(gpu_mem_mib[:1]), split_mode="none",
                    n_gpu_layers=None, cpu_moe=False, **options)


def with_draft(data: dict, draft: Estimate) -> dict:
    """The target's ``estimate --json`` with the draft's block added and counted in the totals."""
    own = draft.to_json()
    data["draft"] = {
        "model": own["model"], "weights": own["weights"],
        "kv": {key: own["kv"][key] for key in ("total_mib", "cells", "layers", "bytes_per_token")},
        "compute": own["compute"], "total_mib": own["total_mib"],
    }
    by_name = {device["name"]: device for device in data["devices"]}
    added = 0.0
    for device in own["devices"]:
        mine = by_name.get(device["name"])
        if mine is not None:  # the draft shares the target's process: one CUDA context per card, counted once
            extra = device["weights_mib"] + device["kv_mib"] + device["compute_mib"]
            mine["total_mib"] = round(mine["total_mib"] + extra, 2)
            added += extra
            if mine["capacity_mib"] is not None:
                mine["fits"] = mine["total_mib"] <= mine["capacity_mib"]
    data["draft"]["total_mib"] = round(added, 2)
    data["total_mib"] = round(data["total_mib"] + added, 2)
    return data
