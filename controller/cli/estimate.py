"""``controller estimate``: predict a llama.cpp server's memory from a GGUF header, before any download.

MODEL is a local GGUF path, an http(s) URL (only the header is fetched, with Range requests), or a
model catalog id; the work is ``controller.stages.estimate.source.estimate_model``.
"""

from __future__ import annotations

import json
import math

import click

from controller.model.catalog import ModelEntry
from controller.model.inputs import MAX_CTX, MAX_GPU_INDEX, MAX_GPU_MIB, MAX_SLOTS
from controller.stages.estimate.memory import ENGINES, SPLIT_MODES, Estimate
from controller.stages.estimate.model import QUANT_CACHE_TYPES
from controller.stages.estimate.source import (
    EstimateError,
    estimate_draft,
    estimate_spec,
    is_gguf_source,
    resolve_model_source,
    with_draft,
)


def _number_list(value: str | None, option: str, kind: type = int) -> list:
    """``--gpus 0,1`` or ``--gpu-mib 16000,16000`` as numbers; a bad entry is the operator's to fix."""
    if not value:
        return []
    try:
        return [kind(part) for part in value.split(",") if part.strip()]
    except ValueError:
        what = "integers" if kind is int else "numbers (MiB)"
        raise EstimateError(f"{option} takes comma-separated {what}, got {value!r}") from None


def _shown(value: object) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} characters)"


def _check_range(option: str, value: int | None, least: int, most: int, meaning: str) -> None:
    if value is not None and not least <= value <= most:
        raise EstimateError(f"{option} {_shown(value)}: give {meaning}")


def _check_options(ctx: int | None, parallel: int | None, ubatch: int | None, batch: int | None,
                   n_gpu_layers: int | None) -> None:
    """Refuse, in one line, a number llama-server would never run with (it would otherwise be estimated)."""
    _check_range("--ctx", ctx, 0, MAX_CTX, f"0 (the model's training context) or a context of 1 to {MAX_CTX} tokens")
    _check_range("--parallel", parallel, 1, MAX_SLOTS, f"1 to {MAX_SLOTS} server slots (llama.cpp's most)")
    _check_range("--ubatch", ubatch, 1, MAX_CTX, f"a physical batch of 1 to {MAX_CTX} tokens (llama.cpp's default: 512)")
    _check_range("--batch", batch, 1, MAX_CTX, f"a logical batch of 1 to {MAX_CTX} tokens (llama.cpp's default: 2048)")
    _check_range("--n-gpu-layers", n_gpu_layers, -1, MAX_CTX, "-1 (every layer) or the number of layers on the GPUs")


def _gpu_indices(value: str | None) -> list[int]:
    """``--gpus``: nvidia-smi indices, each once (a repeated one would count one card as two)."""
    indices = _number_list(value, "--gpus")
    for index in indices:
        if not 0 <= index <= MAX_GPU_INDEX:
            raise EstimateError(f"--gpus {_shown(value)}: GPU {_shown(index)} is not a GPU index; give nvidia-smi's "
                                f"numbers, 0 to {MAX_GPU_INDEX}, e.g. 0,1")
        if indices.count(index) > 1:
            raise EstimateError(f"--gpus {_shown(value)}: GPU {index} is listed twice; give each GPU once, e.g. 0,1")
    return indices


def _gpu_memory(value: str | None) -> list[float]:
    """``--gpu-mem-mib``: a finite, positive size per GPU; NaN, infinity, zero and negatives are typos."""
    sizes = _number_list(value, "--gpu-mem-mib", float)
    for size in sizes:
        if not (math.isfinite(size) and 0 < size <= MAX_GPU_MIB):
            raise EstimateError(f"--gpu-mem-mib {_shown(value)}: {_shown(size)} is not a GPU's memory; give each "
                                f"GPU's memory in MiB, above 0 and at most {MAX_GPU_MIB}, e.g. 16384,16384")
    if len(sizes) > MAX_GPU_INDEX + 1:
        raise EstimateError(f"--gpu-mem-mib gives {len(sizes)} GPUs; a box has at most {MAX_GPU_INDEX + 1}: give one "
                            "size per GPU of --gpus")
    return sizes


