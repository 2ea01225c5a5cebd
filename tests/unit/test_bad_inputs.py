"""Inputs an operator can get wrong (issue 19, item 6): each is one line naming the input and what to fix, exit 2,
and nothing written; never an endless read, a crash or a plan that "fits" because a number was absurd.

The kinds: numbers of ``controller estimate`` (negative, zero, NaN, infinite, absurdly large, repeated GPUs), catalog
entries (sizes, hyperparameters, rates), saved probe profiles (GPU memory, indices, counts), fleet values, and the
files themselves (an endless stream, a file far too large, a YAML alias bomb, nesting without end).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from controller.actions.lock import read_lock
from controller.errors import CatalogError, FleetError, LockError
from controller.model.catalog import load_catalog
from controller.model.fleet import load_fleet
from tests.cli import REPO, invoke
from tests.unit.clean_errors import assert_one_line_error
from tests.unit.planner.helpers import SINGLE, TWELVE, profile

BIG = "1" + "0" * 20  # 10^20: a GPU index, a context or a size no machine has


def one_line(outcome, exit_code: int, *words: str) -> str:
    """The single error line of an in-process ``invoke``; it names every one of ``words``."""
    assert "Traceback" not in outcome.output, outcome.output
    assert outcome.exit_code == exit_code, outcome.output
    assert outcome.stdout == "", outcome.output
    lines = [line for line in outcome.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, outcome.output
    for word in words:
        assert word in lines[0], outcome.output
    return lines[0]


def limited_controller(*args: str, timeout: float, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """``python -m controller ARGS`` with its memory capped, so that an unbounded read of an endless stream fails
    fast instead of eating the machine's memory."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))

    env = dict(os.environ, XDG_STATE_HOME=str(cwd / "state"), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "controller", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout, check=False, preexec_fn=cap)


# ------------------------------------------------------------------------------------------ controller estimate


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lab.tinymodels import write_model

    return write_model(tmp_path_factory.mktemp("m") / "g.gguf", "gemma3", n_layer=4, file_type="q8_0")


@pytest.mark.parametrize("args,option", [
    (("--ctx", "-5"), "--ctx"),
    (("--ctx", BIG), "--ctx"),
    (("--parallel", "-2"), "--parallel"),
    (("--parallel", "0"), "--parallel"),
    (("--parallel", "100000"), "--parallel"),
    (("--ubatch", "-1"), "--ubatch"),
    (("--ubatch", "0"), "--ubatch"),
    (("--batch", "0"), "--batch"),
    (("--batch", BIG), "--batch"),
    (("--n-gpu-layers", "-7"), "--n-gpu-layers"),
    (("--n-gpu-layers", BIG), "--n-gpu-layers"),
    (("--gpus", "0,0"), "--gpus"),
    (("--gpus", "-1"), "--gpus"),
    (("--gpus", "64"), "--gpus"),
    (("--gpus", BIG), "--gpus"),
    (("--gpus", "0,x"), "--gpus"),
    (("--gpu-mem-mib", "-100"), "--gpu-mem-mib"),
    (("--gpu-mem-mib", "0"), "--gpu-mem-mib"),
    (("--gpu-mem-mib", "nan"), "--gpu-mem-mib"),
    (("--gpu-mem-mib", "inf"), "--gpu-mem-mib"),
    (("--gpu-mem-mib", "1e400"), "--gpu-mem-mib"),
    (("--gpu-mem-mib", BIG), "--gpu-mem-mib"),
    (("--gpu-mem-mib", ",".join(["16384"] * 65)), "--gpu-mem-mib"),
    (("--gpus", "0,1", "--gpu-mem-mib", "16384,-1"), "--gpu-mem-mib"),
])
def test_estimate_refuses_a_number_no_server_runs_with(gguf, args, option):
    one_line(invoke("estimate", str(gguf), *args), 2, option)


@pytest.mark.parametrize("args,option", [
    (("--draft", "DRAFT", "--ctx", "-5"), "--ctx"),
    (("--draft", "DRAFT", "--gpus", "0,0"), "--gpus"),
])
def test_estimate_with_a_draft_refuses_them_too(gguf, args, option):
    args = tuple(str(gguf) if arg == "DRAFT" else arg for arg in args)
    one_line(invoke("estimate", str(gguf), *args), 2, option)


