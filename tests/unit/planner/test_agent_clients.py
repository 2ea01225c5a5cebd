"""Agent-ready plans: a model (or its box) names the clients that use it, and the context serves them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from controller.model.fleet import Box, WantedModel
from controller.model.rules import AGENT_CLIENT_CTX
from controller.stages.planner import plan_models
from tests.unit.planner.helpers import CPU_ONLY, SINGLE, catalog, only, profile, said

GEMMA, DENSE27, GATE = "gemma4-26b-a4b-qat-q4_0", "qwen3.6-27b-q4_k_m", "qwen3-4b-instruct-2507-q8_0"


def _want(model: str, agents, **extra) -> WantedModel:
    return WantedModel.model_validate({"id": model, "agents": agents, **extra})


def _plan(machine: str, want: WantedModel, cat=None):
    return plan_models([want], profile(machine), cat or catalog())


def test_named_clients_get_one_slot_each_and_a_context_they_can_work_with():
    service = only(_plan(SINGLE, _want(GEMMA, ["claude-code", "openclaw"])))
    assert service.parallel == 2
    assert service.ctx >= AGENT_CLIENT_CTX["openclaw"][0]
    assert said(service, "claude-code needs at least 32768", "openclaw needs at least 65536")


def test_a_cpu_box_plans_the_preferred_context_for_claude_code_instead_of_its_small_default():
    plain = only(_plan(CPU_ONLY, WantedModel(id=GATE)))
    agent = only(_plan(CPU_ONLY, _want(GATE, ["claude-code"])))
    assert plain.ctx < 32768 <= agent.ctx
    assert agent.ctx == AGENT_CLIENT_CTX["claude-code"][1]
    assert said(agent, "serves the agents named in the fleet")


def test_a_count_of_agents_still_works_and_names_no_client():
    want = WantedModel.model_validate({"id": GEMMA, "agents": 3})
    assert (want.agents, want.clients) == (3, [])
    service = only(_plan(SINGLE, want))
    assert service.parallel == 3 and not said(service, "agents named in the fleet")


def test_a_model_trained_for_less_than_the_client_needs_is_refused_with_the_numbers():
    cat = catalog().model_copy(deep=True)
    entry = cat.models[GATE]
    cat.models[GATE] = entry.model_copy(update={"hparams": {**entry.hparams, "context_length": 40960}})
    result = _plan(SINGLE, _want(GATE, ["openclaw"]), cat)
    assert not result.fits
    reason = result.unplaced[0].reason
    assert "trained for 40960" in reason and "openclaw needs at least 65536" in reason
    # Claude Code can work in 40960: planned there, not beyond what the model was trained for.
    assert only(_plan(SINGLE, _want(GATE, ["claude-code"]), cat)).ctx <= 40960


def test_a_refusal_says_what_the_named_clients_needed():
    result = _plan(SINGLE, _want(DENSE27, ["openclaw"]))
    assert not result.fits
    reason = result.unplaced[0].reason
    assert "largest context" in reason or "not even the weights" in reason
    assert "need at least 65536 tokens of context" in reason


@pytest.mark.parametrize(("body", "words"), [
    ({"id": GEMMA, "agents": []}, ["give a count or the clients"]),
    ({"id": GEMMA, "agents": ["cursor"]}, ["unknown client cursor", "claude-code or openclaw"]),
    ({"id": GEMMA, "agents": ["openclaw"], "ctx": 32768}, ["ctx 32768 is below the 65536 tokens openclaw needs"]),
])
def test_the_fleet_refuses_clients_it_cannot_serve(body, words):
    with pytest.raises(ValidationError) as caught:
        WantedModel.model_validate(body)
    assert all(word in str(caught.value) for word in words)


def test_the_box_names_the_clients_of_every_model_that_names_none():
    box = Box.model_validate({"name": "b", "address": "192.0.2.1", "agents": ["claude-code"],
                              "models": [{"id": GEMMA}, {"id": GATE, "agents": 2}]})
    assert [(m.agents, m.clients) for m in box.models] == [(1, ["claude-code"]), (2, [])]
