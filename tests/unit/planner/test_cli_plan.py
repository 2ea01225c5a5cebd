"""``controller plan``: both forms of the contract, GGUF headers as models, and the errors an operator sees."""

from __future__ import annotations

import json
import socket

import pytest
import yaml

from lab.tinymodels import write_model
from tests.cli import invoke, run_controller
from tests.unit.clean_errors import assert_one_line_error
from tests.unit.planner.helpers import CPU_ONLY, DUAL, SINGLE, TWELVE, profile

SERVICE_KEYS = {"model", "engine", "gpus", "split_mode", "ctx", "parallel", "kv_unified", "cache_type_k",
                "cache_type_v", "ubatch", "batch", "threads", "n_gpu_layers", "cpu_offload", "spec_decoding",
                "template", "port", "args", "env", "memory", "reasons"}


def _invoke(*args: str):
    return invoke("plan", *args)


@pytest.fixture
def saved(tmp_path):
    """A `controller probe --json` profile of a seed machine, as a file."""
    def write(machine: str):
        path = tmp_path / f"{machine}.json"
        path.write_text(json.dumps(profile(machine).model_dump(mode="json")))
        return str(path)
    return write


def test_profile_form_prints_the_plan_contract(saved):
    result = _invoke("--profile", saved(DUAL), "--model", "qwen3.6-27b-q4_k_m", "--model", "gemma4-26b-a4b-qat-q4_0",
                     "--agents", "2", "--json")
    assert result.exit_code == 4, result.output  # not every wanted model fits: as provision exits (issue 21)
    data = json.loads(result.stdout)  # the plan is still printed, whole
    assert {"fits", "services", "unplaced"} <= set(data)  # the contract: extended, never renamed
    assert data["fits"] is False  # the 27B needs both cards, so Gemma finds none free
    (service,) = data["services"]
    assert SERVICE_KEYS <= set(service) and service["model"] == "qwen3.6-27b-q4_k_m"
    assert service["parallel"] == 2 and service["args"][:2] == ["--model", "C:\\llama\\models\\Qwen3.6-27B-Q4_K_M.gguf"]
    assert set(service["memory"]["per_device_mib"]) == {"cuda0", "cuda1", "cpu"}
    assert data["unplaced"][0]["model"] == "gemma4-26b-a4b-qat-q4_0"
    assert "already given to a larger model" in data["unplaced"][0]["reason"]


def test_a_plan_where_not_every_model_fits_prints_it_then_exits_4_naming_the_model_last(saved):
    result = _invoke("--profile", saved(DUAL), "--model", "qwen3.6-27b-q4_k_m", "--model", "gemma4-26b-a4b-qat-q4_0",
                     "--agents", "2")
    assert result.exit_code == 4, result.output
    assert "llama-qwen3.6-27b-q4_k_m: qwen3.6-27b-q4_k_m on" in result.stdout  # the plan, as before
    assert result.stdout.splitlines()[-1].startswith("not placed: gemma4-26b-a4b-qat-q4_0: ")
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: not every wanted model fits: gemma4-26b-a4b-qat-q4_0: ")
    assert "already given to a larger model" in line


def test_profile_form_applies_the_asked_context(saved):
    data = json.loads(_invoke("--profile", saved(SINGLE), "--model", "gemma4-26b-a4b-qat-q4_0", "--ctx", "32768",
                              "--json").stdout)
    assert data["fits"] and data["services"][0]["ctx"] == 32768


def test_text_output_has_reasons_and_the_command_line(saved):
    result = _invoke("--profile", saved(TWELVE), "--model", "qwen3.6-35b-a3b-q6_k")
    assert result.exit_code == 0
    assert "llama-qwen3.6-35b-a3b-q6_k: qwen3.6-35b-a3b-q6_k on ik-022bd00a" in result.stdout
    assert "  - fits one card" in result.stdout and "CUDA_VISIBLE_DEVICES=" in result.stdout
    assert "llama-server --model" in result.stdout


def test_a_gguf_file_is_planned_from_its_header(saved, tmp_path):
    path = write_model(tmp_path / "Tiny-MoE-Q8_0.gguf", "qwen3moe", n_layer=2, n_embd=256, n_head=4, n_head_kv=2,
                       n_ff=512, n_expert=4, n_expert_used=2, file_type="q8_0", header_only=True)
    data = json.loads(_invoke("--profile", saved(SINGLE), "--model", str(path), "--json").stdout)
    (service,) = data["services"]
    assert service["model"] == "tiny-moe-q8_0" and service["engine"] == "ik-022bd00a"  # MoE without a window
    assert any("GGUF header" in reason for reason in service["reasons"])
    cpu = json.loads(_invoke("--profile", saved(CPU_ONLY), "--model", str(path), "--json").stdout)
    assert cpu["services"][0]["engine"] == "cpu-0c1e570"


