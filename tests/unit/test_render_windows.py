"""A Windows box renders the win_* roles' inputs: zip packs, WinSW, the pinned driver installer."""

import pytest
import yaml

from controller.errors import CatalogError, FleetError
from controller.model.catalog import load_catalog
from controller.model.fleet import parse_fleet
from controller.model.profile import OsInfo
from controller.reports.provision import MCDM_NOTE, build_report
from controller.stages.planner import plan_box
from controller.stages.render import render_box
from tests.unit.planner.helpers import DUAL, SINGLE, profile

SHA = "ab" * 32
WINSW_SHA = "12" * 32
DRIVER_SHA = "34" * 32


def _catalog(tmp_path, *, pin_downloads=True):
    builtin = load_catalog()
    data = {"models": {model_id: builtin.model(model_id).model_dump(exclude={"id", "hub_url"}) | {"sha256": SHA}
                       for model_id in ("qwen3.6-27b-q4_k_m", "gemma4-26b-a4b-qat-q4_0")}}
    if pin_downloads:  # a pin may name only the sha256; the rest comes from the built-in entry
        data["downloads"] = {"winsw-2.12.0": {"sha256": WINSW_SHA}, "nvidia-windows-573.96": {"sha256": DRIVER_SHA}}
    path = tmp_path / "pins.yml"
    path.write_text(yaml.safe_dump(data))
    return load_catalog([path])


def _fleet(tmp_path, **box):
    body = {"address": "192.0.2.7", "os": "windows", "transport": "winrm",
            "mirror": {"engines": "https://127.0.0.1:1/engines", "models": "http://127.0.0.1:1"}, **box}
    return parse_fleet({"boxes": {"win1": body}}, tmp_path / "fleet.yml")


def _render(tmp_path, fleet, machine, catalog):
    box = fleet.box("win1")
    hw = profile(machine)
    plan = plan_box(box, hw, catalog)
    paths = render_box(tmp_path / "inv", fleet, box, hw, plan)
    return plan, yaml.safe_load(next(p for p in paths if p.name == "win1.yml").read_text())


def test_dual_card_windows_box_gets_nccl_pack_winsw_and_driver(tmp_path):
    catalog = _catalog(tmp_path)
    plan, hv = _render(tmp_path, _fleet(tmp_path, models=[{"id": "qwen3.6-27b-q4_k_m", "agents": 4}]), DUAL, catalog)
    assert "ansible_python_interpreter" not in hv and "nvidia_driver_branch" not in hv, "Linux-only inputs leaked"
    (pack,) = hv["llama_engine_packs"]
    assert pack["url"].endswith("-windows-x86_64-cuda12.8-sm70.zip") and pack["nccl"] is True
    (instance,) = hv["llama_service_instances"]
    assert instance["env"]["GGML_CUDA_ALLREDUCE"] == "nccl" and hv["llama_verify_nccl"] is True
    assert instance["version"] == "02182fc" and instance["engine"] == "upstream-nccl"
    model = instance["args"][instance["args"].index("--model") + 1]
    assert model == "C:\\llama\\models\\" + catalog.model("qwen3.6-27b-q4_k_m").file
    assert hv["llama_service_winsw"] == {"version": "2.12.0", "url": "https://127.0.0.1:1/engines/WinSW-x64.exe",
                                             "sha256": WINSW_SHA}
    assert hv["nvidia_driver_installer"]["version"] == "573.96" and hv["nvidia_driver_installer"]["sha256"] == DRIVER_SHA
    assert hv["nvidia_driver_installer"]["url"].endswith("/573.96/573.96-data-center-tesla-desktop-win10-win11-64bit-dch-"
                                                "international.exe")
    assert hv["nvidia_driver_mode"] == "tcc" and hv["nvidia_driver_allow_reboot"] is False
    assert [gpu["driver_model"] for gpu in hv["nvidia_driver_gpus"]] == ["TCC", "TCC"]
    assert plan.services[0].engine == "upstream-nccl-02182fc"


