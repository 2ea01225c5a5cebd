"""The recorded-truth cases: a generated model, the server settings, and what the server allocated for them.

The cases are the ones recorded on the H100 (../shared/fixtures/gpu-h100-580/cuda-truth, same names and
hyperparameters; a unit test keeps them equal). Each run writes ``<case>.json`` in that folder's format
(``case``, ``error``, ``seconds``, ``truth``) and ``<case>.log``, the server's whole log at ``-lv 4``.
:func:`truth_from_log` is pure: it turns a log into the ``truth`` block (the buffers read by
``controller.stages.estimate.llamalog``, the KV cache lines and the output buffer read here).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lab.gpu_check import procs

_LLAMA_E1024 = {"arch": "llama", "ctx_train": 131072, "dtype": "f16", "head_dim": 0, "n_embd": 1024, "n_ff": 2816,
                "n_head": 16, "n_head_kv": 4, "n_layer": 8, "n_vocab": 32000}
_QWEN3MOE = {"arch": "qwen3moe", "ctx_train": 65536, "dtype": "f16", "head_dim": 64, "n_embd": 256, "n_expert": 6,
             "n_expert_used": 3, "n_ff": 768, "n_ff_exp": 384, "n_head": 8, "n_head_kv": 4, "n_layer": 12,
             "n_vocab": 4000}


def _run(ctx: int, parallel: int, *, ctk: str = "f16", ctv: str | None = None, fa: str = "on", unified: bool = False,
         ubatch: int = 512, batch: int = 2048) -> dict[str, Any]:
    return {"batch": batch, "ctk": ctk, "ctv": ctv or ctk, "ctx": ctx, "fa": fa, "kv_unified": unified,
            "parallel": parallel, "ubatch": ubatch}


CASES: list[dict[str, Any]] = [
    {"name": "gemma3-swa96-p3-hd128-c30000-np3-split", "ngl": 99, "run": _run(30000, 3),
     "model": {"arch": "gemma3", "ctx_train": 131072, "dtype": "f16", "head_dim": 128, "n_embd": 384, "n_ff": 1024,
               "n_head": 4, "n_head_kv": 2, "n_layer": 9, "n_swa": 96, "n_vocab": 3000, "swa_pattern": 3}},
    {"name": "gpu-gemma3-swa440-c32768-q8_0-ub1024", "ngl": 99, "run": _run(32768, 1, ctk="q8_0", ubatch=1024),
     "model": {"arch": "gemma3", "ctx_train": 131072, "dtype": "f16", "head_dim": 128, "n_embd": 256, "n_ff": 512,
               "n_head": 8, "n_head_kv": 8, "n_layer": 24, "n_swa": 440, "n_vocab": 3000, "swa_pattern": 8}},
    {"name": "gpu-llama-e1024-c16384-np2-fa-off", "ngl": 99, "run": _run(16384, 2, fa="off"), "model": _LLAMA_E1024},
    {"name": "gpu-llama-e1024-c20000-ngl5-partial", "ngl": 5, "run": _run(20000, 1), "model": _LLAMA_E1024},
    {"name": "gpu-llama-e1024-c32768-np1-f16-ub2048", "ngl": 99, "run": _run(32768, 1, ubatch=2048),
     "model": _LLAMA_E1024},
    {"name": "gpu-llama-e1024-c65536-np2-unified-q8_0", "ngl": 99, "run": _run(65536, 2, ctk="q8_0", unified=True),
     "model": _LLAMA_E1024},
    {"name": "gpu-qwen3moe-c32768-np4-split-q4_0", "ngl": 99, "run": _run(32768, 4, ctk="q4_0"), "model": _QWEN3MOE},
    {"name": "llama-f32-weights-c40000-q4_0", "ngl": 99, "run": _run(40000, 1, ctk="q4_0"),
     "model": {"arch": "llama", "ctx_train": 65536, "dtype": "f32", "head_dim": 0, "n_embd": 512, "n_ff": 1408,
               "n_head": 8, "n_head_kv": 8, "n_layer": 6, "n_vocab": 8000}},
    {"name": "llama-hd48-gqa3-c15000-np3-split", "ngl": 99, "run": _run(15000, 3),
     "model": {"arch": "llama", "ctx_train": 65536, "dtype": "f16", "head_dim": 48, "n_embd": 288, "n_ff": 768,
               "n_head": 6, "n_head_kv": 2, "n_layer": 24, "n_vocab": 1024}},
    {"name": "qwen3moe-e6u3-hd64-c25000-np2-unified-q5_0", "ngl": 99, "run": _run(25000, 2, ctk="q5_0", unified=True),
     "model": _QWEN3MOE},
]
"""Same names, models, settings and -ngl as the recorded H100 truth."""

# Flags every case's server gets, besides its settings (the recorded folder's README lists them).
BASE_FLAGS = ("-lv", "4", "--load-mode", "none", "-fit", "off", "--no-webui", "--no-warmup")
CONTEXT_KEYS = ("kv_unified", "n_batch", "n_ctx", "n_ctx_seq", "n_seq_max", "n_ubatch")

_KV_SIZE = re.compile(
    r"llama_kv_cache\w*: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)(?:/(\d+))? seqs\), "
    r"K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB")
_OUTPUT = re.compile(r"^\s*(?:\S+\s+[IWEDT]\s+)?llama_context:\s+(\S+)\s+output buffer size\s*=\s*([\d.]+) MiB",
                     re.MULTILINE)


def select(names: Sequence[str] | None) -> list[dict[str, Any]]:
    if not names:
        return list(CASES)
    known = {case["name"]: case for case in CASES}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise KeyError(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[name] for name in names]


def model_kwargs(model: Mapping[str, Any]) -> dict[str, Any]:
    """A case's ``model`` block as ``lab.tinymodels.write_model`` arguments."""
    kwargs: dict[str, Any] = {key: model[key] for key in ("n_layer", "n_embd", "n_head", "n_head_kv", "n_ff", "n_vocab")}
    kwargs["n_ctx_train"] = model["ctx_train"]
    kwargs["file_type"] = model["dtype"]
    kwargs["head_dim"] = model.get("head_dim") or None
    for key in ("n_expert", "n_expert_used", "n_ff_exp", "swa_pattern"):
        if key in model:
            kwargs[key] = model[key]
    if "n_swa" in model:
        kwargs["sliding_window"] = model["n_swa"]
    return kwargs