def _render_text(result: Estimate) -> str:
    data = result.to_json()
    m, kv = data["model"], data["kv"]
    lines = [
        (f"model   {m['arch']}  {m['n_layer']} layers  {m['params'] / 1e9:.2f} B params  {m['file_type']}  "
         f"{m['size_bytes'] / 2**30:.2f} GiB  (trained ctx {m['n_ctx_train']})"),
        f"kv      {kv['total_mib']:.1f} MiB  {kv['cells']} cells x {kv['streams']} stream(s), {kv['layers']} layers"
        + (f" ({kv['swa_layers']} SWA at {kv['swa_cells']} cells)" if kv["swa_layers"] else "")
        + f", {kv['bytes_per_token']} B/token",
        f"{'device':<8}{'weights':>12}{'kv':>12}{'compute':>12}{'overhead':>12}{'total':>12}  MiB",
    ]
    for d in data["devices"]:
        cap = "" if d["capacity_mib"] is None else f"  of {d['capacity_mib']:.0f} {'ok' if d['fits'] else 'DOES NOT FIT'}"
        lines.append(f"{d['name']:<8}{d['weights_mib']:>12.1f}{d['kv_mib']:>12.1f}{d['compute_mib']:>12.1f}"
                     f"{d['overhead_mib']:>12.1f}{d['total_mib']:>12.1f}{cap}")
    lines.append(f"total   {data['total_mib']:.1f} MiB")
    if data.get("host_pinned"):
        pinned = data["host_pinned"]
        lines.append(f"pinned  {pinned['total_mib']:.1f} MiB of the CPU row is page-locked host memory ({pinned['buffer']}: "
                     f"compute {pinned['compute_mib']:.1f}, output {pinned['output_mib']:.1f})")
    lines += [f"note    {note}" for note in data["notes"]]
    return "\n".join(lines)


def estimate_from_source(model: str, **options: object) -> tuple[Estimate, dict[str, str | None]]:
    """MODEL's estimate and what it was made from (``source`` of ``--json``): its GGUF header, or, for a catalog id
    whose header cannot be read (no access to the hub), the catalog's hyperparameters, which ``plan`` uses offline."""
    from controller.errors import CatalogError
    from controller.stages.estimate.gguf_header import GGUFHeaderError, read_header
    from controller.stages.estimate.model import model_spec

    location = None
    try:
        location = resolve_model_source(model)
        header = read_header(location)
    except (GGUFHeaderError, CatalogError) as unread:
        entry = None if is_gguf_source(model) or "/" in model else _catalog_entry(model)
        if entry is None or not entry.hparams:
            raise
        from controller.stages.planner.specs import spec_from_hparams

        return estimate_spec(spec_from_hparams(entry), **options), {
            "kind": "catalog", "model": entry.id, "header": location, "why": str(unread)}
    return estimate_spec(model_spec(header), **options), {"kind": "header", "header": header.source}


def _catalog_entry(model: str) -> ModelEntry | None:
    from controller.errors import CatalogError
    from controller.model.catalog import resolve_catalog_model

    try:
        return resolve_catalog_model(model)
    except CatalogError:
        return None


def _source_line(source: dict[str, str | None]) -> str:
    if source["kind"] == "header":
        return f"source  the GGUF header of {source['header']}"
    return (f"source  the catalog's hyperparameters of {source['model']}: its GGUF header could not be read "
            f"({source['why']})")


