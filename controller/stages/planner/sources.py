"""Where a box gets what its plan needs: engine packs, model files, the driver and the service wrapper.

The catalog pins what (file names, checksums); the fleet's mirrors say from where. Nothing here
refuses: an address or checksum that is missing stays None in the plan, and rendering refuses it for
the box that would install it, so ``controller plan`` still shows a plan for a box not yet ready.
"""

from __future__ import annotations

from controller.errors import CatalogError
from controller.model.catalog import Catalog, DownloadEntry, EngineEntry, ModelEntry
from controller.model.fleet import Box, Mirror
from controller.model.profile import Gpu, HardwareProfile
from controller.model.rules import (
    DRIVER_BRANCHES,
    DRIVER_DEFAULT_BRANCH,
    DRIVER_WINDOW,
    WINDOWS_DRIVER,
    arch_label,
    branch_problem,
    is_v100,
)
from controller.model.serveplan import Download, DriverPlan, EnginePack, ModelFile

PLATFORMS = {"linux": "linux-x86_64", "windows": "windows-x86_64"}
WINSW = "winsw-2.12.0"


def engine_pack(engine: EngineEntry, os: str, mirror: Mirror | None) -> EnginePack:
    """The engine's release pack for the box's platform, from the fleet's engines mirror (None: it has none)."""
    platform = PLATFORMS[os]
    pack = engine.packs.get(platform)
    cache = mirror.cache if mirror is not None and mirror.cache is not None and mirror.cache.engines else None
    if cache is not None:  # the fleet's LAN cache, which fills itself from cache.engines
        base = f"{cache.url}/engines"
    else:
        base = mirror.engines.rstrip("/") if mirror is not None and mirror.engines else None
    download = None if pack is None else Download(
        id=engine.id, version=engine.commit, file=pack.file, sha256=pack.sha256,
        what="cache.engines" if cache else "mirror.engines",
        url=f"{base}/{pack.file}" if base else None,
        sha256sums_url=f"{base}/SHA256SUMS" if base and not pack.sha256 else None,
        cache=cache.host if cache else None,
        fallback_url=f"{cache.engines}/{pack.file}" if cache and cache.fallback else None,
    )
    return EnginePack(id=engine.id, slot=engine.slot, commit=engine.commit, family=engine.family, platform=platform,
                      nccl=engine.nccl, api_key_flag=engine.api_key.file_flag,
                      no_slots_flags=list(engine.no_slots_flags), download=download,
                      cuda_archs=list(engine.cuda_archs or []))


def model_file(entry: ModelEntry, os: str, mirror: Mirror | None) -> ModelFile:
    """The model's GGUF through the fleet's LAN cache, else from the models mirror, else the hub.

    The role sends the hub token to the hub only; to the models mirror as well when the fleet says so
    (``mirror.models_token``, https only: rendering refuses it over plain HTTP). Windows boxes get no token.
    """
    cache = mirror.cache if mirror is not None and mirror.cache is not None and mirror.cache.models else None
    if cache is not None:  # through the fleet's LAN cache (plain HTTP inside the LAN: no token), filled from upstream
        return ModelFile(id=entry.id, file=entry.file, url=entry.url(f"{cache.url}/models"), sha256=entry.sha256,
                         size_bytes=entry.size_bytes, cache=cache.host,
                         fallback_url=entry.url(cache.models) if cache.fallback else None)
    mirror_models = mirror.models if mirror is not None else None
    try:
        url = entry.url(mirror_models)
    except CatalogError:
        url = None
    token = os == "linux" and bool(mirror_models) and bool(mirror is not None and mirror.models_token)
    return ModelFile(id=entry.id, file=entry.file, url=url, sha256=entry.sha256, size_bytes=entry.size_bytes,
                     token=token)


def download(entry: DownloadEntry, mirror_base: str | None, what: str) -> Download:
    url = f"{mirror_base.rstrip('/')}/{entry.file}" if mirror_base else entry.url
    return Download(id=entry.id, version=entry.version, file=entry.file, url=url, sha256=entry.sha256, what=what)


def catalog_download(catalog: Catalog, download_id: str, mirror_base: str | None, what: str) -> Download | None:
    entry = catalog.downloads.get(download_id)
    return None if entry is None else download(entry, mirror_base, what)


