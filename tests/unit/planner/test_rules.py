"""The planner's decision rules, each on the seeds' machines (real probe fixtures) or a minimal profile."""

from __future__ import annotations

import pytest
import yaml

from controller.model.catalog import load_catalog
from controller.model.fleet import WantedModel
from controller.model.profile import Cpu, Gpu, HardwareProfile, NvLink, OsInfo
from controller.stages.planner.fit import FIT_MARGIN_MIB, RESIDENT_MARGIN_MIB
from tests.unit.planner.helpers import CPU_ONLY, DUAL, SINGLE, TWELVE, catalog, flag, only, plan, profile, said

GEMMA, IQ4, Q6K = "gemma4-26b-a4b-qat-q4_0", "qwen3.6-35b-a3b-iq4_xs", "qwen3.6-35b-a3b-q6_k"
DENSE27, BIG122 = "qwen3.6-27b-q4_k_m", "qwen3.5-122b-a10b-q8_0"
GATE, REVIEWER = "qwen3-4b-instruct-2507-q8_0", "gemma4-31b-it-q8_0"
WSL = "wsl2-v100-16g"  # one V100 16 GB with 12 physical cores, like the kit's own box
CACHE_RANK = {"f16": 0, "q8_0": 1, "q4_0": 2}


def _v100s(*memory: int, boards: list[list[int]] | None = None, links=(), cores: int = 16,
           ram: int = 262144) -> HardwareProfile:
    return HardwareProfile(
        gpus=[Gpu(index=i, name="Tesla V100-SXM2-32GB" if m > 20000 else "Tesla V100-SXM2-16GB", memory_mib=m)
              for i, m in enumerate(memory)],
        nvlink=NvLink(pairs=list(links)), boards=boards or [[i] for i in range(len(memory))],
        cpu=Cpu(cores=cores, threads=2 * cores), memory_mib=ram, os=OsInfo(family="linux"))


# ---------------------------------------------------------------- the kit's settings are the floor


def test_gemma_on_one_v100_meets_the_kit_settings_or_better():
    """Kit: -ngl 99 -fa on -b 2048 -ub 1024 -ctk q8_0 -ctv q8_0 -c 32768 -t 6 --parallel 1 --metrics."""
    service = only(plan(WSL, GEMMA))
    assert service.engine == "upstream-02182fc" and service.gpus == [0] and not service.cpu_offload
    assert service.n_gpu_layers >= 99 and flag(service, "--flash-attn") == "on" and "--metrics" in service.args
    assert (service.batch, service.ubatch, service.threads, service.parallel) == (2048, 1024, 6, 1)
    assert service.ctx >= 32768 and CACHE_RANK[service.cache_type_k] <= CACHE_RANK["q8_0"]
    assert service.cache_type_k == service.cache_type_v
    assert service.memory.per_device_mib["cuda0"] <= 16384 - RESIDENT_MARGIN_MIB
    assert said(service, "context", str(service.ctx)) and said(service, "fits one card")


def test_qwen_iq4_on_one_v100_meets_the_kit_settings_or_better():
    """Kit: -ngl 99 -fa on -b 2048 -ub 2048 --fit --fit-margin 1664 -ctk/-ctv q8_0 -cram 16384
    --spec-type mtp:n_max=3,p_min=0.75 -c 131072 --mlock -t 12 --parallel 1 (on a 12-core box)."""
    service = only(plan(WSL, IQ4))
    assert service.engine == "ik-022bd00a" and service.cpu_offload and service.gpus == [0]
    assert flag(service, "--fit-margin") == str(FIT_MARGIN_MIB) and "--fit" in service.args
    assert (service.batch, service.ubatch, service.threads, service.parallel) == (2048, 2048, 12, 1)
    assert service.ctx == 131072 and service.cache_type_k == "q8_0" and service.cache_type_v == "q8_0"
    assert flag(service, "--spec-type") == "mtp:n_max=3,p_min=0.75" == service.spec_decoding
    assert flag(service, "-cram") == "16384" and "--mlock" in service.args and "--no-mmap" in service.args
    assert service.n_gpu_layers >= 99 and flag(service, "--flash-attn") == "on"
    assert said(service, "--fit-margin 1664") and said(service, "experts")


# ---------------------------------------------------------------- a single V100 16 GB with each seed model