def test_estimate_still_takes_the_edges_that_mean_something(gguf):
    """0 is the training context (llama.cpp's -c 0), -1 layers is every layer, 256 slots is llama.cpp's most."""
    for args in (("--ctx", "0"), ("--n-gpu-layers", "-1", "--gpus", "0"), ("--parallel", "256"),
                 ("--gpus", "0,63", "--gpu-mem-mib", "16384,32768.5"), ("--gpu-mem-mib", "16384")):
        result = invoke("estimate", str(gguf), *args, "--json")
        assert result.exit_code == 0, (args, result.output)
        json.loads(result.stdout)


# ------------------------------------------------------------------------------------------------ catalog entries


TINY = {"name": "t", "repo": "lab/r", "file": "t.gguf", "engine": "upstream", "size_bytes": 1000}
SHAPED = {
    "name": "q", "repo": "lab/q", "file": "q.gguf", "engine": "upstream", "arch": "qwen3", "file_type": "Q8_0",
    "hparams": {"context_length": 32768, "embedding_length": 2560, "block_count": 36, "vocab_size": 151936,
                "attention.head_count": 32, "attention.head_count_kv": 8, "attention.key_length": 128,
                "attention.value_length": 128, "feed_forward_length": 9728, "rope.freq_base": 1000000.0},
}


def _hp(**changes: object) -> dict:
    return {**SHAPED, "hparams": {**SHAPED["hparams"], **{key.replace("__", "."): value
                                                         for key, value in changes.items()}}}


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("body,field", [
    ({**TINY, "size_bytes": -1}, "size_bytes"),
    ({**TINY, "size_bytes": -(2**40)}, "size_bytes"),
    ({**TINY, "size_bytes": 10**400}, "size_bytes"),
    ({**TINY, "measured": True, "kv_bytes_per_token": {"f16": -4096}}, "kv_bytes_per_token"),
    ({**TINY, "tokenizer": {"model": "gpt2", "tokens": 1000, "bos": -1}}, "bos"),
    (_hp(attention__head_count_kv=-2), "attention.head_count_kv"),
    (_hp(attention__head_count_kv=[8, -2, 8]), "attention.head_count_kv"),
    (_hp(attention__head_count=0), "attention.head_count"),
    (_hp(attention__head_count=[0, 0]), "attention.head_count"),
    (_hp(rope__freq_base=NAN), "rope.freq_base"),
    (_hp(rope__freq_base=INF), "rope.freq_base"),
    (_hp(rope__freq_base=-10000.0), "rope.freq_base"),
    (_hp(block_count=0), "block_count"),
    (_hp(block_count=10**9), "block_count"),
    (_hp(block_count=True), "block_count"),
    (_hp(embedding_length=-2560), "embedding_length"),
    (_hp(vocab_size=10**400), "vocab_size"),
    (_hp(context_length=0), "context_length"),
    (_hp(feed_forward_length=[]), "feed_forward_length"),
    (_hp(feed_forward_length=[9728] * 1000), "feed_forward_length"),
    (_hp(attention__layer_norm_rms_epsilon=NAN), "attention.layer_norm_rms_epsilon"),
    (_hp(feed_forward_length=9728.5), "feed_forward_length"),
    (_hp(nextn_predict_layers=36), "nextn_predict_layers"),
    (_hp(expert_count=4, expert_used_count=8), "expert_used_count"),
    (_hp(attention__head_count_kv=64), "attention.head_count_kv"),
    ({**TINY, "throughput": [{"hardware": "one V100", "gpus": 1, "gen_tok_s": [NAN, None], "source": "s"}]},
     "gen_tok_s"),
    ({**TINY, "throughput": [{"hardware": "one V100", "gpus": 1, "gen_tok_s": [INF, None], "source": "s"}]},
     "gen_tok_s"),
    ({**TINY, "throughput": [{"hardware": "one V100", "gpus": 1, "gen_tok_s": [50, 10], "source": "s"}]},
     "gen_tok_s"),
    ({**TINY, "throughput": [{"hardware": "V100s", "gpus": 10**6, "gen_tok_s": [5, None], "source": "s"}]}, "gpus"),
])
def test_a_catalog_entry_with_an_impossible_number_is_refused(tmp_path, body, field):
    path = tmp_path / "extra.yml"
    path.write_text(yaml.safe_dump({"models": {"bad": body}}))
    with pytest.raises(CatalogError) as err:
        load_catalog([path])
    message = str(err.value)
    assert message.startswith(f"{path}: entry models.bad") and field in message and "\n" not in message


