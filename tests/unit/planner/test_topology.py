"""GPU sets the planner may use: single cards, or cards of one NVLink board, fattest links first."""

from __future__ import annotations

import pytest

from controller.model.profile import Gpu, HardwareProfile, NvLink
from controller.stages.planner.topology import GpuPool
from tests.unit.planner.helpers import DUAL, TWELVE, profile


def test_pairs_of_the_twelve_gpu_box_prefer_its_six_link_pairs_and_never_cross_boards():
    pool = GpuPool(profile(TWELVE))
    pairs = pool.candidates(2)
    assert [p.gpus for p in pairs[:2]] == [(2, 3), (0, 1)]  # NV6 before the boards' NV2 pairs; least memory first
    assert {p.min_links for p in pairs[:2]} == {6} and all(p.min_links == 2 for p in pairs[2:])
    boards = [set(b) for b in profile(TWELVE).boards]
    for size in (2, 3, 4):
        for candidate in pool.candidates(size):
            assert any(set(candidate.gpus) <= board for board in boards), candidate.gpus
    assert [c.gpus for c in pool.candidates(4)] == [(4, 5, 8, 9), (6, 7, 10, 11)]
    assert pool.candidates(5) == []


def test_single_cards_come_from_the_smallest_board_first_and_taken_cards_are_gone():
    pool = GpuPool(profile(TWELVE))
    first = pool.candidates(1)[0]
    assert first.gpus == (3,) and first.memory_mib == (16384,)  # a pair's card before a 4-card board's
    pool.take((0, 1, 2, 3))
    assert all(len(c.board) == 4 for c in pool.candidates(1))
    assert pool.largest_free_board().gpus == (4, 5, 8, 9)
    with pytest.raises(ValueError, match="already given"):
        pool.take((1,))


def test_every_card_with_a_memory_is_pooled_and_a_mixed_box_is_noticed():
    # Which card a model may use is the planner's test (an engine built for its architecture); the pool
    # leaves out only the cards whose memory the probe did not see.
    mixed = HardwareProfile(gpus=[Gpu(index=0, name="NVIDIA GeForce RTX 3090", memory_mib=24576, compute_capability="8.6"),
                                  Gpu(index=1, name="Tesla V100-PCIE-16GB", memory_mib=16384),
                                  Gpu(index=2, name="Tesla V100-PCIE-16GB")])
    pool = GpuPool(mixed)
    assert list(pool.gpus) == [0, 1] and [g.index for g in pool.ignored] == [2] and pool.mixed
    assert [pool.gpus[i].arch for i in (0, 1)] == [86, 70]  # a V100 is sm_70 even without a probed capability
    volta_only = pool.candidates(1, usable=lambda gpus: all(pool.gpus[i].arch == 70 for i in gpus))
    assert [c.gpus for c in volta_only] == [(1,)]
    assert pool.candidates(2) == []  # no NVLink between them: never one board
    spanning = pool.spanning(2, usable=lambda gpus: True)
    assert [(c.gpus, c.spans) for c in spanning] == [((0, 1), True)]
    assert "across boards, over PCIe" in spanning[0].describe()
    assert not GpuPool(profile(DUAL)).mixed


def test_tensor_split_sets_are_powers_of_two_and_fattest_pair_wins_inside_a_board():
    three = HardwareProfile(
        gpus=[Gpu(index=i, name="Tesla V100-SXM2-32GB", memory_mib=32768) for i in range(3)],
        nvlink=NvLink(pairs=[(0, 1, 2), (0, 2, 2), (1, 2, 4)]), boards=[[0, 1, 2]])
    pool = GpuPool(three)
    assert pool.candidates(2)[0].gpus == (1, 2)
    assert pool.candidates(3, powers_of_two=True) == [] and len(pool.candidates(3)) == 1