def test_single_v100_plans_each_seed_model_or_says_why_not():
    single = profile(SINGLE)  # 6 physical cores, 31 GiB of RAM
    gemma = only(plan(single, GEMMA))
    assert gemma.threads == 3 and said(gemma, "half the 6 physical cores")  # resident: 6 or half the cores
    for model in (IQ4, Q6K):
        service = only(plan(single, model))
        assert service.cpu_offload and service.engine.startswith("ik-") and service.threads == 6  # all cores
        assert service.memory.per_device_mib["cuda0"] <= 16384 - FIT_MARGIN_MIB
    gate = only(plan(single, GATE))
    assert not gate.cpu_offload and gate.gpus == [0] and gate.template is None and "--jinja" in gate.args
    dense = plan(single, DENSE27)
    assert not dense.fits and dense.services == []
    reason = dense.unplaced[0].reason
    assert "15468 MiB weights" in reason and "16384 MiB" in reason and "largest context that would fit" in reason
    assert "dense" in reason  # no expert offload for a dense model
    big = plan(single, BIG122)
    assert not big.fits and "host RAM" in big.unplaced[0].reason and "32011 MiB" in big.unplaced[0].reason


def test_a_model_bigger_than_every_board_is_unplaced_with_the_numbers():
    result = plan(SINGLE, REVIEWER)
    assert not result.fits and result.services == []
    assert result.unplaced[0].model == REVIEWER
    assert "31226 MiB weights" in result.unplaced[0].reason and "not even the weights fit" in result.unplaced[0].reason


def test_a_context_that_does_not_fit_is_refused_with_the_largest_that_would():
    result = plan(SINGLE, DENSE27, ctx=16384)
    assert not result.fits
    reason = result.unplaced[0].reason
    assert "at 16384 tokens" in reason and "the largest context that would fit is" in reason
    largest = int(reason.split("the largest context that would fit is ")[1].split()[0])
    assert 0 < largest < 16384


def test_an_asked_context_is_served_exactly_with_the_best_cache_type_that_fits_it():
    service = only(plan(SINGLE, GEMMA, ctx=32768))
    assert service.ctx == 32768 and service.cache_type_k == "f16"  # f16 reaches 32768 on one card
    chosen = only(plan(SINGLE, GEMMA))
    assert chosen.ctx > 32768 and chosen.ctx % 4096 == 0  # unasked: the largest that fits, rounded
    assert chosen.cache_type_k == "q8_0"  # context first: q8_0 reaches further than f16


# ---------------------------------------------------------------- a dual NVLink board


def test_dual_board_serves_the_q6k_35b_from_both_cards_with_layer_split_for_agents():
    service = only(plan(DUAL, Q6K, agents=4))
    assert service.gpus == [0, 1] and service.split_mode == "layer" and not service.cpu_offload
    assert flag(service, "--split-mode") == "layer" and flag(service, "--tensor-split")
    assert service.engine == "ik-022bd00a" and service.spec_decoding == "mtp:n_max=3,p_min=0.75"
    assert service.parallel == 4 and service.kv_unified and "--cont-batching" in service.args
    assert "--kv-unified" not in service.args  # ik_llama.cpp has no such flag: its cache is always shared
    cards = {gpu.index: gpu.uuid for gpu in profile(DUAL).gpus}
    assert "GGML_CUDA_ALLREDUCE" not in service.env  # the cards named by UUID, in the split's order
    assert service.env == {"CUDA_VISIBLE_DEVICES": f"{cards[0]},{cards[1]}"}
    assert service.ctx >= 32768 and service.threads == 6
    assert said(service, "layer split", "MoE") and said(service, "NVLink x2")
    assert all(mib <= 16384 - RESIDENT_MARGIN_MIB for device, mib in service.memory.per_device_mib.items()
               if device.startswith("cuda"))


def test_dual_board_serves_the_27b_dense_with_tensor_split_and_nccl():
    service = only(plan(DUAL, DENSE27, agents=4))
    assert service.gpus == [0, 1] and service.split_mode == "tensor" and flag(service, "--split-mode") == "tensor"
    assert service.engine == "upstream-nccl-02182fc" and service.env["GGML_CUDA_ALLREDUCE"] == "nccl"
    assert "--kv-unified" in service.args and flag(service, "--parallel") == "4" and service.kv_unified
    assert said(service, "tensor split", "dense") and said(service, "NCCL")
    assert service.spec_decoding is None