@pytest.mark.parametrize("body", [
    {"family": "upstream", "commit": "abc1234", "packs": {"linux-x86_64": {"file": "p.tar.gz"}}, "min_driver": -1},
    {"family": "upstream", "commit": "abc1234", "packs": {"linux-x86_64": {"file": "p.tar.gz"}}, "max_driver": 10**30},
])
def test_an_engine_entry_with_an_impossible_driver_is_refused(tmp_path, body):
    path = tmp_path / "extra.yml"
    path.write_text(yaml.safe_dump({"engines": {"up-abc1234": body}}))
    with pytest.raises(CatalogError, match="driver"):
        load_catalog([path])


def _saved_profile(tmp_path: Path, machine: str = SINGLE, **changes: object) -> Path:
    data = profile(machine).model_dump(mode="json")
    data.update(changes)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("body,field", [
    ({**TINY, "size_bytes": -(2**40)}, "size_bytes"),
    (_hp(attention__head_count_kv=-2), "head_count_kv"),
    (_hp(attention__head_count=0), "head_count"),
    (_hp(rope__freq_base=NAN), "rope.freq_base"),
])
def test_plan_never_fits_a_model_whose_catalog_entry_is_impossible(tmp_path, body, field):
    catalog = tmp_path / "extra.yml"
    catalog.write_text(yaml.safe_dump({"models": {"bad": body}}))
    result = invoke("plan", "--profile", str(_saved_profile(tmp_path)), "--model", "bad", "--catalog", str(catalog))
    one_line(result, 2, str(catalog), field)


# ----------------------------------------------------------------------------------------------- saved profiles


def _gpus(**changes: object) -> list[dict]:
    first = profile(SINGLE).model_dump(mode="json")["gpus"][0]
    return [{**first, **changes}]


@pytest.mark.parametrize("changes,words", [
    ({"gpus": _gpus(memory_mib=-16384)}, ["gpus.0.memory_mib"]),
    ({"gpus": _gpus(memory_mib=10**30)}, ["gpus.0.memory_mib"]),
    ({"gpus": _gpus(power_limit_w="NaN")}, ["gpus.0.power_limit_w"]),
    ({"gpus": _gpus(temperature_c="Infinity")}, ["gpus.0.temperature_c"]),
    ({"gpus": _gpus(index=64)}, ["GPU index 64"]),
    ({"gpus": _gpus(index=int(BIG))}, [f"GPU index {BIG}"]),
    ({"gpus": [{**_gpus()[0], "index": index, "uuid": None} for index in range(65)]}, ["GPU index 64"]),
    ({"gpus": [{**_gpus()[0], "index": 0}] * 1000}, ["GPU index 0 is listed twice"]),
    ({"memory_mib": -1}, ["memory_mib"]),
    ({"memory_mib": 10**30}, ["memory_mib"]),
    ({"cpu": {**profile(SINGLE).model_dump(mode="json")["cpu"], "threads": -4}}, ["cpu.threads"]),
    ({"cpu": {**profile(SINGLE).model_dump(mode="json")["cpu"], "cores": 0}}, ["cpu.cores"]),
    ({"disks": [{"path": "/", "total_mib": -5, "free_mib": 10}]}, ["disks.0.total_mib"]),
    ({"nvlink": {"pairs": [[0, 99, 2]]}}, ["GPU 99"]),
    ({"nvlink": {"pairs": [[0, 1, 10**6]]}}, ["links"]),
    ({"nvlink": {"pairs": [[0, 0, -2]]}}, ["nvlink"]),
    ({"boards": [[0, 70]]}, ["GPU 70"]),
    ({"nvlink": {"pairs": [[0, 0, 2]]}}, ["GPU 0 to itself"]),
    ({"boards": [[0], [0]]}, ["GPU 0 is on two boards"]),
])
def test_plan_refuses_a_profile_with_impossible_hardware(tmp_path, changes, words):
    path = _saved_profile(tmp_path, **changes)
    text = path.read_text().replace('"NaN"', "NaN").replace('"Infinity"', "Infinity")  # JSON as Python writes it
    path.write_text(text)
    result = invoke("plan", "--profile", str(path), "--model", "qwen3-4b-instruct-2507-q8_0")
    one_line(result, 2, str(path), *words)


def test_a_profile_from_an_endless_stream_is_refused_at_once(tmp_path):
    result = limited_controller("plan", "--profile", "/dev/zero", "--model", "qwen3-4b-instruct-2507-q8_0",
                                timeout=60, cwd=tmp_path)
    assert_one_line_error(result, 2, "/dev/zero", "profile")


