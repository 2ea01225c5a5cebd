"""``controller estimate``: predict a llama.cpp server's memory from a GGUF header, before any download.

MODEL is a local GGUF path, an http(s) URL (only the header is fetched, with Range requests), or a
model catalog id. Register with ``cli.add_command(estimate)`` in controller/cli.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from controller.errors import CatalogError, ControllerError
from controller.estimate.gguf_header import GGUFHeader, read_header
from controller.estimate.memory import (
    ENGINES,
    SPLIT_MODES,
    Estimate,
    EstimateInputError,
    resolve_settings,
)
from controller.estimate.memory import (
    estimate as run_estimate,
)
from controller.estimate.model import QUANT_CACHE_TYPES, model_spec


class EstimateError(ControllerError):
    """The estimate options are inconsistent (e.g. GPU lists of different lengths)."""

    exit_code = 2


def resolve_model_source(model: str) -> str:
    """A path or URL to read the GGUF header from; catalog ids go through ``controller.catalog``.

    The catalog is imported lazily so that estimating a local file or URL never depends on it.
    ``controller.catalog.resolve_catalog_model(id)`` must return a local path or an http(s) URL.
    """
    if model.startswith(("http://", "https://")) or Path(model).exists():
        return model
    if model.endswith(".gguf") or "/" in model:
        raise CatalogError(f"{model}: no such file; give an existing GGUF path, an http(s) URL or a catalog id")
    try:
        from controller.catalog import resolve_catalog_model
    except ImportError:
        raise CatalogError(
            f"{model!r} is not a file or URL, and no model catalog is available to look it up; "
            "pass a GGUF path or URL"
        ) from None
    try:
        entry = resolve_catalog_model(model)
    except CatalogError:
        raise
    except (KeyError, LookupError) as exc:
        raise CatalogError(f"{model!r} is not in the model catalog ({exc}); list the catalog for valid ids") from None
    # The catalog returns either a location or an entry that knows its download URL.
    if isinstance(entry, (str, Path)):
        return str(entry)
    url = getattr(entry, "url", None)
    if callable(url):
        return str(url())
    raise CatalogError(f"catalog entry for {model!r} gives no GGUF location to read the header from")


def _int_list(value: str | None, option: str) -> list[int]:
    if not value:
        return []
    try:
        return [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise EstimateError(f"{option} takes comma-separated integers, got {value!r}") from None


def _float_list(value: str | None, option: str) -> list[float]:
    if not value:
        return []
    try:
        return [float(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise EstimateError(f"{option} takes comma-separated numbers (MiB), got {value!r}") from None


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
    lines += [f"note    {note}" for note in data["notes"]]
    return "\n".join(lines)


def estimate_model(model: str, **options: object) -> Estimate:
    """Read MODEL's header and estimate its memory under the given server options."""
    header: GGUFHeader = read_header(resolve_model_source(model))
    spec = model_spec(header)
    try:
        settings = resolve_settings(spec, **options)  # type: ignore[arg-type]
        return run_estimate(spec, settings)
    except EstimateInputError as exc:
        raise EstimateError(str(exc)) from None


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
@click.option("--json", "as_json", is_flag=True, help="Print the estimate as JSON.")
def estimate(model: str, ctx: int | None, parallel: int | None, kv_unified: bool | None, cache_type_k: str,
             cache_type_v: str, ubatch: int | None, batch: int | None, flash_attn: str | None, engine: str,
             gpus: str | None, gpu_mem_mib: str | None, split_mode: str, n_gpu_layers: int | None,
             cpu_moe: bool, as_json: bool) -> None:
    """Predict the memory a llama.cpp server will use for MODEL (a GGUF path, URL or catalog id)."""
    try:
        gpu_list = _int_list(gpus, "--gpus")
        mem_list = _float_list(gpu_mem_mib, "--gpu-mem-mib")
        if mem_list and not gpu_list:
            gpu_list = list(range(len(mem_list)))
        result = estimate_model(
            model, engine=engine, ctx=ctx, parallel=parallel, kv_unified=kv_unified, cache_type_k=cache_type_k,
            cache_type_v=cache_type_v, ubatch=ubatch, batch=batch, flash_attn=flash_attn, gpus=gpu_list,
            gpu_mem_mib=mem_list, split_mode=split_mode, n_gpu_layers=n_gpu_layers, cpu_moe=cpu_moe,
        )
    except ControllerError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    click.echo(json.dumps(result.to_json(), indent=2) if as_json else _render_text(result))