def model_file(model: Mapping[str, Any]) -> str:
    """The model's file name, by its hyperparameters: cases sharing a model share the file."""
    digest = hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()[:12]
    return f"{model['arch']}-{digest}.gguf"


def write_models(cases: Sequence[Mapping[str, Any]], folder: Path) -> dict[str, float]:
    """Write each case's model once into ``folder``; returns seconds spent per file written."""
    from lab.tinymodels import write_model

    folder.mkdir(parents=True, exist_ok=True)
    spent: dict[str, float] = {}
    for case in cases:
        name = model_file(case["model"])
        if name in spent or (folder / name).exists():
            continue
        started = time.monotonic()
        write_model(folder / f".{name}.part", case["model"]["arch"], name=f"gpu-check-{case['model']['arch']}",
                    **model_kwargs(case["model"]))
        (folder / f".{name}.part").rename(folder / name)
        spent[name] = time.monotonic() - started
    return spent


def server_args(case: Mapping[str, Any], model_path: str, port: int) -> list[str]:
    run = case["run"]
    return ["-m", model_path, "--host", "127.0.0.1", "--port", str(port), *BASE_FLAGS, "-ngl", str(case["ngl"]),
            "-c", str(run["ctx"]), "-np", str(run["parallel"]),
            "--kv-unified" if run["kv_unified"] else "--no-kv-unified", "-ctk", run["ctk"], "-ctv", run["ctv"],
            "-ub", str(run["ubatch"]), "-b", str(run["batch"]), "-fa", run["fa"]]