def test_a_named_pipe_without_a_writer_is_not_waited_for(tmp_path):
    fifo = tmp_path / "profile.json"
    os.mkfifo(fifo)
    result = limited_controller("plan", "--profile", str(fifo), "--model", "qwen3-4b-instruct-2507-q8_0",
                                timeout=60, cwd=tmp_path)
    assert_one_line_error(result, 2, str(fifo), "profile")


def test_a_profile_piped_in_is_read(tmp_path):
    """A pipe is read, up to the bound: `controller plan --profile <(controller probe box --json)` works."""
    done = subprocess.run(["bash", "-c", f'{sys.executable} -m controller plan --profile <(cat "$0") --model '
                           "qwen3-4b-instruct-2507-q8_0 --json", str(_saved_profile(tmp_path))],
                          capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["services"]


def test_a_profile_far_larger_than_any_probe_is_refused(tmp_path):
    path = _saved_profile(tmp_path)
    path.write_text(path.read_text()[:-1] + " " * (2 * 2**20) + "}")
    one_line(invoke("plan", "--profile", str(path), "--model", "qwen3-4b-instruct-2507-q8_0"), 2, str(path),
             "larger than")


def test_a_real_profile_still_plans(tmp_path):
    result = invoke("plan", "--profile", str(_saved_profile(tmp_path, TWELVE)), "--model",
                    "qwen3-4b-instruct-2507-q8_0", "--json")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("ctx", ["-5", BIG])
def test_plan_refuses_a_context_no_server_runs_with(tmp_path, ctx):
    result = invoke("plan", "--profile", str(_saved_profile(tmp_path)), "--model", "qwen3-4b-instruct-2507-q8_0",
                    "--ctx", ctx)
    assert result.exit_code == 2 and "--ctx" in result.output and "Traceback" not in result.output


# ---------------------------------------------------------------------------------------------------- fleet files


def _fleet(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.yml"
    path.write_text(text)
    return path


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """The billion laughs in YAML: each level repeats the one before ``width`` times (9^9 values at the end)."""
    lines = ["    vars:", '      l0: &l0 ["lol"]']
    for level in range(1, levels + 1):
        lines.append(f"      l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * width) + "]")
    return "boxes:\n  box3:\n    address: 127.0.0.1\n    transport: local\n" + "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_naming_the_file(tmp_path):
    path = _fleet(tmp_path, alias_bomb())
    with pytest.raises(FleetError) as err:
        load_fleet(path)
    assert str(path) in str(err.value) and "alias" in str(err.value) and "\n" not in str(err.value)


def test_render_of_an_alias_bomb_is_one_line_and_writes_nothing(tmp_path):
    path = _fleet(tmp_path, alias_bomb(levels=6, width=10))  # 10^6 values: today rendered, slowly, into host_vars
    result = limited_controller("render", "box3", "--fleet", str(path), timeout=300, cwd=tmp_path)
    assert_one_line_error(result, 2, str(path), "alias")
    assert not (tmp_path / "inventory").exists()


def test_a_recursive_alias_is_refused(tmp_path):
    path = _fleet(tmp_path, "boxes:\n  box3:\n    address: 127.0.0.1\n    vars:\n      loop: &loop [*loop]\n")
    with pytest.raises(FleetError, match="alias"):
        load_fleet(path)


def test_nesting_without_end_is_refused(tmp_path):
    deep = "[" * 5000 + "]" * 5000
    path = _fleet(tmp_path, f"boxes:\n  box3:\n    address: 127.0.0.1\n    vars:\n      deep: {deep}\n")
    with pytest.raises(FleetError) as err:
        load_fleet(path)
    assert "nested" in str(err.value) and "\n" not in str(err.value)


def test_ordinary_anchors_and_merge_keys_still_work(tmp_path):
    fleet = load_fleet(_fleet(tmp_path, """
defaults: {user: llm}
boxes:
  a1: &box {address: 192.0.2.1, models: &models [{id: qwen3-4b-instruct-2507-q8_0, ctx: 8192}]}
  a2: {<<: *box, address: 192.0.2.2, vars: {tags: &tags [gpu, v100], more: *tags}}
  a3: {address: 192.0.2.3, models: *models}
"""))
    assert fleet.box("a2").models[0].ctx == 8192 and fleet.box("a3").models[0].id == "qwen3-4b-instruct-2507-q8_0"
    assert fleet.box("a2").vars["more"] == ["gpu", "v100"] and fleet.box("a2").user == "llm"


def test_a_fleet_file_far_larger_than_any_fleet_is_refused(tmp_path):
    path = _fleet(tmp_path, "boxes:\n  box3: {address: 192.0.2.10}\n" + "# padding\n" * 300_000)  # 3 MB
    with pytest.raises(FleetError) as err:
        load_fleet(path)
    assert str(path) in str(err.value) and "larger than" in str(err.value)


def test_a_fleet_file_from_an_endless_stream_is_refused_at_once(tmp_path):
    result = limited_controller("render", "box3", "--fleet", "/dev/zero", timeout=60, cwd=tmp_path)
    assert_one_line_error(result, 2, "/dev/zero")


def test_a_catalog_from_an_endless_stream_is_refused_at_once(tmp_path):
    result = limited_controller("plan", "--profile", str(_saved_profile(tmp_path)), "--model", "t", "--catalog",
                                "/dev/zero", timeout=60, cwd=tmp_path)
    assert_one_line_error(result, 2, "/dev/zero", "catalog")


def _sparse(path: Path, size: int) -> Path:
    """A file of ``size`` zero bytes that takes no disk (an unbounded read of it still costs ``size`` of memory)."""
    with path.open("wb") as handle:
        handle.truncate(size)
    return path


def test_a_secret_file_far_larger_than_a_key_is_refused(tmp_path):
    secret = _sparse(tmp_path / "key.txt", 100 * 2**20)
    fleet = load_fleet(_fleet(tmp_path, f"boxes:\n  a1: {{address: 127.0.0.1, api_key: {{file: {secret}}}}}\n"))
    with pytest.raises(FleetError, match="key.txt.*larger than"):
        fleet.box("a1").api_key.resolve("box a1: api_key")


@pytest.mark.parametrize("box,field", [
    ({"models": [{"id": "qwen3-4b-instruct-2507-q8_0", "ctx": int(BIG)}]}, "ctx"),
    ({"models": [{"id": "qwen3-4b-instruct-2507-q8_0", "ctx": NAN}]}, "ctx"),
    ({"agents": -1}, "agents"),
    ({"agents": 0}, "agents"),
    ({"agents": 10**6}, "agents"),
    ({"power_limit_w": {64: 150}}, "power_limit_w"),
    ({"power_limit_w": {int(BIG): 150}}, "power_limit_w"),
    ({"power_limit_w": NAN}, "power_limit_w"),
    ({"thermal": {"interval_s": NAN}}, "interval_s"),
    ({"thermal": {"interval_s": INF}}, "interval_s"),
    ({"port": -22}, "port"),
    ({"base_port": NAN}, "base_port"),
])
def test_a_fleet_value_no_box_can_have_is_refused(tmp_path, box, field):
    path = _fleet(tmp_path, yaml.safe_dump({"boxes": {"box3": {"address": "192.0.2.10", **box}}}))
    with pytest.raises(FleetError) as err:
        load_fleet(path)
    assert field in str(err.value) and "box 'box3'" in str(err.value)


# --------------------------------------------------------------------------------------------------------- lock


def test_a_lock_far_too_large_or_an_alias_bomb_is_refused(tmp_path):
    with pytest.raises(LockError, match="larger than"):
        read_lock(_sparse(tmp_path / "big.lock.yml", 100 * 2**20))
    bomb = tmp_path / "fleet.lock.yml"
    bomb.write_text(alias_bomb().replace("boxes:", "boxes_:"))
    with pytest.raises(LockError, match="alias"):
        read_lock(bomb)


def test_a_probe_output_no_box_can_have_is_one_line_not_a_crash():
    from controller.errors import ProbeError
    from controller.stages.probe.parse import parse_outputs

    csv = ("index, uuid, name, memory.total [MiB], compute_cap, pci.bus_id, driver_version\n"
           "0, GPU-1, Tesla V100-SXM2-16GB, -16384 MiB, 7.0, 00000000:3B:00.0, 580.82.07\n")
    try:
        profile = parse_outputs({"nvidia-smi-query.csv": csv})
    except ProbeError as exc:
        assert "which no box has" in str(exc) and "\n" not in str(exc)
    else:  # the parser may also drop the value with a warning: never a negative size in the profile
        assert all((gpu.memory_mib or 0) >= 0 for gpu in profile.gpus)