def test_templates_and_forward_slash_model_dirs_become_windows_paths(tmp_path):
    catalog = _catalog(tmp_path)
    fleet = _fleet(tmp_path, model_dir="D:/llm/models", models=[{"id": "gemma4-26b-a4b-qat-q4_0"}],
                   mirror={"engines": "https://127.0.0.1:1/e", "models": "http://127.0.0.1:1", "drivers": "http://m/d"})
    _, hv = _render(tmp_path, fleet, SINGLE, catalog)
    (instance,) = hv["llama_service_instances"]
    args = instance["args"]
    assert args[args.index("--chat-template-file") + 1] == "C:\\llama\\templates\\gemma4-nothink.jinja"
    assert args[args.index("--model") + 1].startswith("D:\\llm\\models\\")
    assert hv["gguf_model_dir"] == "D:\\llm\\models"
    assert hv["nvidia_driver_installer"]["url"] == "http://m/d/573.96-data-center-tesla-desktop-win10-win11-64bit-dch-" \
                                          "international.exe"


def test_unpinned_winsw_or_driver_is_refused_with_the_fix(tmp_path):
    fleet = _fleet(tmp_path, models=[{"id": "gemma4-26b-a4b-qat-q4_0"}])
    with pytest.raises(CatalogError, match=r"no sha256 pinned .*Get-FileHash.*\n  downloads:\n    nvidia-windows"):
        _render(tmp_path, fleet, SINGLE, _catalog(tmp_path, pin_downloads=False))
    assert not (tmp_path / "inv" / "host_vars").exists()


def test_wsl2_box_asks_for_mcdm_and_the_report_says_it_is_slower(tmp_path):
    catalog = _catalog(tmp_path)
    fleet = _fleet(tmp_path, models=[{"id": "gemma4-26b-a4b-qat-q4_0"}], driver={"wsl2": True})
    plan, hv = _render(tmp_path, fleet, SINGLE, catalog)
    assert hv["nvidia_driver_mode"] == "mcdm"
    report = build_report(fleet.box("win1"), profile(SINGLE), plan, None, {}, 0.1)
    assert MCDM_NOTE in report["driver"]["notes"]


def test_windows_box_without_v100_is_refused_for_want_of_a_windows_cpu_build(tmp_path):
    fleet = _fleet(tmp_path, models=[{"id": "gemma4-26b-a4b-qat-q4_0"}])
    cpu_box = profile(SINGLE).model_copy(update={"gpus": [], "os": OsInfo(family="windows")})
    box = fleet.box("win1")
    catalog = _catalog(tmp_path, pin_downloads=False)
    catalog.downloads["winsw-2.12.0"].sha256 = WINSW_SHA
    plan = plan_box(box, cpu_box, catalog)
    assert plan.services, plan.unplaced
    with pytest.raises(CatalogError, match="no release pack for windows-x86_64"):  # the CPU build is Linux-only
        render_box(tmp_path / "inv", fleet, box, cpu_box, plan)


@pytest.mark.parametrize("path", ["\\\\wsl$\\Ubuntu\\models", "\\\\nas\\share\\models", "//nas/models"])
def test_network_model_dirs_are_refused(tmp_path, path):
    with pytest.raises(FleetError, match="network path"):
        _fleet(tmp_path, model_dir=path)


def test_relative_windows_model_dir_is_refused(tmp_path):
    with pytest.raises(FleetError, match="local drive path"):
        _fleet(tmp_path, model_dir="models")


def test_an_exposed_windows_box_opens_its_firewall_only_to_the_fleets_networks(tmp_path):
    catalog = _catalog(tmp_path)
    fleet = _fleet(tmp_path, models=[{"id": "gemma4-26b-a4b-qat-q4_0"}], bind="0.0.0.0",
                   allow_from=["192.168.1.0/24", "10.0.0.7"], api_key={"env": "WIN1_API_KEY"})
    _, hv = _render(tmp_path, fleet, SINGLE, catalog)
    assert hv["llama_service_bind"] == "0.0.0.0"
    assert hv["llama_service_allow_from"] == ["192.168.1.0/24", "10.0.0.7/32"]
    assert "llama_service_api_key" not in hv  # a secret: passed to Ansible at run time, never written here
