"""A target with a draft model: the catalog's pairs, the compatibility check, the memory fit and the plan contract."""

from __future__ import annotations

import json

import pytest

from controller.errors import DraftError
from controller.model.catalog import load_catalog
from controller.model.fleet import WantedModel, load_fleet
from controller.model.profile import Gpu, HardwareProfile
from controller.stages.estimate.gguf_header import read_header
from controller.stages.planner import plan_models
from controller.stages.planner.draft import incompatibilities, vocab_from_entry, vocab_from_header
from lab.tinymodels import write_model
from tests.unit.planner.helpers import DUAL, SINGLE, catalog, flag, profile

TARGET, DRAFT, DEEPSEEK = ("qwen2.5-coder-7b-instruct-q4_k_m", "qwen2.5-coder-0.5b-instruct-q8_0",
                           "deepseek-coder-v2-lite-instruct-q4_k_m")


def _plan(*wanted: WantedModel, machine=None):
    return plan_models(list(wanted), machine or profile(SINGLE), catalog())


def test_the_catalog_has_the_seed_coders_and_says_which_draft_suits_which_target():
    cat = catalog()
    for model_id in (TARGET, DRAFT, DEEPSEEK):
        entry = cat.model(model_id)
        assert entry.tokenizer is not None and entry.hparams and entry.size_bytes
    assert [p.id for p in cat.model(TARGET).drafts] == [DRAFT]
    assert "~55 -> ~100 tok/s" in cat.model(TARGET).drafts[0].speedup and cat.model(TARGET).drafts[0].source
    assert cat.model(DEEPSEEK).drafts == []  # the seed's Qwen draft does not suit DeepSeek
    assert cat.model(DEEPSEEK).moe and cat.model(DEEPSEEK).arch == "deepseek2"


def test_the_engine_check_accepts_7b_with_05b_and_refuses_deepseek_with_it():
    cat = catalog()
    assert incompatibilities(vocab_from_entry(cat.model(TARGET)), vocab_from_entry(cat.model(DRAFT))) == []
    problems = incompatibilities(vocab_from_entry(cat.model(DEEPSEEK)), vocab_from_entry(cat.model(DRAFT)))
    assert any("BOS" in p for p in problems) and any("49536 apart" in p for p in problems)


def test_the_check_reads_gguf_headers_and_compares_token_texts(tmp_path):
    same = dict(n_layer=1, n_embd=64, n_head=2, n_head_kv=1, n_ff=128)
    target = vocab_from_header(read_header(write_model(tmp_path / "t.gguf", n_vocab=400, **same)))
    draft = vocab_from_header(read_header(write_model(tmp_path / "d.gguf", n_vocab=400, seed=3, **same)))
    close = vocab_from_header(read_header(write_model(tmp_path / "c.gguf", n_vocab=450, **same)))
    far = vocab_from_header(read_header(write_model(tmp_path / "f.gguf", n_vocab=600, **same)))
    assert target.tokens is not None and incompatibilities(target, draft) == []
    assert incompatibilities(target, close) == ["token 397 differs ('<|endoftext|>' vs 'el')"]  # 50 apart: texts decide
    assert "200 apart" in incompatibilities(target, far)[0]
    bos = vocab_from_header(read_header(write_model(tmp_path / "b.gguf", n_vocab=400, **same,
                                                    extra_metadata={"tokenizer.ggml.add_bos_token": True})))
    assert incompatibilities(target, bos) == ["BOS is handled differently (added: false vs true, token 397 vs 397)"]
    spm = vocab_from_header(read_header(write_model(tmp_path / "s.gguf", n_vocab=400, **same,
                                                    extra_metadata={"tokenizer.ggml.model": "llama"})))
    assert incompatibilities(target, spm) == ["the tokenizer types differ (gpt2 vs llama)"]


def test_a_named_draft_is_paired_rendered_and_downloaded():
    plan = _plan(WantedModel(id=TARGET, draft=DRAFT))
    service = plan.services[0]
    draft = service.draft
    assert plan.fits and draft.compatible and draft.model == DRAFT
    assert flag(service, "--model-draft") == "/var/lib/llama/models/Qwen2.5-Coder-0.5B-Instruct-Q8_0.gguf"
    assert flag(service, "--spec-draft-n-max") == "5" and flag(service, "--device-draft") == "CUDA0"
    assert flag(service, "--n-gpu-layers-draft") == "99"
    assert flag(service, "--cache-type-k-draft") == service.cache_type_k
    assert "--draft-max" not in service.args and "--num-draft" not in service.args  # removed / old spellings
    assert all(arg in service.args for arg in draft.args_added)
    assert [m.id for m in plan.models] == [TARGET, DRAFT]
    assert draft.memory.per_device_mib["cuda0"] > 500  # its weights, its own KV and compute
    assert any("~55 -> ~100 tok/s" in r and "seed" in r for r in draft.reasons)
    alone = _plan(WantedModel(id=TARGET)).services[0]
    extra = service.memory.per_device_mib["cuda0"] - alone.memory.per_device_mib["cuda0"]
    assert extra == pytest.approx(draft.memory.per_device_mib["cuda0"], abs=2)  # the fit counts both models
    assert alone.draft is None


