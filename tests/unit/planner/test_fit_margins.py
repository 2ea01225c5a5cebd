"""A GPU plan says how much each card keeps free and why that is enough, and counts its page-locked host memory."""

from __future__ import annotations

from controller.stages.planner.placement import HOST_RESERVE_MIB
from tests.unit.planner.helpers import SINGLE, catalog, only, plan, profile

GRAPH_MODEL = "qwen3-4b-instruct-2507-q8_0"  # qwen3: its graph is mirrored, compute buffers as the engine sizes them
FORMULA_MODEL = "gemma4-26b-a4b-qat-q4_0"  # gemma4: compute from the formula


def _reason(service, start: str) -> str:
    return next(r for r in service.reasons if r.startswith(start))


def test_each_card_says_what_it_keeps_free_and_why_that_is_enough() -> None:
    service = only(plan(SINGLE, GRAPH_MODEL))
    margin = _reason(service, "memory per card:")
    assert "GPU 0:" in margin and "of 16384 MiB" in margin and "MiB free" in margin
    assert "at least 768 MiB is kept free" in margin
    assert "llama.cpp reserves" in margin and "595-696 MiB" in margin and "to spare" in margin
    formula = _reason(only(plan(SINGLE, FORMULA_MODEL)), "memory per card:")
    assert "formula fitted to the CPU server" in formula


def test_the_page_locked_host_buffers_are_counted_against_host_ram() -> None:
    service = only(plan(SINGLE, GRAPH_MODEL))
    host = _reason(service, "host RAM:")
    assert "page-locked CUDA_Host memory" in host and "KQ mask" in host
    small = profile(SINGLE).model_copy(update={"memory_mib": HOST_RESERVE_MIB + 64})
    refused = plan(small, GRAPH_MODEL)
    assert not refused.services
    assert "host RAM" in refused.unplaced[0].reason and "page-locked" in refused.unplaced[0].reason


def test_a_model_whose_heads_no_quantised_cache_can_hold_plans_with_f16_and_never_crashes() -> None:
    """3-wide heads (24-wide K and V rows): q8_0 and q4_0 need widths divisible by 32; the planner takes f16, or says it does not fit."""
    base = catalog()
    entry = base.models[GRAPH_MODEL]
    narrow = entry.model_copy(update={"hparams": {**entry.hparams, "attention.key_length": 3,
                                                  "attention.value_length": 3}})
    narrow_catalog = base.model_copy(update={"models": {**base.models, GRAPH_MODEL: narrow}})
    service = only(plan(SINGLE, GRAPH_MODEL, cat=narrow_catalog))
    assert (service.cache_type_k, service.cache_type_v) == ("f16", "f16")
    tiny = profile(SINGLE).model_copy(update={"gpus": [gpu.model_copy(update={"memory_mib": 1024})
                                                       for gpu in profile(SINGLE).gpus], "memory_mib": 1024})
    refused = plan(tiny, GRAPH_MODEL, cat=narrow_catalog)  # the "does not fit" figures, not an internal error
    assert not refused.services and refused.unplaced
