"""The lab's download site: a CPU engine release pack with SHA256SUMS, tiny models, and a catalog.

Everything is written under one folder that ``lab.fileserver.FileServer`` serves:

    engines/llama-cpu-0c1e570-linux-x86_64.tar.gz   bin/llama-server, bin/llama-bench, BUILD-INFO
    engines/SHA256SUMS
    lab/tiny-models-GGUF/<file>.gguf                   the hub layout: <org>/<repo>/<file>
    catalog.yml                                        catalog entries for those models and the CPU
                                                       engine, sha256 pinned (the site is plain HTTP, so
                                                       its SHA256SUMS alone is not trusted)
"""

from __future__ import annotations

import filecmp
import io
import os
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from controller.files import write_atomic
from controller.model.catalog import load_catalog
from controller.stages.estimate.gguf_header import read_header
from lab import engine_build, tinymodels
from lab.engine_build import sha256_file

PACK_NAME = "llama-cpu-0c1e570-linux-x86_64.tar.gz"
LAB_ENGINE = "cpu-0c1e570"
MODEL_REPO = "lab/tiny-models-GGUF"


@dataclass(frozen=True)
class LabModel:
    id: str
    file: str
    arch: str
    file_type: str = "q8_0"
    n_ctx_train: int = 4096
    # The GGUF's own chat template (None: tinymodels' default, which offers no tools). A random model calls a
    # tool only under tinymodels.TOOL_CALL_TEMPLATE, so only such a model says tool_calls in the catalog.
    chat_template: str | None = None
    # A scripted model (tinymodels.write_scripted_model with its AGENT_TEMPLATE): it calls tools and answers.
    scripted: bool = False

    @property
    def tool_calls(self) -> bool:
        return self.scripted or self.chat_template == tinymodels.TOOL_CALL_TEMPLATE


# The demo model completes an agent's tool loop: scripted (tinymodels.AGENT_TEMPLATE), it reads notes.txt when
# Claude Code offers Read and the prompt names the file, calls certify's get_time, and answers after a tool result
# or otherwise (OpenClaw's turn). Trained (in its header) for 128k tokens, so the demo box can plan the 64k Claude
# Code and OpenClaw need; at this size 64k of f16 KV is 8 MiB. A cached site's file written from another recipe
# is written again (build_site).
DEMO_MODELS = (LabModel("tiny-llama", "tiny-llama-128k-q8_0.gguf", "llama", n_ctx_train=131072, scripted=True),)
# What `controller certify` serves when its tool-call round trip must run for real (tests/integration).
TOOLS_MODEL = LabModel("tiny-llama-tools", "tiny-llama-tools-q8_0.gguf", "llama",
                       chat_template=tinymodels.TOOL_CALL_TEMPLATE)
SITE_MODELS = (*DEMO_MODELS, TOOLS_MODEL)


# What `controller certify` expects of a lab model served on the CPU engine in a lab container. Measured on this
# 2-core lab machine with the server's own timings on certify's fixed prompt (64 generated tokens, single
# stream): medians of ~2000 tok/s generation on the host, lower in a container while other tests run: 63 tok/s
# while the suite's three workers kept both cores busy (2026-11-26). The minimum leaves room for that; a box under
# it is broken, not slow.
DEMO_BAND = {
    "hardware": "the lab's CPU engine in a container on a 2-core machine",
    "gpus": 0,
    "reference_gen_tok_s": 2000,
    "gen_tok_s": [10, None],
    "source": "measured on the lab machine, 2026-11-24: median 2042 tok/s generation over 5 runs of the fixed prompt",
}


def _shape(path: Path) -> dict:
    """The catalog's arch/hparams/file_type from the file's own header, so plans are exact."""
    header = read_header(path)
    prefix = f"{header.arch}."
    hparams = {key[len(prefix):]: value for key, value in header.metadata.items()
               if key.startswith(prefix) and isinstance(value, (int, float, bool, list))}
    return {"arch": header.arch, "hparams": hparams}


def make_pack(engine_dir: Path, dest: Path) -> Path:
    """A reproducible tar.gz with bin/ at its top level, as the llama_engine role expects."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as archive:
        for name, mode in (("bin", 0o755),):
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, 0
            archive.addfile(info)
        for name in sorted(os.listdir(engine_dir)):
            source = engine_dir / name
            arcname = f"bin/{name}" if os.access(source, os.X_OK) else name
            info = archive.gettarinfo(str(source), arcname)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
            with open(source, "rb") as handle:
                archive.addfile(info, handle)
    write_atomic(dest, buffer.getvalue())
    return dest


def write_sums(folder: Path) -> Path:
    lines = [f"{sha256_file(path)}  {path.name}\n" for path in sorted(folder.iterdir())
             if path.is_file() and path.name != "SHA256SUMS" and not path.name.startswith(".")]
    target = folder / "SHA256SUMS"
    write_atomic(target, "".join(lines))
    return target


def pinned_engine(pack: Path) -> dict[str, dict]:
    """The built-in CPU engine entry with this pack's sha256 pinned (a catalog entry replaces the built-in one)."""
    engine = load_catalog().engine(LAB_ENGINE)
    body = engine.model_dump(mode="json", exclude={"id"}, exclude_none=True)
    body["packs"]["linux-x86_64"] = {"file": pack.name, "sha256": sha256_file(pack)}
    return {LAB_ENGINE: body}


def write_model(model: LabModel, path: Path) -> None:
    """Write ``model`` at ``path`` unless the file there has exactly its bytes (the generators are deterministic, so
    a file written from an older recipe is replaced, atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    tmp.chmod(0o644)  # as the files written before: anyone on the machine may read the lab's models
    try:
        if model.scripted:
            tinymodels.write_scripted_model(tmp, n_ctx_train=model.n_ctx_train, file_type=model.file_type,
                                            name=model.id)
        else:
            tinymodels.write_model(tmp, model.arch, file_type=model.file_type, name=model.id,
                                   n_ctx_train=model.n_ctx_train,
                                   **({"chat_template": model.chat_template} if model.chat_template else {}))
        if path.exists() and filecmp.cmp(tmp, path, shallow=False):
            return
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def mirror(url: str) -> dict[str, str]:
    """A fleet's ``mirror:`` for the site served at ``url``: its engine packs and its models."""
    return {"engines": f"{url}/engines", "models": url}


def build_site(root: Path, models: tuple[LabModel, ...] = SITE_MODELS) -> Path:
    """Fill ``root`` with the engine pack and the models; returns the catalog file."""
    engines = root / "engines"
    pack = engines / PACK_NAME
    if not pack.exists():
        make_pack(engine_build.build(), pack)
    write_sums(engines)
    entries = {}
    for model in models:
        path = root / MODEL_REPO / model.file
        write_model(model, path)
        entries[model.id] = {
            "name": f"{'Scripted' if model.scripted else 'Generated'} {model.arch} test model ({model.file_type})",
            "repo": MODEL_REPO,
            "file": model.file,
            "size_bytes": path.stat().st_size,
            "sha256": sha256_file(path),
            "engine": "upstream",
            "file_type": model.file_type,
            "throughput": [DEMO_BAND],
            "tool_calls": model.tool_calls,
            **_shape(path),
        }
    catalog = root / "catalog.yml"
    write_atomic(catalog, yaml.safe_dump({"models": entries, "engines": pinned_engine(pack)}, sort_keys=True))
    return catalog