def test_never_split_a_model_that_fits_one_card():
    service = only(plan(DUAL, GEMMA))
    assert service.gpus == [0] and service.split_mode == "none" and "--split-mode" not in service.args
    iq4 = only(plan(DUAL, IQ4))  # on two cards it is all in VRAM: better than expert offload on one
    assert iq4.gpus == [0, 1] and not iq4.cpu_offload


def test_row_split_is_never_planned():
    for machine, model in ((DUAL, Q6K), (DUAL, DENSE27), (TWELVE, BIG122)):
        for service in plan(machine, model).services:
            assert service.split_mode != "row" and flag(service, "--split-mode") in (None, "layer", "tensor")


# ---------------------------------------------------------------- the 12-GPU box


@pytest.fixture(scope="module")
def twelve():
    return plan(TWELVE, Q6K, BIG122, GATE, REVIEWER)


def test_twelve_gpu_box_pins_every_model_inside_one_board_without_overlap(twelve):
    assert twelve.fits and [s.model for s in twelve.services] == [Q6K, BIG122, GATE, REVIEWER]
    boards = [set(board) for board in profile(TWELVE).boards]
    used: set[int] = set()
    for service in twelve.services:
        assert any(set(service.gpus) <= board for board in boards), service.gpus
        assert not used & set(service.gpus)
        used |= set(service.gpus)
        # Named by UUID: 16 GB and 32 GB cards, which CUDA's own order would number otherwise than nvidia-smi.
        cards = {gpu.index: gpu.uuid for gpu in profile(TWELVE).gpus}
        assert service.env["CUDA_VISIBLE_DEVICES"] == ",".join(cards[index] for index in service.gpus)
        assert "CUDA_DEVICE_ORDER" not in service.env
    assert len({s.port for s in twelve.services}) == 4 and [s.port for s in twelve.services] == [8001, 8002, 8003, 8004]
    by_model = {s.model: s for s in twelve.services}
    assert sorted(by_model[BIG122].gpus) in ([4, 5, 8, 9], [6, 7, 10, 11])
    assert by_model[REVIEWER].gpus == [2, 3] and by_model[REVIEWER].split_mode == "tensor"  # the mixed NV6 pair
    assert len(by_model[Q6K].gpus) == 1 and len(by_model[GATE].gpus) == 1  # each fits one 32 GB card
    assert {by_model[Q6K].gpus[0], by_model[GATE].gpus[0]} == {0, 1}  # a pair's cards before a board's
    total_ram = sum(s.memory.per_device_mib["cpu"] for s in twelve.services)
    assert total_ram < profile(TWELVE).memory_mib


def test_twelve_gpu_box_reviewer_is_split_by_the_cards_memory(twelve):
    reviewer = next(s for s in twelve.services if s.model == REVIEWER)
    big, small = (float(x) for x in flag(reviewer, "--tensor-split").split(","))
    assert big > small  # the 32 GB card takes the larger share
    assert reviewer.memory.per_device_mib["cuda3"] <= 16384 - RESIDENT_MARGIN_MIB
    assert reviewer.engine.startswith("upstream")  # sliding-window model


def test_122b_on_a_board_with_its_asked_context_stays_in_vram():
    service = only(plan(TWELVE, BIG122, ctx=16384))
    assert len(service.gpus) == 4 and service.split_mode == "layer" and not service.cpu_offload
    counts = [float(x) for x in flag(service, "--tensor-split").split(",")]
    assert sum(counts) == 49  # whole layer slots: 48 blocks and the output layer


def test_122b_that_no_board_holds_with_enough_context_offloads_experts_inside_one_board(twelve):
    service = next(s for s in twelve.services if s.model == BIG122)
    assert service.cpu_offload and service.engine.startswith("ik-") and service.ubatch == 2048
    assert service.threads == 32 and said(service, "no free board holds", "32768 tokens")


# ---------------------------------------------------------------- placement across boards and links