def test_the_plan_json_carries_the_draft_contract():
    data = json.loads(_plan(WantedModel(id=TARGET, draft="auto")).model_dump_json())
    draft = data["services"][0]["draft"]
    assert set(draft) == {"model", "model_file", "args_added", "memory", "compatible", "reasons"}
    assert draft["compatible"] is True and set(draft["memory"]) == {"per_device_mib"}
    assert json.loads(_plan(WantedModel(id=TARGET)).model_dump_json())["services"][0]["draft"] is None


def test_auto_takes_the_recommendation_and_says_when_there_is_none():
    assert _plan(WantedModel(id=TARGET, draft="auto")).services[0].draft.model == DRAFT
    service = _plan(WantedModel(id=DEEPSEEK, draft="auto")).services[0]
    assert service.draft is None and any("recommends no draft" in r for r in service.reasons)


def test_an_incompatible_pair_is_refused_before_download_with_what_to_pick_instead():
    plan = _plan(WantedModel(id=DEEPSEEK, draft=DRAFT))
    service = plan.services[0]
    assert not service.draft.compatible and service.draft.args_added == []
    assert "--model-draft" not in service.args and [m.id for m in plan.models] == [DEEPSEEK]
    reason = service.draft.reasons[0]
    assert "BOS" in reason and f"pair {DRAFT} with {TARGET}" in reason
    assert not plan.fits and plan.unplaced[0].model == DRAFT


def test_a_draft_larger_than_its_target_is_refused():
    with pytest.raises(DraftError, match="not smaller than its target"):
        _plan(WantedModel(id=DRAFT, draft=TARGET))


def test_a_draft_on_an_engine_that_cannot_draft_is_refused(tmp_path):
    extra = tmp_path / "ik.yml"
    extra.write_text(f"models:\n  {TARGET}:\n" + "".join(
        f"    {k}: {json.dumps(v)}\n" for k, v in {**catalog().model(TARGET).model_dump(exclude={"id"}),
                                                   "engine": "ik"}.items()))
    with pytest.raises(DraftError, match="no ik build draft-model flags"):
        plan_models([WantedModel(id=TARGET, draft=DRAFT)], profile(SINGLE), load_catalog([extra]))


def _small_card(memory_mib: int) -> HardwareProfile:
    base = profile(SINGLE)
    return base.model_copy(update={"gpus": [Gpu(index=0, name="Tesla V100-SXM2-16GB", memory_mib=memory_mib)]})


def test_a_pair_that_fits_only_with_less_context_gets_the_largest_that_fits():
    card = _small_card(7800)
    alone = _plan(WantedModel(id=TARGET), machine=card).services[0]
    paired = _plan(WantedModel(id=TARGET, draft=DRAFT), machine=card).services[0]
    rank = {"f16": 0, "q8_0": 1, "q4_0": 2}
    assert paired.draft.compatible
    assert (paired.ctx, -rank[paired.cache_type_k]) < (alone.ctx, -rank[alone.cache_type_k])
    assert any("largest" in r for r in paired.reasons)


def test_a_pair_that_does_not_fit_is_refused_with_the_numbers_and_auto_drops_the_draft():
    card = _small_card(6000)
    plan = _plan(WantedModel(id=TARGET, ctx=32768, draft=DRAFT), machine=card)
    assert not plan.services and "MiB" in plan.unplaced[0].reason and f"include the draft {DRAFT}" in \
        plan.unplaced[0].reason
    auto = _plan(WantedModel(id=TARGET, ctx=32768, draft="auto"), machine=card)
    if auto.services:  # the target alone fits: served without the draft, and it says so
        assert auto.services[0].draft is None and any("does not fit beside" in r for r in auto.services[0].reasons)


def test_the_fleet_names_a_draft_and_unknown_drafts_are_refused(tmp_path):
    fleet = tmp_path / "fleet.yml"
    fleet.write_text(f"boxes:\n  box1:\n    address: 192.0.2.1\n    models:\n      - id: {TARGET}\n"
                     f"        draft: {DRAFT}\n      - id: {DEEPSEEK}\n        draft: auto\n      - id: {DRAFT}\n")
    box = load_fleet(fleet).box("box1")
    assert [w.draft for w in box.models] == [DRAFT, "auto", None]
    from controller.errors import FleetError
    fleet.write_text(f"boxes:\n  box1:\n    address: 192.0.2.1\n    models:\n      - id: {TARGET}\n"
                     f"        draft: no-such-draft\n")
    loaded = load_fleet(fleet)
    with pytest.raises(FleetError, match="unknown draft model id 'no-such-draft'"):
        loaded.check_models_known(loaded.box("box1"), catalog().models)


