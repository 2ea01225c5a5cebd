"""A target with a draft model on the real CPU llama-server, with the arguments the planner renders.

Two tiny models share one vocabulary and one tied embedding matrix (same seed and width), so the draft
guesses what the target picks and speculation really accepts tokens; a third has a different vocabulary
(50 more tokens, its control tokens at other ids) and a fourth adds BOS to every prompt; the planner
refuses both and so does the engine.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from controller.model.catalog import load_catalog
from controller.model.fleet import WantedModel
from controller.stages.estimate.llamalog import parse_log
from controller.stages.estimate.source import estimate_draft, estimate_model, with_draft, with_gguf_sources
from controller.stages.planner import plan_models
from lab.estimate_check import COMPUTE_TOL, KV_TOL, WEIGHTS_TOL, within
from lab.llama_server import start, stop
from lab.target import free_port
from lab.tinymodels import write_model
from tests.unit.planner.helpers import CPU_ONLY, profile

pytestmark = pytest.mark.engine

SHAPE = {"n_embd": 128, "n_head": 4, "n_head_kv": 2, "tied_embeddings": True, "file_type": "f32", "seed": 7}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("draft-models")
    return {
        "target": write_model(folder / "target.gguf", "llama", n_layer=4, n_ff=512, n_vocab=400, **SHAPE),
        "draft": write_model(folder / "draft.gguf", "llama", n_layer=1, n_ff=256, n_vocab=400, **SHAPE),
        "other": write_model(folder / "other.gguf", "llama", n_layer=1, n_ff=256, n_vocab=450, **SHAPE),
        "bos": write_model(folder / "bos.gguf", "llama", n_layer=1, n_ff=256, n_vocab=400, **SHAPE,
                           extra_metadata={"tokenizer.ggml.add_bos_token": True}),
    }


def _plan(models: dict[str, Path], draft: str, port: int):
    ids, catalog, headers = with_gguf_sources([str(models["target"]), str(models[draft])], load_catalog())
    wanted = [WantedModel(id=ids[0], ctx=2048, draft=ids[1])]
    return plan_models(wanted, profile(CPU_ONLY), catalog, base_port=port, model_dir=str(models["target"].parent),
                       headers=headers)


def _run(server: Path, args: list[str], port: int, log: Path):
    return start(server, args, log, f"http://127.0.0.1:{port}", timeout=60.0)


def test_the_planned_pair_loads_drafts_and_accepts_on_the_real_server(llama_server: Path, models, tmp_path: Path):
    port = free_port()
    plan = _plan(models, "draft", port)
    service = plan.services[0]
    assert plan.fits and service.draft is not None and service.draft.compatible
    assert {m.file for m in plan.models} == {"target.gguf", "draft.gguf"}  # the role downloads both
    added = service.draft.args_added
    assert any(service.args[k:k + len(added)] == added for k in range(len(service.args)))  # args stays complete
    log_path = tmp_path / "server.log"
    process = _run(llama_server, service.args, port, log_path)
    try:
        reply = httpx.post(f"http://127.0.0.1:{port}/completion", timeout=120,
                           json={"prompt": "the quick brown fox jumps over", "n_predict": 48, "temperature": 0,
                                 "cache_prompt": False}).json()
        timings = reply["timings"]
        assert timings["draft_n"] > 0, timings  # the draft drafted
        assert 0 < timings["draft_n_accepted"] <= timings["draft_n"], timings  # and the target accepted some
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        drafted = next(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("llamacpp:spec_decode_num_draft_tokens_total"))
        accepted = next(float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("llamacpp:spec_decode_num_accepted_tokens_total"))
        assert drafted >= timings["draft_n"] and accepted >= timings["draft_n_accepted"]
    finally:
        stop(process)
    log = log_path.read_text(errors="replace")
    assert str(models["draft"]) in log  # the draft model was loaded from the planned path
    assert "draft acceptance" in log  # and the server counted its drafts


def test_estimate_with_the_draft_matches_both_models_buffers(llama_server: Path, models, tmp_path: Path):
    """``controller estimate --draft`` against the buffers the server allocates for target and draft together."""
    port = free_port()
    args = ["-m", str(models["target"]), "--host", "127.0.0.1", "--port", str(port), "-c", "2048", "-np", "1",
            "-t", "2", "--spec-type", "draft-simple", "--model-draft", str(models["draft"])]
    log_path = tmp_path / "server.log"
    process = _run(llama_server, args, port, log_path)
    stop(process)
    log = parse_log(log_path.read_text(errors="replace"))
    options = {"ctx": 2048, "parallel": 1, "kv_unified": False}
    target = estimate_model(str(models["target"]), **options)
    data = with_draft(target.to_json(), estimate_draft(str(models["draft"]), [], [], **options))
    kv = data["kv"]["total_mib"] + data["draft"]["kv"]["total_mib"]
    weights = data["weights"]["total_mib"] + data["draft"]["weights"]["total_mib"]
    compute = data["compute"]["total_mib"] + data["draft"]["compute"]["total_mib"]
    assert log.total("KV") > data["kv"]["total_mib"], "the log shows no draft KV cache beside the target's"
    assert within(kv, log.total("KV"), KV_TOL), (kv, log.total("KV"))
    assert within(weights, log.total("model"), WEIGHTS_TOL), (weights, log.total("model"))
    assert within(compute, log.total("compute"), COMPUTE_TOL), (compute, log.total("compute"))
    assert data["total_mib"] == pytest.approx(target.total_mib + data["draft"]["total_mib"], abs=0.02)


@pytest.mark.parametrize(("other", "why"), [("other", "token 397 differs"), ("bos", "BOS is handled differently")])
def test_an_incompatible_pair_is_refused_by_the_planner_and_by_the_engine(llama_server: Path, models,
                                                                          tmp_path: Path, other: str, why: str):
    port = free_port()
    plan = _plan(models, other, port)
    service = plan.services[0]
    assert service.draft is not None and not service.draft.compatible
    assert why in service.draft.reasons[0]
    assert "--model-draft" not in service.args and {m.file for m in plan.models} == {"target.gguf"}
    assert not plan.fits and plan.unplaced[0].model == service.draft.model
    # the engine agrees: it refuses the pair on its vocabulary check and serves the target without drafting
    args = ["-m", str(models["target"]), "--host", "127.0.0.1", "--port", str(port), "-c", "2048", "-np", "1",
            "-t", "2", "--spec-type", "draft-simple", "--model-draft", str(models[other])]
    log_path = tmp_path / "server.log"
    process = _run(llama_server, args, port, log_path)
    try:
        reply = httpx.post(f"http://127.0.0.1:{port}/completion", timeout=120,
                           json={"prompt": "the quick brown fox", "n_predict": 16, "temperature": 0}).json()
    finally:
        stop(process)
    assert "the target and draft vocabs are not compatible" in log_path.read_text(errors="replace")
    assert "draft_n" not in reply["timings"], reply["timings"]
