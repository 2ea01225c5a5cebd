"""Compare ``controller estimate`` with the buffers a real llama-server allocates for the same settings.

Shared by benchmarks/estimate_accuracy.py (which prints the table the issue asks for) and the
engine-marked integration test (which asserts the accuracy targets on a few cases).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.stages.estimate.llamalog import parse_log
from controller.stages.estimate.source import estimate_model
from lab.llama_server import load_log
from lab.tinymodels import write_model

# Accuracy targets of issue 4: (relative, absolute MiB) — a value passes if within either.
KV_TOL = (0.01, 1.0)
WEIGHTS_TOL = (0.01, 1.0)
COMPUTE_TOL = (0.10, 32.0)


@dataclass(frozen=True)
class Case:
    """A generated model and the server options to load it with (None = the engine's default)."""

    name: str
    arch: str
    model: dict[str, Any]
    ctx: int | None = None
    parallel: int | None = None
    kv_unified: bool | None = None
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    ubatch: int | None = None
    batch: int | None = None
    flash_attn: str | None = None

    def server_args(self) -> list[str]:
        args: list[str] = []
        if self.ctx is not None:
            args += ["-c", str(self.ctx)]
        if self.parallel is not None:
            args += ["-np", str(self.parallel)]
        if self.kv_unified is not None:
            args.append("-kvu" if self.kv_unified else "-no-kvu")
        args += ["-ctk", self.cache_type_k, "-ctv", self.cache_type_v]
        if self.ubatch is not None:
            args += ["-ub", str(self.ubatch)]
        if self.batch is not None:
            args += ["-b", str(self.batch)]
        if self.flash_attn is not None:
            args += ["-fa", self.flash_attn]
        return args

    def estimate_options(self) -> dict[str, Any]:
        return {"ctx": self.ctx, "parallel": self.parallel, "kv_unified": self.kv_unified,
                "cache_type_k": self.cache_type_k, "cache_type_v": self.cache_type_v, "ubatch": self.ubatch,
                "batch": self.batch, "flash_attn": self.flash_attn}


def within(estimate: float, actual: float, tol: tuple[float, float]) -> bool:
    rel, absolute = tol
    return abs(estimate - actual) <= max(rel * abs(actual), absolute)


@dataclass
class Row:
    case: str
    size_mib: float
    kv: tuple[float, float]
    weights: tuple[float, float]
    compute: tuple[float, float]
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(self.checks.values())


def model_path(case: Case, folder: Path) -> Path:
    """The case's model file, generated once per folder (large ones take seconds to write)."""
    path = folder / f"{case.name}.gguf"
    if not path.exists():
        write_model(path, case.arch, name=case.name, **case.model)
    return path


def run_case(server: Path, case: Case, folder: Path) -> Row:
    """Load the case's model in the real server and compare its buffers with the estimate (CPU device)."""
    path = model_path(case, folder)
    log = parse_log(load_log(server, path, case.server_args()))
    result = estimate_model(str(path), **case.estimate_options())
    kv_est = sum(d.kv_mib for d in result.devices)
    w_est = sum(d.weights_mib for d in result.devices)
    c_est = sum(d.compute_mib for d in result.devices)
    row = Row(case.name, path.stat().st_size / 2**20, (kv_est, log.total("KV")), (w_est, log.total("model")),
              (c_est, log.total("compute")))
    row.checks = {
        "kv": within(*row.kv, KV_TOL),
        "weights": within(*row.weights, WEIGHTS_TOL),
        "compute": within(*row.compute, COMPUTE_TOL),
    }
    return row


def format_rows(rows: Sequence[Row]) -> str:
    head = (f"{'case':<28}{'size MiB':>10} | {'KV est':>9}{'actual':>9} | {'weights est':>12}{'actual':>9} | "
            f"{'compute est':>12}{'actual':>9} | result")
    lines = [head, "-" * len(head)]
    for r in rows:
        failed = [k for k, ok in r.checks.items() if not ok]
        verdict = "PASS" if r.passed else "FAIL (" + ", ".join(failed) + ")"
        lines.append(
            f"{r.case:<28}{r.size_mib:>10.1f} | {r.kv[0]:>9.2f}{r.kv[1]:>9.2f} | {r.weights[0]:>12.2f}"
            f"{r.weights[1]:>9.2f} | {r.compute[0]:>12.2f}{r.compute[1]:>9.2f} | {verdict}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- recorded CUDA allocations

CUDA_TRUTH = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "gpu-h100-580" / "cuda-truth"


def cuda_truth_cases(folder: Path = CUDA_TRUTH) -> list[Path]:
    """The recorded cases (``<case>.json`` beside its ``<case>.log``; see the fixtures' README)."""
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def cuda_truth_header(model: dict[str, Any], path: Path) -> Path:
    """A header-only GGUF (tensor table, no data) with a recorded case's hyperparameters (``case.model``)."""
    options: dict[str, Any] = {
        "n_layer": model["n_layer"], "n_embd": model["n_embd"], "n_head": model["n_head"],
        "n_head_kv": model["n_head_kv"], "n_ff": model["n_ff"], "n_vocab": model["n_vocab"],
        "n_ctx_train": model["ctx_train"], "file_type": model["dtype"],
    }
    if model.get("head_dim"):
        options["head_dim"] = model["head_dim"]
    if model["arch"] == "qwen3moe":
        options |= {"n_expert": model["n_expert"], "n_expert_used": model["n_expert_used"],
                    "n_ff_exp": model["n_ff_exp"]}
    if model["arch"] == "gemma3":
        options |= {"sliding_window": model.get("n_swa", 0), "swa_pattern": model.get("swa_pattern", 2)}
    return write_model(path, model["arch"], header_only=True, **options)


def cuda_truth_estimate_args(case: dict[str, Any]) -> list[str]:
    """``controller estimate`` options for a recorded case's server settings (one CUDA device)."""
    run = case["run"]
    return ["--gpus", "0", "--n-gpu-layers", str(case["ngl"]), "--ctx", str(run["ctx"]),
            "--parallel", str(run["parallel"]), "--kv-unified" if run["kv_unified"] else "--no-kv-unified",
            "--cache-type-k", run["ctk"], "--cache-type-v", run["ctv"], "--ubatch", str(run["ubatch"]),
            "--batch", str(run["batch"]), "--flash-attn", run["fa"]]
