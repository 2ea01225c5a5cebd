import json

import pytest
import yaml

from controller.errors import CatalogError, FleetError, PlanError
from controller.model.catalog import load_catalog
from controller.model.fleet import parse_fleet
from controller.model.profile import Cpu, Gpu, HardwareProfile, OsInfo
from controller.stages.planner import plan_box, plan_driver
from controller.stages.render import host_vars as render_host_vars
from controller.stages.render import render_box

SHA = "cd" * 32


@pytest.fixture
def catalog(tmp_path):
    extra = tmp_path / "catalog.yml"
    extra.write_text(yaml.safe_dump({"models": {
        "gemma4-26b-a4b-qat-q4_0": {
            "name": "g", "repo": "google/gemma-4-26B-A4B-it-qat-q4_0-gguf", "file": "gemma-4-26B_q4_0-it.gguf",
            "size_bytes": 14388140032, "sha256": SHA, "engine": "upstream", "template": "gemma4-nothink.jinja"},
        "tiny": {"name": "t", "repo": "lab/r", "file": "t.gguf", "size_bytes": 1000, "sha256": SHA,
                 "engine": "upstream"},
    }}))
    return load_catalog([extra])


def fleet(tmp_path, **box):
    data = {"boxes": {"box1": {"address": "127.0.0.1", "mirror": {"engines": "https://127.0.0.1:1/engines",
                                                                  "models": "http://127.0.0.1:1"}, **box}}}
    return parse_fleet(data, tmp_path / "fleet.yml")


def v100_profile(memory_mib=16384):
    return HardwareProfile(
        gpus=[Gpu(index=0, name="Tesla V100-PCIE-16GB", memory_mib=memory_mib, compute_capability="7.0")],
        cpu=Cpu(model="Xeon", cores=12, threads=24), memory_mib=65536, os=OsInfo(family="linux"))


CPU_PROFILE = HardwareProfile(cpu=Cpu(model="EPYC", cores=2, threads=4), memory_mib=8192, os=OsInfo(family="linux"))


def test_cpu_box_gets_the_cpu_engine_with_one_thread_per_core(tmp_path, catalog):
    f = fleet(tmp_path, models=[{"id": "tiny", "ctx": 2048}], base_port=18080)
    plan = plan_box(f.box("box1"), CPU_PROFILE, catalog)
    (service,) = plan.services
    assert plan.fits and service.engine == "cpu-0c1e570" and service.gpus == [] and service.threads == 2
    assert service.args[:2] == ["--model", "/var/lib/llama/models/t.gguf"]
    assert ["--port", "18080"] == service.args[service.args.index("--port"):][:2]
    assert "--alias" in service.args and service.args[service.args.index("--alias") + 1] == "tiny"
    assert service.args[-2:] == ["--load-mode", "mmap"]  # the CPU build's flag, not --no-mmap


def test_v100_box_pins_the_model_to_one_gpu(tmp_path, catalog):
    f = fleet(tmp_path, models=[{"id": "gemma4-26b-a4b-qat-q4_0"}])
    (service,) = plan_box(f.box("box1"), v100_profile(), catalog).services
    assert service.engine == "upstream-02182fc" and service.gpus == [0]
    # No UUID in this profile: nvidia-smi's index, which CUDA numbers alike only in PCI bus order.
    assert service.env == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert service.threads == 6 and service.n_gpu_layers == 99 and service.cache_type_k == "q8_0"
    assert "--chat-template-file" in service.args and "--jinja" in service.args


def test_model_too_big_for_every_gpu_is_unplaced_with_numbers(tmp_path, catalog):
    f = fleet(tmp_path, models=[{"id": "gemma4-26b-a4b-qat-q4_0"}])
    plan = plan_box(f.box("box1"), v100_profile(memory_mib=8192), catalog)
    assert not plan.fits and plan.services == []
    assert "13722 MiB weights" in plan.unplaced[0].reason and "8192 MiB" in plan.unplaced[0].reason


def test_no_models_wanted_is_an_error(tmp_path, catalog):
    with pytest.raises(PlanError, match="no models wanted"):
        plan_box(fleet(tmp_path).box("box1"), CPU_PROFILE, catalog)