def service_wrapper(box: Box, catalog: Catalog) -> Download | None:
    """WinSW, which runs each llama-server as a Windows service."""
    if box.os != "windows":
        return None
    cache = box.mirror.cache
    if cache is not None and cache.engines:
        return catalog_download(catalog, WINSW, f"{cache.url}/engines", "cache.engines")
    return catalog_download(catalog, WINSW, box.mirror.engines, "mirror.engines")


def _cards(gpus: list[Gpu]) -> str:
    groups: dict[str, list[int]] = {}
    for gpu in gpus:
        groups.setdefault(arch_label(gpu.arch) if gpu.arch is not None else "compute capability unknown",
                          []).append(gpu.index)
    return ", ".join(f"{label}: GPU{'s' if len(indices) > 1 else ''} {','.join(map(str, indices))}"
                     for label, indices in groups.items())


def driver_cards(profile: HardwareProfile, branch: int) -> list[str]:
    """The driver window checked against every card of a box with a V100: the branch must drive them all.

    A card the branch cannot drive stays idle (the planner gives it nothing); the V100s decide the branch,
    so nothing newer than the last Volta branch is installed while one is present.
    """
    others = [gpu for gpu in profile.gpus if not is_v100(gpu.name)]
    if not others:
        return []
    bad = [(gpu, problem) for gpu in others if (problem := branch_problem(gpu.arch, branch))]
    reasons = []
    good = [gpu for gpu in profile.gpus if gpu not in [g for g, _ in bad]]
    reasons.append(f"every card checked against the driver window: R{branch} drives {_cards(good)}; the V100s hold the box "
                   f"to {DRIVER_WINDOW} (nothing newer than R{DRIVER_BRANCHES[-1]}, the last branch with Volta) even "
                   f"though its other cards could take a newer branch")
    reasons += [f"GPU {gpu.index} {gpu.name}: R{branch} cannot drive it ({problem}); it stays idle while a V100 "
                f"holds the box to {DRIVER_WINDOW}" for gpu, problem in bad]
    return reasons


def plan_driver(box: Box, profile: HardwareProfile, catalog: Catalog, *, nccl: bool = False) -> DriverPlan:
    """What the driver role does: leave it to the owner, or keep/install the driver the V100s need."""
    v100 = any(is_v100(gpu.name) for gpu in profile.gpus)
    reasons = []
    if not box.driver.manage:
        reasons.append("driver.manage is false: the box's owner keeps the NVIDIA driver")
    elif not v100:
        reasons.append("no V100 among the probed GPUs: the driver role leaves the box alone"
                       + (f" ({_cards(profile.gpus)}); Volta's {DRIVER_WINDOW} window does not bind it, so its owner "
                          f"may run any branch that drives these cards and the engine packs' CUDA builds"
                          if profile.gpus else ""))
    if v100:
        reasons += driver_cards(profile, DRIVER_BRANCHES[0] if box.os == "windows" else box.driver.branch)
    if box.os == "windows":
        mode = "mcdm" if box.driver.wsl2 else "tcc"
        installer = None
        if box.driver.manage and v100:
            installer = catalog_download(catalog, f"nvidia-windows-{WINDOWS_DRIVER}", box.mirror.drivers,
                                         "mirror.drivers")
            reasons.append(f"the R{DRIVER_BRANCHES[0]} data-center driver {WINDOWS_DRIVER}, and the V100s in "
                           + ("MCDM: the box is used through WSL2" if mode == "mcdm" else
                              "TCC, the native compute mode (MCDM decodes up to 43% slower)"))
        return DriverPlan(manage=box.driver.manage, installs=box.driver.manage and v100,
                          allow_reboot=box.driver.allow_reboot, mode=mode, installer=installer, reasons=reasons)
    if box.driver.manage and v100:
        reasons.append(f"driver branch R{box.driver.branch}"
                       + (" (the last with Volta)" if box.driver.branch == DRIVER_DEFAULT_BRANCH else "")
                       + " with the proprietary kernel modules (the open modules do not support Volta)")
    if nccl:
        reasons.append("NCCL: a service splits a dense model by tensor and all-reduces over NVLink with it")
    return DriverPlan(manage=box.driver.manage, installs=box.driver.manage and v100, branch=box.driver.branch,
                      allow_reboot=box.driver.allow_reboot, nccl=nccl, reasons=reasons)


