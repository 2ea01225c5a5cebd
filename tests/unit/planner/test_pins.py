"""Placement the operator states: models pinned to cards or boards, spilling to host RAM or across boards, and a
mixed box whose every card is used or has a true reason (issue 24), from the seeds' recorded probes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from controller.model.catalog import Catalog, load_catalog
from controller.model.fleet import WantedModel, parse_fleet
from controller.model.serveplan import ServePlan
from tests.cli import invoke, run_controller
from tests.unit.clean_errors import assert_one_line_error
from tests.unit.planner.helpers import TWELVE, plan, profile, said

EPYC = "epyc-4x3090-2xv100-pcie"  # GPUs 0-3 RTX 3090 24 GB (sm_86), 4-5 V100-PCIE 16 GB, no NVLink
Q35 = "qwen3.6-35b-a3b-q6_k"  # the workhorse: Board A
BIG122 = "qwen3.5-122b-a10b-q8_0"  # heavy reasoning: Board B
GATE = "qwen3-4b-instruct-2507-q8_0"  # the gate on the {0,1} pair
REVIEWER = "gemma4-31b-it-q8_0"  # the adversarial reviewer on the mixed {2,3} pair
GEMMA = "gemma4-26b-a4b-qat-q4_0"
IQ4 = "qwen3.6-35b-a3b-iq4_xs"
W = WantedModel


def _sm86(tmp_path: Path) -> Path:
    path = tmp_path / "engines-sm86.yml"
    path.write_text(yaml.safe_dump({"engines": {"upstream-sm86-02182fc": {
        "family": "upstream", "commit": "02182fc", "cuda_archs": "70;86",
        "packs": {"linux-x86_64": {"file": "llama-upstream-sm86-02182fc-linux-x86_64.tar.gz"}}}}}))
    return path


def _cited(text: str) -> set[int]:
    """The cards a reason names: ``GPU 4``, ``GPUs 0,1``."""
    return {int(i) for group in re.findall(r"GPUs? (\d+(?:,\d+)*)", text) for i in group.split(",")}


def _every_card_accounted_for(result: ServePlan, machine: str) -> None:
    """Every card is used or has a reason; a service's reasons name only cards the plan uses."""
    used = {gpu for service in result.services for gpu in service.gpus}
    idle = {gpu.index: gpu.reason for gpu in result.idle_gpus}
    assert used | set(idle) == {gpu.index for gpu in profile(machine).gpus} and not used & set(idle)
    assert all(reason for reason in idle.values())
    for service in result.services:
        assert service.models == [service.model]
        for reason in service.reasons:
            assert _cited(reason) <= used, (service.model, reason)
        assert any(reason.startswith("cards: ") and _cited(reason) == set(service.gpus) for reason in service.reasons)


# ---------------------------------------------------------------- the seed's pipeline, board by board


def test_the_seeds_pipeline_pinned_board_by_board_plans_as_stated():
    result = plan(TWELVE, W(id=Q35, board=2), W(id=BIG122, board=3), W(id=GATE, gpus=[0, 1]),
                  W(id=REVIEWER, gpus=[2, 3]))
    assert result.fits and [s.model for s in result.services] == [Q35, BIG122, GATE, REVIEWER]
    by_model = {s.model: s for s in result.services}
    assert set(by_model[Q35].gpus) <= {4, 5, 8, 9}
    assert by_model[BIG122].gpus == [6, 7, 10, 11]  # the whole board B: its experts spill the rest to host RAM
    assert by_model[GATE].gpus == [0, 1] and by_model[REVIEWER].gpus == [2, 3]
    assert said(by_model[Q35], "pinned by the fleet to board 2", "never another board")
    assert said(by_model[GATE], "pinned by the fleet to gpus [0, 1]: these cards and no others")
    assert said(by_model[GATE], "split across the 2 cards it is pinned to")
    assert not said(by_model[GATE], "does not fit one card")  # it does: the fleet asked for the pair
    _every_card_accounted_for(result, TWELVE)