def test_render_is_deterministic_and_holds_no_secrets(tmp_path, catalog, monkeypatch):
    monkeypatch.setenv("BOX_API_KEY", "sk-never-in-the-inventory-0123")
    f = fleet(tmp_path, models=[{"id": "tiny"}], bind="0.0.0.0", allow_from=["192.168.1.0/24"],
              api_key={"env": "BOX_API_KEY"}, key="/root/.ssh/id_ed25519", port=2222)
    box = f.box("box1")
    plan = plan_box(box, CPU_PROFILE, catalog)
    first = {p.name: p.read_bytes() for p in render_box(tmp_path / "inv", f, box, CPU_PROFILE, plan)}
    second = {p.name: p.read_bytes() for p in render_box(tmp_path / "inv", f, box, CPU_PROFILE, plan)}
    assert first == second
    everything = b"".join(first.values())
    assert b"sk-never-in-the-inventory" not in everything
    host_vars = yaml.safe_load(first["box1.yml"])
    assert host_vars["llama_engine_packs"] == [{
        "name": "cpu", "version": "0c1e570",
        "url": "https://127.0.0.1:1/engines/llama-cpu-0c1e570-linux-x86_64.tar.gz", "sha256": "",
        "sha256sums_url": "https://127.0.0.1:1/engines/SHA256SUMS", "nccl": False}]
    assert host_vars["gguf_model_files"][0]["url"] == "http://127.0.0.1:1/lab/r/resolve/main/t.gguf"
    assert host_vars["llama_service_bind"] == "0.0.0.0"
    hosts = yaml.safe_load(first["hosts.yml"])
    assert hosts["all"]["children"]["linux"]["hosts"]["box1"] == {
        "ansible_host": "127.0.0.1", "ansible_port": 2222, "ansible_user": "root",
        "ansible_ssh_private_key_file": "/root/.ssh/id_ed25519",
        "ansible_ssh_common_args": f"-o StrictHostKeyChecking=yes -o UserKnownHostsFile={(tmp_path / 'inv').resolve()}/known_hosts"}
    assert "box1" in hosts["all"]["children"]["cpu_only"]["hosts"]
    assert json.loads(first["box1.json"]) in (plan.model_dump(mode="json"), CPU_PROFILE.model_dump(mode="json"))


def test_render_refuses_models_without_checksum_and_engines_without_mirror(tmp_path):
    catalog = load_catalog()
    f = fleet(tmp_path, models=[{"id": "gemma4-26b-a4b-qat-q4_0"}])
    box = f.box("box1")
    plan = plan_box(box, v100_profile(), catalog)
    with pytest.raises(CatalogError, match="no sha256 pinned"):
        render_box(tmp_path / "inv", f, box, v100_profile(), plan)
    nomirror = parse_fleet({"boxes": {"box1": {"address": "127.0.0.1", "models": [{"id": "gemma4-26b-a4b-qat-q4_0"}]}}},
                           tmp_path / "f.yml")
    with pytest.raises(CatalogError, match="set mirror.engines"):
        render_box(tmp_path / "inv2", nomirror, nomirror.box("box1"), v100_profile(),
                   plan_box(nomirror.box("box1"), v100_profile(), catalog))
    assert not (tmp_path / "inv2" / "hosts.yml").exists()


def _pinned(tmp_path, *model_ids):
    """The built-in entries of ``model_ids`` with a sha256 pinned, as a fleet's extra catalog would."""
    builtin = load_catalog()
    extra = tmp_path / "pinned.yml"
    extra.write_text(yaml.safe_dump({"models": {
        model_id: builtin.model(model_id).model_dump(exclude={"id", "hub_url"}) | {"sha256": SHA}
        for model_id in model_ids}}))
    return load_catalog([extra])


def test_render_carries_a_split_service_env_and_engine_pack(tmp_path):
    from tests.unit.planner.helpers import DUAL, profile

    catalog = _pinned(tmp_path, "qwen3.6-27b-q4_k_m")
    f = fleet(tmp_path, models=[{"id": "qwen3.6-27b-q4_k_m", "agents": 4}])
    box = f.box("box1")
    dual = profile(DUAL).model_copy(update={"os": OsInfo(family="linux")})
    plan = plan_box(box, dual, catalog)
    paths = render_box(tmp_path / "inv", f, box, dual, plan)
    host_vars = yaml.safe_load(next(p for p in paths if p.name == "box1.yml").read_text())
    (instance,) = host_vars["llama_service_instances"]
    assert instance["engine"] == "upstream-nccl" and not instance["mlock"]
    uuids = [gpu.uuid for gpu in dual.gpus]
    assert instance["env"] == {"CUDA_VISIBLE_DEVICES": ",".join(uuids), "GGML_CUDA_ALLREDUCE": "nccl"}
    assert "--split-mode" in instance["args"] and instance["args"][instance["args"].index("--split-mode") + 1] == "tensor"
    assert host_vars["llama_engine_packs"][0]["url"].endswith("llama-upstream-nccl-02182fc-linux-x86_64-cuda12.6-sm70.tar.gz")
    # NCCL all-reduce: the driver role installs libnccl2 and verify loads it
    assert host_vars["nvidia_driver_nccl"] is True and host_vars["llama_verify_nccl"] is True
    assert [gpu["name"] for gpu in host_vars["nvidia_driver_gpus"]] == ["Tesla V100-SXM2-16GB"] * 2
    assert (host_vars["nvidia_driver_branch"], host_vars["nvidia_driver_allow_reboot"]) == (580, False)