def truth_from_log(text: str) -> dict[str, Any]:
    """The ``truth`` block of a recorded case from the server's log (without ``health_s`` and ``server_cmd``)."""
    from controller.stages.estimate.llamalog import parse_log

    log = parse_log(text)
    model_buffers = {device: round(mib, 2) for device, mib in sorted(log.buffers.get("model", {}).items())}
    compute_buffers = {device: round(mib, 2) for device, mib in sorted(log.buffers.get("compute", {}).items())}
    kv_caches = []
    for match in _KV_SIZE.finditer(text):
        mib, cells, layers, seqs, streams, k_type, k_mib, v_type, v_mib = match.groups()
        kv_caches.append({"cells": int(cells), "k_mib": float(k_mib), "k_type": k_type, "layers": int(layers),
                          "mib": float(mib), "seqs": int(seqs), "streams": int(streams or 1), "v_mib": float(v_mib),
                          "v_type": v_type})
    return {
        "compute_buffers": compute_buffers,
        "compute_mib": round(sum(compute_buffers.values()), 2),
        "context": {key: log.context[key] for key in CONTEXT_KEYS if key in log.context},
        "kv_caches": kv_caches,
        "kv_mib": round(sum(cache["mib"] for cache in kv_caches), 2),
        "model_buffers": model_buffers,
        "output_mib": round(sum(float(m.group(2)) for m in _OUTPUT.finditer(text)), 2),
        "weights_mib": round(sum(model_buffers.values()), 2),
    }


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run_case(group: procs.Group, server: Path, case: Mapping[str, Any], work: Path, out: Path, *,
             health_timeout: float = 180.0) -> dict[str, Any]:
    """Start the server on the case's model from ``work`` (models in ``work/models``), wait for health, stop it;
    write ``out/<case>.json`` and ``out/<case>.log`` and return the JSON's content."""
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / f"{case['name']}.log"
    log_path.write_bytes(b"")
    args = server_args(case, f"models/{model_file(case['model'])}", procs.free_port())
    started = time.monotonic()
    error, health_s = None, None
    process = group.start([str(server), *args], log_path, cwd=work)
    try:
        health_s = procs.wait_healthy(process, f"http://127.0.0.1:{args[args.index('--port') + 1]}", health_timeout)
    except procs.NotHealthy as exc:
        error = str(exc)
    finally:
        group.stop(process)
    seconds = time.monotonic() - started
    text = log_path.read_text(errors="replace")
    truth: dict[str, Any] | None = truth_from_log(text)
    if error is not None:
        error = f"{error}:\n{_tail(text)}"
        truth = truth if truth and truth["model_buffers"] else None
    if truth is not None:
        truth["health_s"] = None if health_s is None else round(health_s, 2)
        truth["server_cmd"] = ["llama-server", *args]
    record = {"case": dict(case), "error": error, "seconds": round(seconds, 1), "truth": truth}
    (out / f"{case['name']}.json").write_text(json.dumps(record, indent=1, sort_keys=True))
    return record


def buffers_line(record: Mapping[str, Any]) -> str:
    """One line per case for the summary: where each buffer went."""
    truth = record.get("truth")
    if record.get("error") or not truth:
        first = (record.get("error") or "no truth").splitlines()[0]
        return f"FAIL {record['case']['name']}: {first}"
    devices = sorted(set(truth["model_buffers"]) | set(truth["compute_buffers"]))
    parts = [f"{d} model {truth['model_buffers'].get(d, 0):.2f} compute {truth['compute_buffers'].get(d, 0):.2f}"
             for d in devices]
    return (f"PASS {record['case']['name']}: KV {truth['kv_mib']:.2f} MiB; " + "; ".join(parts)
            + f" (healthy in {truth['health_s']} s)")