def test_unpinned_the_planner_says_which_spill_it_chose_and_the_idle_board_says_what_would_use_it():
    # The review's case: the 122B spilled experts to host RAM while a whole board stayed idle, silently.
    result = plan(TWELVE, BIG122, IQ4, GEMMA)
    big = next(s for s in result.services if s.model == BIG122)
    assert big.cpu_offload and len(big.gpus) == 4
    # The catalog names upstream for it; ik_llama.cpp is chosen for its offload, and the reason says so.
    assert big.engine.startswith("ik-") and "the catalog entry of qwen3.5-122b-a10b-q8_0 names upstream" in big.reasons[0]
    assert said(big, "experts in host RAM inside one board rather than the whole model across boards",
                "the fleet chooses with spill: host or spill: boards", "spill: boards would hold", "at 131072 tokens")
    idle = {gpu.index: gpu.reason for gpu in result.idle_gpus}
    assert any("spill: boards on it would use this card" in reason for reason in idle.values())
    _every_card_accounted_for(result, TWELVE)
    spanned = plan(TWELVE, W(id=BIG122, spill="boards"), IQ4, GEMMA)
    big = next(s for s in spanned.services if s.model == BIG122)
    assert not big.cpu_offload and big.split_mode == "layer" and len(big.gpus) > 4
    boards = [set(board) for board in profile(TWELVE).boards]
    assert sum(1 for board in boards if board & set(big.gpus)) == 2  # the fewest boards
    assert said(big, "the fleet asks for it (spill: boards)", "across the fewest boards, 2")
    assert said(big, "cross-board cost", "3072 values", "PCIe")
    _every_card_accounted_for(spanned, TWELVE)


def test_a_pinned_model_is_never_moved_and_its_refusal_has_the_numbers():
    small = plan(TWELVE, W(id=REVIEWER, gpus=[3]))  # 31 GiB dense on the 16 GB card
    (refused,) = small.unplaced
    assert not small.services and "pinned to gpus [3] and is never placed elsewhere" in refused.reason
    assert "on GPU 3 (16384 MiB) it needs" in refused.reason and "MiB usable" in refused.reason
    assert "mix_cards" not in refused.reason  # no hint to go elsewhere
    taken = plan(TWELVE, W(id=REVIEWER, gpus=[0, 1]), W(id=GATE, gpus=[1]))
    assert [s.model for s in taken.services] == [REVIEWER]
    assert "GPU 1 to gemma4-31b-it-q8_0" in taken.unplaced[0].reason
    beyond = plan(TWELVE, W(id=GATE, board=7)).unplaced[0].reason
    assert "this box has 4 boards" in beyond and "0:{0,1} 1:{2,3} 2:{4,5,8,9} 3:{6,7,10,11}" in beyond
    missing = plan(TWELVE, W(id=GATE, gpus=[12])).unplaced[0].reason
    assert "this box has no GPU 12" in missing and "fix gpus" in missing
    unbuilt = plan(EPYC, W(id=GATE, board=0)).unplaced[0].reason  # a 3090, and no pack built for sm_86
    assert "no build of upstream llama.cpp in the engine catalog runs on the cards it is pinned to (board 0)" in unbuilt


def test_pinned_cards_on_two_boards_are_split_by_layer_as_the_fleet_says():
    (service,) = plan(TWELVE, W(id=REVIEWER, gpus=[1, 2])).services
    assert service.gpus == [1, 2] and service.split_mode == "layer"
    assert said(service, "split across the 2 cards it is pinned to, which are not one NVLink board")


def test_a_pinned_model_is_placed_before_a_larger_unpinned_one():
    result = plan(TWELVE, BIG122, W(id=GATE, board=3))
    gate = next(s for s in result.services if s.model == GATE)
    big = next(s for s in result.services if s.model == BIG122)
    assert set(gate.gpus) <= {6, 7, 10, 11} and not set(big.gpus) & set(gate.gpus)


@pytest.mark.parametrize("entry,message", [
    ({"gpus": [0, 1], "board": 1}, "give gpus or board, not both"),
    ({"gpus": [0, 0]}, "GPU 0 is listed twice"),
    ({"gpus": []}, "at least 1 item"),
    ({"board": 1, "spill": "boards"}, "spill: boards lets the planner split the model across boards, but it is pinned"),
    ({"spill": "pcie"}, "'host' or 'boards'"),
])
def test_bad_pins_are_refused_with_what_to_fix(entry, message):
    fleet = {"boxes": {"box3": {"address": "127.0.0.1", "models": [{"id": GATE, **entry}]}}}
    with pytest.raises(Exception) as caught:
        parse_fleet(fleet, Path("fleet.yml"))
    assert message in str(caught.value)