def test_across_boards_only_when_no_board_holds_it_and_the_plan_says_the_cost():
    pairs = _v100s(16384, 16384, 16384, 16384, boards=[[0, 1], [2, 3]], links=[(0, 1, 2), (2, 3, 2)])
    # 31 GiB dense: more than one pair holds, less than all four cards; a dense model cannot spill to host RAM
    spanned = only(plan(pairs, REVIEWER))
    assert spanned.gpus == [0, 1, 2, 3] and spanned.split_mode == "layer" and not spanned.cpu_offload
    assert said(spanned, "no single free board holds", "a dense model cannot spill experts to host RAM",
                "across the fewest boards, 2, 4 cards")
    assert said(spanned, "cross-board cost", "PCIe", "5376 values") and flag(spanned, "--split-mode") == "layer"
    host_only = plan(pairs, WantedModel(id=REVIEWER, spill="host"))  # the fleet keeps every model on one board
    assert not host_only.fits and "GPUs 0,1" in host_only.unplaced[0].reason
    assert "spill: boards (the fleet asks for spill: host) would hold it whole across boards, 4 cards" in \
        host_only.unplaced[0].reason
    moe = only(plan(pairs, Q6K))  # an MoE model that one pair holds
    assert set(moe.gpus) in ({0, 1}, {2, 3})


def test_the_fattest_links_win_inside_a_board():
    board = _v100s(16384, 16384, 16384, boards=[[0, 1, 2]], links=[(0, 1, 2), (0, 2, 2), (1, 2, 4)])
    service = only(plan(board, Q6K))
    assert service.gpus == [1, 2] and said(service, "NVLink x4")


def test_host_ram_is_shared_between_offloading_services():
    two = _v100s(16384, 16384, cores=8, ram=24000)
    result = plan(two, Q6K, IQ4)
    assert [s.model for s in result.services] == [Q6K] and not result.fits
    assert "host RAM" in result.unplaced[0].reason and result.unplaced[0].model == IQ4
    assert "-cram" not in result.services[0].args  # no room left for a 16 GiB prompt cache


# ---------------------------------------------------------------- engines and features


def test_sliding_window_models_run_on_upstream_even_when_offloading():
    service = only(plan(SINGLE, GEMMA, ctx=262144))
    assert service.cpu_offload and service.engine == "upstream-02182fc"
    assert flag(service, "--n-cpu-moe") and "--fit" not in service.args
    assert said(service, "sliding-window", "ik_llama.cpp") and said(service, "GiB of KV")


def test_catalog_asking_ik_for_a_sliding_window_model_still_gets_upstream(tmp_path):
    extra = tmp_path / "c.yml"
    body = catalog().model(GEMMA).model_dump(exclude={"id", "hub_url"}) | {"engine": "ik"}
    extra.write_text(yaml.safe_dump({"models": {GEMMA: body}}))
    service = only(plan(SINGLE, GEMMA, cat=load_catalog([extra])))
    assert service.engine == "upstream-02182fc"


def test_mtp_decoding_only_with_the_head_and_an_engine_that_drafts_with_it():
    assert only(plan(DUAL, GEMMA)).spec_decoding is None  # no head
    assert only(plan(SINGLE, IQ4)).spec_decoding == "mtp:n_max=3,p_min=0.75"


def test_cpu_only_box_serves_on_the_cpu_build_with_every_core():
    service = only(plan(CPU_ONLY, GATE))
    assert service.engine == "cpu-0c1e570" and service.gpus == [] and service.env == {}
    assert service.threads == 28 and service.n_gpu_layers == 0 and service.args[-2:] == ["--load-mode", "mmap"]
    assert said(service, "no V100")
    assert service.memory.per_device_mib["cpu"] < profile(CPU_ONLY).memory_mib


def test_every_service_says_why_for_each_rule(twelve):
    for service in twelve.services + plan(SINGLE, IQ4).services:
        for words in (("context",), ("threads",), ("ubatch",), ("--parallel",), ("--jinja",), ("port",),
                      ("CUDA_VISIBLE_DEVICES",), ("memory estimated",)):
            assert said(service, *words), (service.model, words)


def test_v100s_of_unknown_memory_are_not_mistaken_for_a_cpu_only_box():
    cut = HardwareProfile(gpus=[Gpu(index=0, name="Tesla V100-SXM2-32GB")], cpu=Cpu(cores=8), memory_mib=65536)
    result = plan(cut, GATE)
    assert not result.fits and "not their memory" in result.unplaced[0].reason