# ---------------------------------------------------------------- the command line


def test_plan_command_pairs_each_draft_with_the_model_before_it(tmp_path):
    from tests.cli import invoke

    saved = tmp_path / "dual.json"
    saved.write_text(json.dumps(profile(DUAL).model_dump(mode="json")))
    result = invoke("plan", "--profile", str(saved), "--model", TARGET, "--draft", DRAFT, "--model", DEEPSEEK,
                    "--json")
    assert result.exit_code == 0, result.output
    services = {s["model"]: s for s in json.loads(result.stdout)["services"]}
    assert services[TARGET]["draft"]["model"] == DRAFT and services[TARGET]["draft"]["compatible"] is True
    assert "--model-draft" in services[TARGET]["args"] and services[DEEPSEEK]["draft"] is None
    early = invoke("plan", "--profile", str(saved), "--draft", DRAFT, "--model", TARGET)
    assert early.exit_code == 2 and "comes before any --model" in early.output


def test_plan_command_refuses_a_larger_draft_in_one_line(tmp_path):
    from tests.cli import run_controller
    from tests.unit.clean_errors import assert_one_line_error

    saved = tmp_path / "single.json"
    saved.write_text(json.dumps(profile(SINGLE).model_dump(mode="json")))
    result = run_controller("plan", "--profile", str(saved), "--model", DRAFT, "--draft", TARGET, timeout=60)
    assert_one_line_error(result, 2, "not smaller than its target")


def test_estimate_command_adds_the_draft_block_and_counts_it(tmp_path):
    from tests.cli import invoke

    shape = dict(n_embd=64, n_head=2, n_head_kv=1, n_ff=128, n_vocab=400)
    target = write_model(tmp_path / "t.gguf", n_layer=4, **shape)
    draft = write_model(tmp_path / "d.gguf", n_layer=1, **shape)
    alone = json.loads(invoke("estimate", str(target), "--ctx", "2048", "--json").stdout)
    result = invoke("estimate", str(target), "--ctx", "2048", "--gpus", "0", "--gpu-mem-mib", "16384", "--draft",
                    str(draft), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    block = data["draft"]
    assert {"weights", "kv", "compute"} <= set(block) and {"total_mib", "per_device"} <= set(block["weights"])
    assert {"total_mib", "cells", "layers"} <= set(block["kv"]) and "total_mib" in block["compute"]
    assert block["kv"]["cells"] == 2048 and block["kv"]["layers"] == 1
    gpu_alone = json.loads(invoke("estimate", str(target), "--ctx", "2048", "--gpus", "0", "--gpu-mem-mib", "16384",
                                  "--json").stdout)
    assert data["total_mib"] == pytest.approx(gpu_alone["total_mib"] + block["total_mib"], abs=0.02)
    # the draft shares the target's process: its share of the card, without a second CUDA context
    card = data["devices"][0]["total_mib"] - gpu_alone["devices"][0]["total_mib"]
    assert card == pytest.approx(block["weights"]["per_device"]["CUDA0"] + block["compute"]["per_device"]["CUDA0"]
                                 + block["kv"]["total_mib"], abs=0.05)
    assert block["total_mib"] < 0.5 * gpu_alone["devices"][0]["total_mib"]
    assert alone["total_mib"] < data["total_mib"]


def test_render_hands_both_files_to_gguf_model_and_the_draft_flags_to_the_service(tmp_path):
    from controller.model.fleet import parse_fleet
    from controller.stages.planner import plan_box
    from controller.stages.render import host_vars
    from tests.unit.tiny_box import CPU_PROFILE

    pins = tmp_path / "pins.yml"
    pins.write_text("models:\n" + "".join(
        f"  {model_id}:\n" + "".join(f"    {k}: {json.dumps(v)}\n" for k, v in {
            **catalog().model(model_id).model_dump(exclude={"id"}, exclude_none=True), "sha256": digit * 64}.items())
        for model_id, digit in ((TARGET, "a"), (DRAFT, "b"))))
    cat = load_catalog([pins])
    box = {"address": "127.0.0.1", "mirror": {"engines": "https://mirror.lan/e"},
           "models": [{"id": TARGET, "draft": DRAFT, "ctx": 4096}]}
    fleet = parse_fleet({"boxes": {"box1": box}}, tmp_path / "fleet.yml")
    box, machine = fleet.box("box1"), CPU_PROFILE.model_copy(update={"memory_mib": 65536})
    host = host_vars(box, machine, plan_box(box, machine, cat))
    files = {f["name"]: f["sha256"] for f in host["gguf_model_files"]}
    assert files == {cat.model(TARGET).file: "a" * 64, cat.model(DRAFT).file: "b" * 64}
    args = host["llama_service_instances"][0]["args"]
    assert args[args.index("--model-draft") + 1] == f"{host['gguf_model_dir']}/{cat.model(DRAFT).file}"
    assert args[args.index("--spec-type") + 1] == "draft-simple"  # the CPU build drafts only when asked
