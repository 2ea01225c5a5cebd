"""``controller estimate --gpus 0`` against what the CUDA llama-server allocated on a real GPU.

Each case in ``../shared/fixtures/gpu-h100-580/cuda-truth/`` (see that folder's README) holds a model's
hyperparameters, the server settings and the buffers the engine (llama.cpp 0c1e570 built for CUDA, the
same commit as the CPU test engine) reported at ``-lv 4``. The test writes a GGUF header with the same
hyperparameters, runs the estimate command with the same settings and compares it per device:

* weights and KV cache within 1 % on the GPU and on the host;
* the GPU's compute buffer within 10 % or 32 MiB, and so is the pinned host buffer (``CUDA_Host``, the
  CPU backend's compute buffer when a GPU exists: the graph inputs and the host's share of the graph);
* the GPU's total (weights, KV, compute) never under what the engine allocated: a plan that fits the
  estimate must not OOM on its first long prompt.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from controller.stages.estimate.gguf_header import read_header
from controller.stages.estimate.llamalog import parse_log
from controller.stages.estimate.memory import compute_plan, kv_plan, place_layers, resolve_settings
from controller.stages.estimate.model import model_spec
from lab.estimate_check import CUDA_TRUTH, cuda_truth_cases, cuda_truth_estimate_args, cuda_truth_header
from tests.cli import invoke

IN_CI = os.environ.get("CI") == "true"
SHARE_TOL = 0.01  # weights and KV: the same rules as the engine, so only rounding of the log's MiB
COMPUTE_TOL = (0.10, 32.0)  # relative, MiB: either is enough


@pytest.fixture(scope="module")
def truth_dir() -> Path:
    if not cuda_truth_cases():
        if IN_CI:
            pytest.fail(f"{CUDA_TRUTH} is missing; CI runs with shared/ beside the clone")
        pytest.skip("../shared/fixtures/gpu-h100-580/cuda-truth is not beside this clone")
    return CUDA_TRUTH


def _estimate(case: dict[str, Any], folder: Path) -> dict[str, Any]:
    gguf = cuda_truth_header(case["model"], folder / f"{case['name']}.gguf")
    result = invoke("estimate", str(gguf), "--json", *cuda_truth_estimate_args(case))
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _within(estimate: float, actual: float, tol: tuple[float, float]) -> bool:
    return abs(estimate - actual) <= max(tol[0] * actual, tol[1])


def test_the_recorded_cases_are_beside_the_clone(truth_dir: Path) -> None:
    """Fails under CI=true when ../shared is missing (the cases below would silently vanish), skips elsewhere."""
    cases = cuda_truth_cases(truth_dir)
    assert cases and all(path.with_suffix(".log").is_file() for path in cases)


@pytest.mark.parametrize("path", cuda_truth_cases(), ids=[p.stem for p in cuda_truth_cases()])
def test_estimate_matches_what_the_cuda_server_allocated(truth_dir: Path, tmp_path: Path, path: Path) -> None:
    recorded = json.loads(path.read_text())
    case, truth = recorded["case"], recorded["truth"]
    log = parse_log((truth_dir / f"{path.stem}.log").read_text(errors="replace"))
    data = _estimate(case, tmp_path)
    devices = {d["name"]: d for d in data["devices"]}
    gpu, host = devices["CUDA0"], devices["CPU"]
    # the engine names the host's buffers CUDA_Host (pinned) or CPU (the KV of layers left on the CPU)
    host_weights = truth["model_buffers"].get("CUDA_Host", 0.0) + truth["model_buffers"].get("CPU", 0.0)
    kv = log.buffers.get("KV", {})
    checks = {
        "weights CUDA0": (gpu["weights_mib"], truth["model_buffers"]["CUDA0"]),
        "weights host": (host["weights_mib"], host_weights),
        "KV CUDA0": (gpu["kv_mib"], kv.get("CUDA0", 0.0)),
        "KV host": (host["kv_mib"], kv.get("CPU", 0.0) + kv.get("CUDA_Host", 0.0)),
    }
    for what, (est, actual) in checks.items():
        assert abs(est - actual) <= SHARE_TOL * actual + 0.01, f"{what}: estimated {est:.2f} MiB, engine {actual:.2f}"
    compute = truth["compute_buffers"]
    assert _within(gpu["compute_mib"], compute["CUDA0"], COMPUTE_TOL), (
        f"CUDA0 compute: estimated {gpu['compute_mib']:.2f} MiB, engine {compute['CUDA0']:.2f}")
    allocated = truth["model_buffers"]["CUDA0"] + kv.get("CUDA0", 0.0) + compute["CUDA0"]
    estimated = gpu["weights_mib"] + gpu["kv_mib"] + gpu["compute_mib"]
    assert estimated >= allocated - 0.01, f"GPU buffers estimated {estimated:.2f} MiB, engine allocated {allocated:.2f}"
    assert _within(host["compute_mib"], compute["CUDA_Host"], COMPUTE_TOL), (
        f"host compute: estimated {host['compute_mib']:.2f} MiB, engine's CUDA_Host {compute['CUDA_Host']:.2f}")
    pinned = data.get("host_pinned")
    assert pinned is not None and pinned["buffer"] == "CUDA_Host", "the pinned host buffer is not reported"
    assert pinned["compute_mib"] == host["compute_mib"] and pinned["compute_mib"] >= compute["CUDA_Host"] - 0.01
    assert pinned["output_mib"] == pytest.approx(truth["output_mib"], abs=0.01)


@pytest.mark.parametrize("path", cuda_truth_cases(), ids=[p.stem for p in cuda_truth_cases()])
def test_the_graph_has_the_engines_nodes_and_splits(truth_dir: Path, tmp_path: Path, path: Path) -> None:
    """The mirrored graph, built whole, has as many nodes as the engine's and the scheduler cuts it as often."""
    case = json.loads(path.read_text())["case"]
    log = (truth_dir / f"{path.stem}.log").read_text(errors="replace")
    nodes, splits = (int(n) for n in re.search(r"nodes = (\d+).*?, splits = (\d+)", log).groups())
    spec = model_spec(read_header(cuda_truth_header(case["model"], tmp_path / "m.gguf")))
    run = case["run"]
    s = resolve_settings(spec, ctx=run["ctx"], parallel=run["parallel"], kv_unified=run["kv_unified"],
                         cache_type_k=run["ctk"], cache_type_v=run["ctv"], ubatch=run["ubatch"], batch=run["batch"],
                         flash_attn=run["fa"], gpus=[0], n_gpu_layers=case["ngl"])
    place = place_layers(spec, s)
    plan = compute_plan(spec, s, place, kv_plan(spec, s, place), compress=False)
    assert (plan.nodes, plan.splits) == (nodes, splits)
