"""Boxes that mix V100s with other NVIDIA cards: engine packs by CUDA architecture, mixing, the driver window.

The seed boxes: the 12-GPU operator's second box (4x RTX 3090 + 2x V100-PCIe, no NVLink) and a V100-SXM2
pair on NVLink beside an RTX 3090 with no link to them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import yaml

from controller.actions.fleetrun import check_selection
from controller.errors import CatalogError, PlanError
from controller.model import rules
from controller.model.catalog import Catalog, load_catalog
from controller.model.fleet import Box, WantedModel, parse_fleet
from controller.model.profile import Gpu, HardwareProfile
from controller.model.serveplan import ServePlan
from controller.stages.planner import plan_box, plan_models
from controller.stages.planner.sources import plan_driver
from controller.stages.probe.parse import parse_outputs
from controller.stages.render import host_vars
from tests.unit.clean_errors import assert_one_line_error
from tests.unit.planner.helpers import SINGLE, catalog, profile
from tests.unit.probe.helpers import machine, real_text

EPYC = "epyc-4x3090-2xv100-pcie"  # GPUs 0-3 RTX 3090 24 GB (8.6), 4-5 V100-PCIE 16 GB (7.0), no NVLink
REPO = Path(__file__).resolve().parents[3]
GEMMA = "gemma4-26b-a4b-qat-q4_0"  # ~13.4 GiB, upstream only (sliding window)
GATE = "qwen3-4b-instruct-2507-q8_0"
REVIEWER = "gemma4-31b-it-q8_0"  # dense, ~30.5 GiB: one 24 GB card does not hold it
QWEN = "qwen3.6-35b-a3b-iq4_xs"  # MoE on ik_llama.cpp, ~18.6 GB: more than a 16 GB V100


def _catalog(tmp_path: Path, engines: dict, name: str = "engines.yml") -> Catalog:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"engines": engines}))
    return load_catalog([path])


def _pack(archs, family: str = "upstream", slot: str = "upstream-sm86") -> dict:
    return {slot + "-02182fc": {"family": family, "commit": "02182fc", "cuda_archs": archs,
                                "packs": {"linux-x86_64": {"file": f"llama-{slot}-02182fc-linux-x86_64.tar.gz"}}}}


def _dual_plus_3090(real_fixtures: Path) -> HardwareProfile:
    outputs = machine("dual-v100-sxm2-plus-3090-linux")
    outputs["nvidia-smi.txt"] = real_text(real_fixtures, "smi-2xv100-sxm2-plus-3090-linux-580.txt")
    outputs["nvidia-smi-topo.txt"] = real_text(real_fixtures, "topo-2xv100-sxm2-nv6-plus-3090-ansi-escapes.txt")
    return parse_outputs(outputs)


def _plan(hardware: HardwareProfile, *wanted: str | WantedModel, cat: Catalog | None = None) -> ServePlan:
    models = [want if isinstance(want, WantedModel) else WantedModel(id=want) for want in wanted]
    return plan_models(models, hardware, cat or catalog())


def _assert_every_card_runs_its_engine(plan: ServePlan, hardware: HardwareProfile, cat: Catalog) -> None:
    archs = {gpu.index: gpu.arch for gpu in hardware.gpus}
    for service in plan.services:
        built = cat.engine(service.engine).cuda_archs
        for index in service.gpus:
            assert rules.build_runs_on(built, archs[index]), (service.engine, built, index, archs[index])
            if archs[index] == rules.VOLTA_ARCH:
                assert rules.VOLTA_ARCH in built  # a V100 is never given an engine without sm_70


# ---------------------------------------------------------------- facts and the catalog field


def test_a_build_runs_on_its_own_major_at_the_same_or_a_higher_minor():
    assert rules.build_runs_on([70], 70) and rules.build_runs_on([70], 75)
    assert not rules.build_runs_on([70], 86) and not rules.build_runs_on([86], 70)
    assert rules.build_runs_on([80], 86) and not rules.build_runs_on([86], 80)
    assert rules.build_runs_on([70, 86], 86) and not rules.build_runs_on([70, 86], None)
    assert (rules.cuda_arch("8.6"), rules.cuda_arch("12.0"), rules.cuda_arch("x"), rules.cuda_arch(None)) == (
        86, 120, None, None)
    assert rules.arch_label(86) == "sm_86 (Ampere)" and rules.arch_label(70) == "sm_70 (Volta)"


def test_the_builtin_packs_are_sm70_only_and_the_cpu_build_has_none():
    engines = catalog().engines
    assert {engine_id: engine.cuda_archs for engine_id, engine in engines.items()} == {
        "upstream-02182fc": [70], "upstream-nccl-02182fc": [70], "ik-022bd00a": [70], "cpu-0c1e570": []}


@pytest.mark.parametrize("archs, parsed", [("70;86", [70, 86]), ([86, 70, 86], [70, 86]), (86, [86]), ("80", [80])])
def test_a_pack_may_be_built_for_several_architectures(tmp_path, archs, parsed):
    assert _catalog(tmp_path, _pack(archs)).engine("upstream-sm86-02182fc").cuda_archs == parsed


def test_a_pack_without_cuda_archs_is_an_sm70_build(tmp_path):
    pack = _pack([86])
    del pack["upstream-sm86-02182fc"]["cuda_archs"]
    assert _catalog(tmp_path, pack).engine("upstream-sm86-02182fc").cuda_archs == [70]


@pytest.mark.parametrize("archs, words", [
    ("7.0", ["7.0 is not a CUDA architecture", "[70, 86]"]),
    ("sm_86", ["sm_86 is not a CUDA architecture"]),
    ("70-real;86-real", ["70-real is not a CUDA architecture"]),
    ([700], ["700 is not a CUDA architecture"]),
    ([True], ["True is not a CUDA architecture"]),
    ([], ["cuda_archs is empty"]),
])
def test_a_malformed_cuda_archs_is_refused_with_the_entry_and_an_example(tmp_path, archs, words):
    with pytest.raises(CatalogError) as caught:
        _catalog(tmp_path, _pack(archs))
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'engines.yml'}: entry engines.upstream-sm86-02182fc")
    assert all(word in message for word in words), message
    assert "\n" not in message


def test_a_cpu_build_with_cuda_archs_is_refused(tmp_path):
    pack = _pack([70])
    pack["upstream-sm86-02182fc"]["cpu_only"] = True
    with pytest.raises(CatalogError, match="a cpu_only build carries no CUDA code"):
        _catalog(tmp_path, pack)


# ---------------------------------------------------------------- the operator's second box


def test_epyc_3090s_stay_idle_with_the_reason_when_no_pack_is_built_for_sm86():
    hardware = profile(EPYC)
    plan = _plan(hardware, GEMMA, GATE)
    assert plan.fits and sorted(gpu for service in plan.services for gpu in service.gpus) == [4, 5]
    _assert_every_card_runs_its_engine(plan, hardware, catalog())
    idle = {gpu.index: gpu for gpu in plan.idle_gpus}
    assert sorted(idle) == [0, 1, 2, 3]
    assert all(idle[i].arch == 86 and "no engine pack of the catalog is built for sm_86 (Ampere)" in idle[i].reason
               and "sm_70 (Volta)" in idle[i].reason for i in range(4))
    (gemma,) = [service for service in plan.services if service.model == GEMMA]
    assert any(reason.startswith("cards: GPU 4 (Tesla V100-PCIE-16GB, sm_70 (Volta))") for reason in gemma.reasons)


def test_epyc_3090s_get_a_model_when_a_pack_supports_sm86(tmp_path):
    hardware = profile(EPYC)
    cat = _catalog(tmp_path, _pack("70;86"))
    plan = _plan(hardware, GEMMA, GATE, cat=cat)
    assert plan.fits
    on_3090 = [service for service in plan.services if set(service.gpus) <= {0, 1, 2, 3}]
    assert on_3090 and all(service.engine == "upstream-sm86-02182fc" for service in on_3090)
    _assert_every_card_runs_its_engine(plan, hardware, cat)
    assert all(any("NVIDIA GeForce RTX 3090, sm_86 (Ampere)" in reason and "cuda_archs: 70;86" in reason
                   for reason in service.reasons) for service in on_3090)
    idle = {gpu.index: gpu.reason for gpu in plan.idle_gpus}
    used = {gpu for service in plan.services for gpu in service.gpus}
    assert set(idle) == set(range(6)) - used and all(reason.startswith("free") for reason in idle.values())


def test_an_ik_model_uses_upstreams_sm86_build_on_a_3090_rather_than_offloading_on_a_v100(tmp_path):
    hardware = profile(EPYC)
    without = _plan(hardware, QWEN)  # ik is built for sm_70 only: experts offloaded on one V100
    assert without.services[0].gpus == [4] and without.services[0].cpu_offload
    cat = _catalog(tmp_path, _pack("70;86"))
    (service,) = _plan(hardware, QWEN, cat=cat).services
    assert service.gpus == [0] and not service.cpu_offload and service.engine == "upstream-sm86-02182fc"
    assert "would run on ik_llama.cpp, but no build of it runs on these cards" in service.reasons[0]


def test_v100s_are_never_given_a_pack_without_sm70(tmp_path):
    # Upstream's packs rebuilt for the 3090s only; ik stays sm_70.
    cat = _catalog(tmp_path, {**_pack([86], slot="upstream"), **_pack([86], slot="upstream-nccl")})
    assert cat.engine("upstream-02182fc").cuda_archs == [86]
    hardware = profile(EPYC)
    plan = _plan(hardware, GEMMA, GATE, QWEN, cat=cat)
    _assert_every_card_runs_its_engine(plan, hardware, cat)
    by_model = {service.model: service for service in plan.services}
    assert set(by_model[GEMMA].gpus) | set(by_model[GATE].gpus) <= {0, 1, 2, 3}
    single = _plan(profile(SINGLE), GEMMA, cat=cat)  # a V100 box: upstream models have no build for it
    assert not single.fits and single.services == []
    assert "no build of upstream llama.cpp in the engine catalog runs on this box's cards" in single.unplaced[0].reason
    assert "Tesla V100-SXM2-16GB, sm_70 (Volta)" in single.unplaced[0].reason


def _one_3090_two_v100s() -> HardwareProfile:
    hardware = profile(EPYC)
    return hardware.model_copy(update={"gpus": hardware.gpus[3:], "boards": [[3], [4], [5]]})


def test_mixing_kinds_of_card_is_refused_unless_the_fleet_allows_it(tmp_path):
    hardware = _one_3090_two_v100s()
    cat = _catalog(tmp_path, _pack("70;86"))
    refused = _plan(hardware, REVIEWER, cat=cat)
    assert not refused.fits
    assert "mix_cards: true on the wanted model lets it span the free cards" in refused.unplaced[0].reason
    assert "with a pack built for each kind" in refused.unplaced[0].reason
    allowed = _plan(hardware, WantedModel(id=REVIEWER, mix_cards=True), cat=cat)
    (service,) = allowed.services
    assert {hardware.gpus[0].index} < set(service.gpus) and len(service.gpus) >= 2  # the 3090 and a V100
    assert service.split_mode == "layer" and service.engine == "upstream-sm86-02182fc"
    assert any("mix_cards: true" in reason and "across boards, over PCIe" in reason for reason in service.reasons)
    assert any("sm_86 (Ampere)" in r and "sm_70 (Volta)" in r for r in service.reasons if r.startswith("cards:"))
    _assert_every_card_runs_its_engine(allowed, hardware, cat)


def test_a_board_of_two_kinds_is_not_shared_without_mix_cards(tmp_path):
    # As a probe would report an NVLink link between cards of two kinds: the board does not make them one kind.
    hardware = HardwareProfile(
        gpus=[Gpu(index=0, name="NVIDIA GeForce RTX 3090", memory_mib=24576, compute_capability="8.6"),
              Gpu(index=1, name="Tesla V100-SXM2-32GB", memory_mib=32768, compute_capability="7.0")],
        nvlink={"pairs": [(0, 1, 4)]}, boards=[[0, 1]])
    cat = _catalog(tmp_path, _pack("70;86"))
    refused = _plan(hardware, REVIEWER, cat=cat)
    assert refused.services == [] and "mix_cards: true" in refused.unplaced[0].reason
    (service,) = _plan(hardware, WantedModel(id=REVIEWER, mix_cards=True), cat=cat).services
    assert service.gpus == [0, 1] and service.engine == "upstream-sm86-02182fc"


def test_mixing_needs_one_pack_built_for_every_kind(tmp_path):
    # One pack per architecture: the 3090's and the V100's cannot serve one model together.
    cat = _catalog(tmp_path, _pack([86]))
    plan = _plan(_one_3090_two_v100s(), WantedModel(id=REVIEWER, mix_cards=True), cat=cat)
    assert not plan.fits


def test_dual_v100_beside_a_3090_keeps_the_nvlink_pair_and_idles_the_3090(real_fixtures, tmp_path):
    hardware = _dual_plus_3090(real_fixtures)
    assert [gpu.arch for gpu in hardware.gpus] == [86, 70, 70]
    plan = _plan(hardware, WantedModel(id=REVIEWER, mix_cards=True), GATE)
    reviewer = next(service for service in plan.services if service.model == REVIEWER)
    assert reviewer.gpus == [1, 2]  # the NVLink board first, even when mixing is allowed
    assert [gpu.index for gpu in plan.idle_gpus] == [0] and "sm_86" in plan.idle_gpus[0].reason
    cat = _catalog(tmp_path, _pack("70;86"))
    plan = _plan(hardware, REVIEWER, GATE, cat=cat)
    by_model = {service.model: service for service in plan.services}
    assert by_model[REVIEWER].gpus == [1, 2] and by_model[GATE].gpus == [0]
    assert by_model[GATE].engine == "upstream-sm86-02182fc" and plan.idle_gpus == []
    _assert_every_card_runs_its_engine(plan, hardware, cat)


# ---------------------------------------------------------------- a pack no card can run


def test_a_pinned_pack_whose_archs_match_no_card_is_refused(tmp_path):
    cat = _catalog(tmp_path, _pack([86]))
    with pytest.raises(PlanError) as caught:
        _plan(profile(SINGLE), WantedModel(id=GEMMA, engine="upstream-sm86-02182fc"), cat=cat)
    message = str(caught.value)
    assert "upstream-sm86-02182fc is built for sm_86 (Ampere) (cuda_archs: 86)" in message
    assert "GPU 0 Tesla V100-SXM2-16GB (sm_70 (Volta))" in message
    # On the mixed box the same pin serves on the 3090s only.
    plan = _plan(profile(EPYC), WantedModel(id=GEMMA, engine="upstream-sm86-02182fc"), cat=cat)
    assert plan.services[0].gpus[0] in (0, 1, 2, 3)


def test_the_cli_refuses_a_pack_no_card_can_run_in_one_line(tmp_path):
    builtin = catalog().model(GATE).model_dump(exclude={"id", "hub_url"})
    extra = tmp_path / "catalog.yml"
    extra.write_text(yaml.safe_dump({"engines": _pack([86]),
                                     "models": {"gate-on-3090": builtin | {"engine": "upstream-sm86-02182fc"}}}))
    saved = tmp_path / "single.json"
    saved.write_text(profile(SINGLE).model_dump_json())
    result = subprocess.run([sys.executable, "-m", "controller", "plan", "--profile", str(saved), "--model",
                             "gate-on-3090", "--catalog", str(extra)], capture_output=True, text=True, cwd=REPO,
                            timeout=60, check=False)
    assert_one_line_error(result, 4, "upstream-sm86-02182fc", "sm_86", "cuda_archs: 86", "Tesla V100-SXM2-16GB",
                          "sm_70")


def test_a_fleet_may_name_the_engine_and_let_a_model_mix_cards(tmp_path):
    fleet = parse_fleet({"boxes": {"b": {"address": "192.0.2.1", "models": [
        {"id": GEMMA, "engine": "upstream-sm86-02182fc", "mix_cards": True}]}}}, tmp_path / "fleet.yml")
    (want,) = fleet.box("b").models
    assert want.engine == "upstream-sm86-02182fc" and want.mix_cards
    with pytest.raises(CatalogError, match="unknown engine id 'upstream-sm86-02182fc'"):
        plan_box(fleet.box("b"), profile(EPYC), catalog())
    with pytest.raises(CatalogError, match="unknown engine id 'upstream-sm86-02182fc'; the catalog has: cpu-0c1e570"):
        check_selection(fleet, ["b"])  # before any connection to the box


# ---------------------------------------------------------------- the driver window over every card


def test_the_driver_window_covers_the_3090s_beside_the_v100s():
    driver = plan_driver(Box(name="b", address="192.0.2.1"), profile(EPYC), catalog())
    assert driver.installs and driver.branch == rules.DRIVER_DEFAULT_BRANCH
    (covered,) = [reason for reason in driver.reasons if reason.startswith("every card checked")]
    assert f"R{rules.DRIVER_DEFAULT_BRANCH} drives sm_86 (Ampere): GPUs 0,1,2,3, sm_70 (Volta): GPUs 4,5" in covered
    assert f"nothing newer than R{rules.DRIVER_BRANCHES[-1]}" in covered
    windows = plan_driver(Box(name="w", address="192.0.2.2", os="windows"), profile(EPYC), catalog())
    assert any(f"R{rules.DRIVER_BRANCHES[0]} drives sm_86" in reason for reason in windows.reasons)


def test_a_card_the_branch_cannot_drive_is_named_and_left_idle():
    hardware = HardwareProfile(gpus=[Gpu(index=0, name="Tesla K80", memory_mib=12288, compute_capability="3.7"),
                                     Gpu(index=1, name="Tesla V100-PCIE-16GB", memory_mib=16384)])
    driver = plan_driver(Box(name="b", address="192.0.2.1"), hardware, catalog())
    assert any(reason.startswith("GPU 0 Tesla K80: R580 cannot drive it (sm_37 (Kepler) is driven up to R470 only)")
               for reason in driver.reasons)
    assert [gpu.index for gpu in _plan(hardware, GATE).idle_gpus] == [0]


def test_a_box_with_only_newer_cards_is_not_bound_by_voltas_window():
    hardware = profile(EPYC)
    only_3090s = hardware.model_copy(update={"gpus": hardware.gpus[:4]})
    driver = plan_driver(Box(name="b", address="192.0.2.1"), only_3090s, catalog())
    assert not driver.installs
    assert driver.reasons == [f"no V100 among the probed GPUs: the driver role leaves the box alone (sm_86 (Ampere): "
                              f"GPUs 0,1,2,3); Volta's {rules.DRIVER_WINDOW} window does not bind it, so its owner may "
                              f"run any branch that drives these cards and the engine packs' CUDA builds"]
    assert rules.branch_problem(86, 595) is None and rules.branch_problem(70, 595) is not None
    assert rules.branch_problem(None, 580) is not None and rules.branch_problem(130, 580) is not None


# ---------------------------------------------------------------- the source build targets the plan's archs


def test_host_vars_carry_the_plans_architectures_to_the_source_build(tmp_path):
    sha = "ab" * 32
    pinned = {model_id: catalog().model(model_id).model_dump(exclude={"id", "hub_url"}) | {"sha256": sha}
              for model_id in (GEMMA, GATE)}
    path = tmp_path / "catalog.yml"
    path.write_text(yaml.safe_dump({"engines": _pack("70;86"), "models": pinned}))
    cat = load_catalog([path])
    fleet = parse_fleet({"boxes": {"b": {"address": "192.0.2.1", "models": [{"id": GEMMA}, {"id": GATE}],
                                         "mirror": {"engines": "https://192.0.2.9/engines",
                                                    "models": "https://192.0.2.9"}}}}, tmp_path / "fleet.yml")
    box, hardware = fleet.box("b"), profile(EPYC)
    plan = plan_box(box, hardware, cat)
    assert {engine.id: engine.cuda_archs for engine in plan.engines} == {"upstream-sm86-02182fc": [70, 86]}
    rendered = host_vars(box, hardware, plan)
    assert rendered["llama_engine_cuda_architectures"] == [70, 86]
    v100_only = plan_box(box, hardware.model_copy(update={"gpus": hardware.gpus[4:]}), catalog())
    assert {engine.cuda_archs[0] for engine in v100_only.engines} == {70}
    role_vars = yaml.safe_load((REPO / "ansible_collections/v100box/llm/roles/llama_engine/vars/main.yml").read_text())
    flags = [jinja2.Environment().from_string(flag).render(
        llama_engine_cuda_architectures=rendered["llama_engine_cuda_architectures"])
        for flag in role_vars["_llama_engine_cuda_flags"]]
    assert "-DCMAKE_CUDA_ARCHITECTURES=70-real;86-real" in flags
    defaults = yaml.safe_load((REPO / "ansible_collections/v100box/llm/roles/llama_engine/defaults/main.yml").read_text())
    assert jinja2.Environment().from_string(role_vars["_llama_engine_cuda_flags"][2]).render(
        **defaults) == "-DCMAKE_CUDA_ARCHITECTURES=70-real"


def test_a_cpu_box_serves_on_the_cpu_build_the_fleet_names():
    cat = catalog()
    builtin = cat.engine("cpu-0c1e570").model_dump(exclude={"id"})
    newer = Catalog(models=cat.models, engines={**cat.engines, "cpu-1234567": cat.engine("cpu-0c1e570").model_copy(
        update={"id": "cpu-1234567", "commit": "1234567"}), "cpu-0000001": cat.engine("cpu-0c1e570").model_copy(
        update={"id": "cpu-0000001", "commit": "0000001"})})
    assert builtin["cpu_only"]
    qwen = "qwen3-4b-instruct-2507-q8_0"
    cpu_box = HardwareProfile(memory_mib=65536)
    (chosen,) = _plan(cpu_box, WantedModel(id=qwen, engine="cpu-1234567"), cat=newer).services
    assert chosen.engine == "cpu-1234567"
    (first,) = _plan(cpu_box, qwen, cat=newer).services  # nothing named: the first CPU build, as before
    assert first.engine == "cpu-0000001"