def test_render_marks_an_offloading_service_for_mlock(tmp_path):
    from tests.unit.planner.helpers import SINGLE, profile

    catalog = _pinned(tmp_path, "qwen3.6-35b-a3b-iq4_xs")
    f = fleet(tmp_path, models=[{"id": "qwen3.6-35b-a3b-iq4_xs"}])
    box = f.box("box1")
    plan = plan_box(box, profile(SINGLE), catalog)
    paths = render_box(tmp_path / "inv", f, box, profile(SINGLE), plan)
    (instance,) = yaml.safe_load(next(p for p in paths if p.name == "box1.yml").read_text())["llama_service_instances"]
    assert instance["engine"] == "ik" and instance["mlock"] and instance["args"][-2:] == ["--no-mmap", "--mlock"]


def test_a_driver_mirror_carries_its_signing_key_or_an_explicit_trust(tmp_path):
    catalog = _pinned(tmp_path, "qwen3.6-27b-q4_k_m")
    base = {"engines": "https://127.0.0.1:1/engines", "models": "http://127.0.0.1:1",
            "drivers": "http://mirror.lan/cuda/debian12/x86_64/"}
    with pytest.raises(FleetError, match=r"mirror\.drivers_key .*drivers_trusted: true"):
        fleet(tmp_path, mirror=base)

    for extra, key, trusted in ((
            {"drivers_key": "http://mirror.lan/cuda/3bf863cc.pub",
             "drivers_key_fingerprint": "EB69 3B30 35CD 5710 E231  E123 A4B4 6996 3BF8 63CC"},
            "http://mirror.lan/cuda/3bf863cc.pub", False),
            ({"drivers_trusted": True}, "", True)):
        f = fleet(tmp_path, mirror=base | extra, models=[{"id": "qwen3.6-27b-q4_k_m"}], driver={"manage": False})
        box = f.box("box1")
        hv = render_host_vars(box, v100_profile(32768), plan_box(box, v100_profile(32768), catalog))
        assert hv["nvidia_driver_repo_url"] == base["drivers"]
        assert (hv["nvidia_driver_repo_key_url"], hv["nvidia_driver_repo_trusted"]) == (key, trusted)
        assert hv["nvidia_driver_repo_key_fingerprint"] == ("EB693B3035CD5710E231E123A4B469963BF863CC" if key else "")
        assert hv["nvidia_driver_manage"] is False
    with pytest.raises(FleetError, match=r"mirror\.drivers_key .*pin it with mirror\.drivers_key_fingerprint"):
        fleet(tmp_path, mirror=base | {"drivers_key": "http://mirror.lan/cuda/3bf863cc.pub"})


def test_a_box_without_models_renders_only_the_driver_and_drops_an_old_plan(tmp_path):
    catalog = _pinned(tmp_path, "qwen3.6-27b-q4_k_m")
    with_model = fleet(tmp_path, models=[{"id": "qwen3.6-27b-q4_k_m"}])
    box = with_model.box("box1")
    inventory = tmp_path / "inv"
    render_box(inventory, with_model, box, v100_profile(32768), plan_box(box, v100_profile(32768), catalog))
    assert (inventory / "plans" / "box1.json").is_file()

    bare = fleet(tmp_path)
    render_box(inventory, bare, bare.box("box1"), v100_profile(32768), None,
               plan_driver(bare.box("box1"), v100_profile(32768), catalog))
    assert not (inventory / "plans" / "box1.json").exists()
    hv = yaml.safe_load((inventory / "host_vars" / "box1.yml").read_text())
    assert hv["ansible_python_interpreter"] == "/usr/bin/python3"
    assert [gpu["name"] for gpu in hv["nvidia_driver_gpus"]] == ["Tesla V100-PCIE-16GB"]
    assert not any(key.startswith(("llama_", "gguf_")) for key in hv), hv