# ---------------------------------------------------------------- the mixed box


def test_every_card_of_the_epyc_box_is_used_or_has_a_reason(tmp_path):
    cat: Catalog = load_catalog([_sm86(tmp_path)])
    for models in ((GEMMA, GATE), (IQ4, GEMMA, GATE, REVIEWER), (BIG122,), (BIG122, GEMMA)):
        _every_card_accounted_for(plan(EPYC, *models, cat=cat), EPYC)
    # The review's case: the 122B offloaded on a V100 (ik's only build) citing a 3090 it then did not use.
    result = plan(EPYC, BIG122, GEMMA, cat=cat)
    big = next(s for s in result.services if s.model == BIG122)
    assert big.cpu_offload and big.gpus == [0] and big.engine == "upstream-sm86-02182fc"
    assert "--n-cpu-moe" in big.args and said(big, "these cards (24576 MiB) keep more of the model on the GPU",
                                              "(16384 MiB)")
    assert not said(big, "the largest, GPU")
    without = plan(EPYC, BIG122, GEMMA)  # no sm_86 pack: every 3090 idle, and says why
    assert {gpu.index for gpu in without.idle_gpus} >= {0, 1, 2, 3}
    _every_card_accounted_for(without, EPYC)


# ---------------------------------------------------------------- planning on paper


def _fleet(tmp_path: Path, models: list[dict], **box) -> Path:
    path = tmp_path / "fleet.yml"
    path.write_text(yaml.safe_dump({"boxes": {"box12": {"address": "127.0.0.1", "models": models, **box}}}))
    return path


def _profile(tmp_path: Path, machine: str) -> Path:
    path = tmp_path / f"{machine}.json"
    path.write_text(json.dumps(profile(machine).model_dump(mode="json")))
    return path


def test_plan_on_paper_takes_the_fleets_pins_on_a_saved_profile_without_connecting(tmp_path):
    # 127.0.0.1 has no SSH server here: the plan never connects.
    fleet = _fleet(tmp_path, [{"id": Q35, "board": 2}, {"id": BIG122, "board": 3},
                              {"id": GATE, "gpus": [0, 1], "agents": ["claude-code"]},
                              {"id": REVIEWER, "gpus": [2, 3], "draft": "auto"}], base_port=9101)
    result = invoke("plan", "box12", "--fleet", str(fleet), "--profile", str(_profile(tmp_path, TWELVE)), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    by_model = {service["model"]: service for service in data["services"]}
    assert sorted(by_model) == sorted([Q35, BIG122, GATE, REVIEWER])
    assert all(service["models"] == [service["model"]] for service in data["services"])
    assert by_model[BIG122]["gpus"] == [6, 7, 10, 11] and by_model[GATE]["gpus"] == [0, 1]
    assert by_model[GATE]["ctx"] >= 32768 and by_model[GATE]["port"] == 9103
    assert {gpu["index"] for gpu in data["idle_gpus"]} | {g for s in data["services"] for g in s["gpus"]} == \
        set(range(12))
    assert all(gpu["reason"] for gpu in data["idle_gpus"])
    text = invoke("plan", "box12", "--fleet", str(fleet), "--profile", str(_profile(tmp_path, TWELVE)))
    assert text.exit_code == 0 and "pinned by the fleet to board 3" in text.stdout and "idle: GPU" in text.stdout


def test_plan_on_paper_with_a_pin_that_does_not_fit_prints_the_plan_then_exits_4(tmp_path):
    fleet = _fleet(tmp_path, [{"id": REVIEWER, "gpus": [3]}])
    result = run_controller("plan", "box12", "--fleet", str(fleet), "--profile", str(_profile(tmp_path, TWELVE)),
                            timeout=120)
    assert "not placed: gemma4-31b-it-q8_0" in result.stdout
    assert_one_line_error(result, 4, "pinned to gpus [3] and is never placed elsewhere")


def test_plan_on_paper_refuses_a_profile_that_is_not_one(tmp_path):
    fleet = _fleet(tmp_path, [{"id": GATE}])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gpus": [{"index": 0}]}))
    result = invoke("plan", "box12", "--fleet", str(fleet), "--profile", str(bad))
    assert result.exit_code == 2 and "not a `controller probe --json` profile: gpus.0.name" in result.output
