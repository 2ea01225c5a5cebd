"""``controller plan``: the serving configuration that fits a box, and why.

Two forms, one output (the ``ServePlan`` JSON contract: ``{fits, services, unplaced}``, extended with the OS,
folders, engine packs, model files and driver the roles act on):

    controller plan box3 --fleet fleet.yml [--json]
        probe box3 read-only and plan the models its fleet entry wants;
    controller plan box3 --fleet fleet.yml --profile box3.json [--json]
        plan box3's fleet entry (pins, agents, drafts, engines, ...) on a saved profile, without connecting;
    controller plan --profile box3.json --model ID [--model ID ...] [--ctx N] [--agents N] [--json]
        plan from a saved ``controller probe --json`` profile, without touching any box.

``--draft ID`` (a catalog id, a GGUF path/URL, or ``auto``) gives the ``--model`` before it a draft model for
speculative decoding; the service's ``draft`` block says whether the engine accepts the pair, and why.

A ``--model`` may also be a GGUF path or http(s) URL (only its header is read), and ``--header
ID=PATH_OR_URL`` makes a catalog model's estimate use its real GGUF header instead of the catalog's
hyperparameters. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
from pydantic import ValidationError

from controller.errors import PlanError, ProbeError
from controller.model.inputs import MAX_CTX, PROFILE_MAX_BYTES, TooLarge, read_bounded
from controller.model.profile import HardwareProfile
from controller.model.serveplan import ServePlan


def _headers(pairs: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        model_id, sep, source = pair.partition("=")
        if not sep or not model_id or not source:
            raise click.BadParameter(f"{pair!r}: expected ID=PATH_OR_URL", param_hint="--header")
        out[model_id] = source
    return out


def _load_profile(path: Path) -> HardwareProfile:
    try:
        data = read_bounded(path, PROFILE_MAX_BYTES)
        if not data.strip():
            raise ProbeError(f"{path}: the profile is empty; save one with `controller probe BOX --json`")
        profile = HardwareProfile.model_validate_json(data)
    except TooLarge as exc:
        raise ProbeError(f"{path}: the profile is {exc.strerror} (a probe's is a few KiB)") from None
    except OSError as exc:
        raise ProbeError(f"{path}: cannot read the profile: {exc.strerror}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise ProbeError(f"{path}: not a `controller probe --json` profile: {where}: {first['msg']}") from None
    problem = profile.gpu_index_problem()
    if problem:
        raise ProbeError(f"{path}: {problem}; fix the profile or save a fresh one with `controller probe BOX --json`")
    return profile


def _drafts_by_model(args: list[str]) -> list[str | None]:
    """Each ``--model``'s ``--draft`` (None without one), from the command line's order: a ``--draft`` applies
    to the ``--model`` before it."""
    drafts: list[str | None] = []
    words = iter(args)
    for word in words:
        name, sep, value = word.partition("=")
        if name not in ("--model", "--draft"):
            continue
        value = value if sep else next(words, "")
        if name == "--model":
            drafts.append(None)
        elif not drafts:
            raise click.UsageError(f"--draft {value} comes before any --model; put it after the model it drafts for")
        elif drafts[-1] is not None:
            raise click.UsageError(f"--draft {value}: the --model before it already has --draft {drafts[-1]}; give "
                                   f"one draft per model")
        else:
            drafts[-1] = value
    return drafts


class _PairedCommand(click.Command):
    """Keeps which ``--draft`` follows which ``--model`` (click collects each option's values apart)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["drafts"] = _drafts_by_model(list(args))
        return super().parse_args(ctx, args)


def _plan_profile(profile_path: Path, models: tuple[str, ...], ctx: int | None, agents: int, base_port: int,
                  catalogs: tuple[Path, ...], headers: dict[str, str],
                  drafts: list[str | None] | None = None) -> ServePlan:
    from controller.model.catalog import load_catalog
    from controller.model.fleet import WantedModel
    from controller.stages.estimate.source import with_gguf_sources
    from controller.stages.planner import plan_models

    profile = _load_profile(profile_path)
    drafts = list(drafts or []) + [None] * (len(models) - len(drafts or []))
    named = [draft for draft in drafts if draft not in (None, "auto")]
    ids, catalog, read = with_gguf_sources(list(models) + named, load_catalog(catalogs))
    draft_ids = iter(ids[len(models):])
    drafts = [draft if draft in (None, "auto") else next(draft_ids) for draft in drafts]
    wanted = [WantedModel(id=model_id, ctx=ctx, agents=agents, draft=draft)
              for model_id, draft in zip(ids[: len(models)], drafts)]
    return plan_models(wanted, profile, catalog, base_port=base_port, headers={**headers, **read})


def _plan_box(box_name: str, fleet_path: Path, headers: dict[str, str], profile_path: Path | None = None) -> ServePlan:
    from controller.actions.fleetrun import add_gateway, check_selection
    from controller.inventory import Inventory
    from controller.model.fleet import load_fleet
    from controller.stages.planner import plan_box

    fleet = load_fleet(fleet_path)
    catalog = check_selection(fleet, [box_name])  # unknown model ids fail before any connection
    box = fleet.box(box_name)
    default = Inventory.beside(fleet_path)  # plan takes no --inventory: the default one's host keys and plans
    if profile_path is not None:  # on paper: the saved profile stands for the box, nothing connects
        profile = _load_profile(profile_path)
    else:
        from controller.stages.probe.collect import probe_box  # the transports pull in fabric and pywinrm

        profile, _raw, _seconds = probe_box(box, known_hosts=default.known_hosts_file)
    plan = plan_box(box, profile, catalog, headers=headers)
    add_gateway(fleet, box, plan, default.root)  # over the other boxes' rendered plans
    return plan


def emit(plan: ServePlan, as_json: bool) -> None:
    """Print the plan as the contract JSON, or as one block per service with its reasons."""
    if as_json:
        click.echo(json.dumps(plan.model_dump(mode="json"), indent=2))
        return
    for service in plan.services:
        memory = ", ".join(f"{device} {mib} MiB" for device, mib in service.memory.per_device_mib.items())
        click.echo(f"{service.name}: {service.model} on {service.engine}, GPUs {service.gpus or 'none'}, "
                   f"port {service.port}, context {service.ctx} ({service.cache_type_k} cache); {memory}")
        for reason in service.reasons:
            click.echo(f"  - {reason}")
        if service.draft is not None:
            click.echo(f"  draft {service.draft.model} ({'compatible' if service.draft.compatible else 'REFUSED'}):")
            for reason in service.draft.reasons:
                click.echo(f"    - {reason}")
        env = " ".join(f"{key}={value}" for key, value in service.env.items())
        click.echo(f"  {env + ' ' if env else ''}llama-server {' '.join(service.args)}")
        for item in service.on_demand.models if service.on_demand is not None else ():
            memory = ", ".join(f"{device} {mib} MiB" for device, mib in item.memory.per_device_mib.items())
            click.echo(f"  on demand: {item.id}, context {item.ctx} ({item.cache_type_k} cache); {memory}")
            for reason in item.reasons:
                click.echo(f"    - {reason}")
    for gpu in plan.idle_gpus:
        click.echo(f"idle: GPU {gpu.index} {gpu.name}: {gpu.reason}")
    if plan.gateway is not None:
        routes = ", ".join(f"{route.model} -> {route.box} {route.host}:{route.port}" for route in plan.gateway.routes)
        click.echo(f"gateway on port {plan.gateway.port}: {routes}")
        for reason in plan.gateway.reasons:
            click.echo(f"  - {reason}")
    for item in plan.unplaced:  # last: what was asked for and will not be served
        click.echo(f"not placed: {item.model}: {item.reason}")


def refuse_unplaced(plan: ServePlan) -> None:
    """Exit as ``provision`` does (4) when not every wanted model fits; the plan has been printed already."""
    if plan.unplaced:
        raise PlanError("not every wanted model fits: "
                        + "; ".join(f"{item.model}: {item.reason}" for item in plan.unplaced))


@click.command("plan", cls=_PairedCommand)
@click.argument("box", required=False)
@click.option("--fleet", "fleet_path", type=click.Path(path_type=Path, dir_okay=False),
              help="Fleet file naming BOX and the models it wants (probes BOX read-only).")
@click.option("--profile", "profile_path", type=click.Path(path_type=Path, dir_okay=False),
              help="A saved `controller probe --json` profile to plan for, instead of probing a box (with BOX: "
                   "BOX's fleet entry on that profile).")
@click.option("--model", "models", multiple=True,
              help="Catalog id (or GGUF path/URL) to serve; repeat for several. With --profile.")
@click.option("--draft", "drafts", multiple=True,
              help="Draft model (catalog id, GGUF path/URL, or auto) for the --model before it: speculative decoding.")
@click.option("--ctx", type=click.IntRange(min=512, max=MAX_CTX), default=None,
              help="Context each model must offer (default: the largest that fits, up to 131072).")
@click.option("--agents", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Concurrent agents per model: --parallel N with one shared KV cache.")
@click.option("--base-port", type=click.IntRange(1024, 65000), default=8001, show_default=True,
              help="Port of the first model; the others follow. With --profile.")
@click.option("--catalog", "catalogs", multiple=True, type=click.Path(path_type=Path, dir_okay=False),
              help="Extra model catalog merged over the built-in one. With --profile.")
@click.option("--header", "header_pairs", multiple=True,
              help="ID=PATH_OR_URL: estimate catalog model ID from this GGUF's header (read, never downloaded).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON: {fits, services, unplaced}.")
def plan(box: str | None, fleet_path: Path | None, profile_path: Path | None, models: tuple[str, ...],
         drafts: tuple[str, ...], ctx: int | None, agents: int, base_port: int, catalogs: tuple[Path, ...], header_pairs: tuple[str, ...],
         as_json: bool) -> None:
    """Plan the llama.cpp services for BOX (probed, or on a saved --profile), or for a profile and the given models.

    The plan is printed whole; when a wanted model does not fit, the command then exits 4, as provision does.
    """
    headers = _headers(header_pairs)
    if box is not None:
        if models or drafts or ctx is not None or agents != 1 or catalogs:
            raise click.UsageError("with BOX the fleet file says what to serve: drop --model, --draft, --ctx, --agents "
                                   "and --catalog, or drop BOX to plan from a profile")
        if fleet_path is None:
            raise click.UsageError("planning box BOX needs the fleet file that says what it serves: add --fleet FILE")
    elif profile_path is None or not models:
        raise click.UsageError("give BOX with --fleet FILE, or --profile PROFILE.json with at least one --model ID")
    result = (_plan_box(box, fleet_path, headers, profile_path) if box is not None else
              _plan_profile(profile_path, models, ctx, agents, base_port, catalogs, headers,
                            click.get_current_context().meta.get("drafts")))
    emit(result, as_json)
    refuse_unplaced(result)