@click.command("estimate")
@click.argument("model")
@click.option("--ctx", type=int, default=None, help="Context size (default: the model's training context).")
@click.option("--parallel", type=int, default=None, help="Server slots (default: the engine's, 4 on upstream).")
@click.option("--kv-unified/--no-kv-unified", default=None, help="One KV cache shared by all slots.")
@click.option("--cache-type-k", type=click.Choice(QUANT_CACHE_TYPES), default="f16", show_default=True)
@click.option("--cache-type-v", type=click.Choice(QUANT_CACHE_TYPES), default="f16", show_default=True)
@click.option("--ubatch", type=int, default=None, help="Physical batch (default 512).")
@click.option("--batch", type=int, default=None, help="Logical batch (default 2048).")
@click.option("--flash-attn", type=click.Choice(["on", "off"]), default=None, help="Default: auto (on).")
@click.option("--engine", type=click.Choice(ENGINES), default="upstream", show_default=True)
@click.option("--gpus", default=None, help="GPU indices, e.g. 0,1 (default: CPU only).")
@click.option("--gpu-mem-mib", default=None, help="Memory of each GPU in MiB, e.g. 16384,16384.")
@click.option("--split-mode", type=click.Choice(SPLIT_MODES), default="layer", show_default=True)
@click.option("--n-gpu-layers", type=int, default=None, help="Layers on the GPUs (default: all when --gpus is set).")
@click.option("--cpu-moe", is_flag=True, help="Keep routed experts in host memory.")
@click.option("--draft", "draft", default=None,
              help="Draft model (GGUF path, URL or catalog id) served beside MODEL for speculative decoding: its "
                   "weights on the first GPU, its own KV cache at the same context; counted in the totals.")
@click.option("--json", "as_json", is_flag=True, help="Print the estimate as JSON.")
def estimate(model: str, ctx: int | None, parallel: int | None, kv_unified: bool | None, cache_type_k: str,
             cache_type_v: str, ubatch: int | None, batch: int | None, flash_attn: str | None, engine: str,
             gpus: str | None, gpu_mem_mib: str | None, split_mode: str, n_gpu_layers: int | None,
             cpu_moe: bool, draft: str | None, as_json: bool) -> None:
    """Predict the memory a llama.cpp server will use for MODEL (a GGUF path, URL or catalog id)."""
    _check_options(ctx, parallel, ubatch, batch, n_gpu_layers)
    gpu_list = _gpu_indices(gpus)
    mem_list = _gpu_memory(gpu_mem_mib)
    if mem_list and not gpu_list:
        gpu_list = list(range(len(mem_list)))
    sources: dict[str, dict[str, str | None]] = {}

    def estimating(name: str, **options: object) -> Estimate:
        found, sources[name] = estimate_from_source(name, **options)
        return found

    result = estimating(
        model, engine=engine, ctx=ctx, parallel=parallel, kv_unified=kv_unified, cache_type_k=cache_type_k,
        cache_type_v=cache_type_v, ubatch=ubatch, batch=batch, flash_attn=flash_attn, gpus=gpu_list,
        gpu_mem_mib=mem_list, split_mode=split_mode, n_gpu_layers=n_gpu_layers, cpu_moe=cpu_moe,
    )
    if draft is None:
        data = {**result.to_json(), "source": sources[model]}
        click.echo(json.dumps(data, indent=2) if as_json else _render_text(result) + "\n" + _source_line(data["source"]))
        return
    paired = estimate_draft(draft, gpu_list, mem_list, estimating, engine=engine, ctx=result.settings.ctx,
                            parallel=result.settings.parallel, kv_unified=result.settings.kv_unified,
                            cache_type_k=cache_type_k, cache_type_v=cache_type_v, ubatch=ubatch, batch=batch,
                            flash_attn=flash_attn)
    data = with_draft({**result.to_json(), "source": sources[model]}, paired)
    data["draft"]["source"] = sources[draft]
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    d = data["draft"]
    click.echo(_render_text(result))
    click.echo(_source_line(data["source"]))
    click.echo(f"draft   {d['model']['arch']} {d['model']['n_layer']} layers: weights {d['weights']['total_mib']:.1f}"
               f"  kv {d['kv']['total_mib']:.1f} ({d['kv']['cells']} cells, {d['kv']['layers']} layers)  compute "
               f"{d['compute']['total_mib']:.1f}  total {d['total_mib']:.1f} MiB")
    click.echo(f"pair    {data['total_mib']:.1f} MiB  ("
               + ", ".join(f"{dev['name']} {dev['total_mib']:.1f}" for dev in data["devices"]) + ")")