def test_a_header_replaces_a_catalog_models_hparams(saved, tmp_path):
    path = write_model(tmp_path / "g.gguf", "gemma3", n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                       file_type="q8_0", header_only=True)
    data = json.loads(_invoke("--profile", saved(SINGLE), "--model", "gemma4-26b-a4b-qat-q4_0",
                              "--header", f"gemma4-26b-a4b-qat-q4_0={path}", "--json").stdout)
    (service,) = data["services"]
    assert service["memory"]["per_device_mib"]["cuda0"] < 2000  # the tiny header, not the 13 GiB catalog model
    assert any(str(path) in reason for reason in service["reasons"])


def test_box_form_probes_the_box_and_plans_its_fleet_models(tmp_path):
    fleet = tmp_path / "fleet.yml"
    fleet.write_text(yaml.safe_dump({"boxes": {"here": {
        "address": "127.0.0.1", "transport": "local", "base_port": 18090,
        "models": [{"id": "qwen3-4b-instruct-2507-q8_0", "ctx": 4096}]}}}))
    data = json.loads(_invoke("here", "--fleet", str(fleet), "--json").stdout)
    (service,) = data["services"]
    assert service["port"] == 18090 and service["ctx"] == 4096 and service["engine"]


@pytest.mark.parametrize("args,message", [
    ((), "give BOX with --fleet FILE, or --profile"),
    (("box3",), "needs the fleet file"),
    (("box3", "--fleet", "f.yml", "--model", "x"), "with BOX the fleet file says what to serve"),
    (("--profile", "p.json"), "at least one --model"),
    (("--profile", "p.json", "--model", "m", "--header", "nope"), "expected ID=PATH_OR_URL"),
])
def test_usage_errors_say_what_to_give(args, message):
    result = _invoke(*args)
    assert result.exit_code == 2 and message in result.output


def test_bad_inputs_exit_2_with_the_reason(saved, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gpus": [{"index": 0}]}))
    result = _invoke("--profile", str(bad), "--model", "qwen3.6-35b-a3b-q6_k")
    assert result.exit_code == 2 and "not a `controller probe --json` profile: gpus.0.name" in result.output
    result = _invoke("--profile", saved(SINGLE), "--model", "no-such-model")
    assert result.exit_code == 2 and "unknown model id 'no-such-model'" in result.output
    result = _invoke("--profile", saved(SINGLE), "--model", str(tmp_path / "missing.gguf"))
    assert result.exit_code == 2 and "missing.gguf" in result.output


def test_an_unknown_architecture_is_planned_with_what_could_not_be_checked(saved, tmp_path):
    from lab.tinymodels import write_gguf

    path = write_gguf(tmp_path / "mystery.gguf", "mystery", {
        "mystery.block_count": 4, "mystery.embedding_length": 256, "mystery.attention.head_count": 4,
        "mystery.context_length": 8192, "mystery.vocab_size": 1000}, [], header_only=True)
    data = json.loads(_invoke("--profile", saved(SINGLE), "--model", str(path), "--json").stdout)
    (service,) = data["services"]
    assert any(reason.startswith("note:") and "unknown" in reason for reason in service["reasons"])


def test_a_file_that_is_not_a_gguf_is_refused(saved, tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"<html>not a model</html>" * 10)
    result = _invoke("--profile", saved(SINGLE), "--model", str(fake))
    assert result.exit_code == 2 and "fake.gguf" in result.output


@pytest.mark.parametrize("indices,problem", [((0, 0), "GPU index 0 is listed twice"),
                                             ((-1,), "GPU index -1 is negative")])
def test_a_profile_with_unusable_gpu_indices_is_refused(tmp_path, indices, problem):
    data = profile(SINGLE).model_dump(mode="json")
    data["gpus"] = [{**data["gpus"][0], "index": index} for index in indices]
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    result = run_controller("plan", "--profile", str(path), "--model", "qwen3-4b-instruct-2507-q8_0", timeout=60)
    assert_one_line_error(result, 2, str(path), problem)  # never CUDA_VISIBLE_DEVICES=-1 or a shared card


def test_box_form_refuses_an_unknown_model_id_before_connecting(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        fleet = tmp_path / "fleet.yml"
        fleet.write_text(yaml.safe_dump({"boxes": {"box3": {
            "address": "127.0.0.1", "port": listener.getsockname()[1], "models": [{"id": "no-such-model"}]}}}))
        result = run_controller("plan", "box3", "--fleet", str(fleet), timeout=60)
        assert_one_line_error(result, 2, str(fleet), "box 'box3'", "unknown model id 'no-such-model'")
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody knocked: the box was never contacted


def test_a_gguf_whose_file_name_is_no_plain_name_is_still_planned(saved, tmp_path):
    path = write_model(tmp_path / "_My Model..v2 (q8).gguf", "llama", n_layer=2, n_embd=256, n_head=4, n_head_kv=2,
                       n_ff=512, file_type="q8_0", header_only=True)
    result = run_controller("plan", "--profile", saved(SINGLE), "--model", str(path), "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    (service,) = json.loads(result.stdout)["services"]
    assert service["model"] == "my-model.v2-q8"
