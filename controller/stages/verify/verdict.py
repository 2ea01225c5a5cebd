"""What the checks on a box answered, and whether that makes the box verified.

The checks are ``llama_api_check`` (plugins/modules: the Linux module and its Windows twin return the
same fields) for each server, plus NCCL loading where the plan all-reduces through it. The llama_verify
role publishes their answers with ``set_stats`` under ``llama_verify``, one entry per box: the servers'
results by service name, and ``nccl`` when it was checked. The verdict applies the module's own rules to
those recorded answers, so a report read later (certification, fleet status) reaches the same verdict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controller.model.fleet import Box
from controller.model.serveplan import ServePlan, Service
from controller.stages.runner import RunResult

STATS_KEY = "llama_verify"  # the set_stats key of roles/llama_verify, on both OSes
REFUSED = 401  # what a server with a key must answer a request without it, or with a wrong one


@dataclass(frozen=True)
class ServiceVerdict:
    name: str
    problems: tuple[str, ...] = ()

    @property
    def verified(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class Verdict:
    """Per service, and for the box as a whole (the run, NCCL); ``problems`` say what is missing."""

    services: dict[str, ServiceVerdict]
    problems: tuple[str, ...] = ()

    @property
    def verified(self) -> bool:
        return bool(self.services) and not self.problems and all(s.verified for s in self.services.values())

    def service(self, name: str) -> ServiceVerdict:
        return self.services[name]

    def all_problems(self) -> list[str]:
        return [*self.problems, *(f"{name}: {problem}" for name, check in self.services.items()
                                  for problem in check.problems)]


def results(run: RunResult | None, box: Box) -> dict[str, Any]:
    """What the checks answered on ``box`` in ``run``: servers by service name, ``nccl`` when checked."""
    if run is None:
        return {}
    return dict((run.data.get(STATS_KEY) or {}).get(box.name) or {})


def expects_key(box: Box) -> bool:
    """Whether the box's servers must refuse requests without an API key whatever the inventory says."""
    return box.api_key is not None or box.binds_beyond_loopback


def check_service(service: Service, checked: Mapping[str, Any], *, key_required: bool = False) -> ServiceVerdict:
    """The rules of llama_api_check, applied to what it recorded for one server (for an on-demand router, for each
    of its models: a model with no answer recorded was not checked)."""
    if not checked:
        return ServiceVerdict(service.name, ("no answer recorded: the checks did not run to the end",))
    if service.on_demand is None:
        return ServiceVerdict(service.name, tuple(_problems(service.model, checked, key_required)))
    per_model = checked.get("models") or {}
    problems = []
    for item in service.on_demand.models:
        answer = per_model.get(item.id)
        found = _problems(item.id, answer, key_required) if answer else ["no answer recorded: it was not checked"]
        problems += [f"{item.id}: {problem}" for problem in found]
    return ServiceVerdict(service.name, tuple(problems))


def _problems(model: str, checked: Mapping[str, Any], key_required: bool) -> list[str]:
    problems = []
    if checked.get("health") != "ok":
        problems.append(f"/health says {checked.get('health')}")
    served = list(checked.get("served_ids") or [])
    if model not in served:
        problems.append(f"serves {served}, not {model}")
    openai = (checked.get("openai") or {}).get("object")
    if openai != "chat.completion":
        problems.append(f"the OpenAI API answered {openai!r}, not a chat.completion")
    anthropic = (checked.get("anthropic") or {}).get("type")
    if anthropic != "message":
        problems.append(f"the Anthropic API answered {anthropic!r}, not a message")
    auth = checked.get("auth") or {}
    if auth.get("required"):
        for field, how in (("anonymous_status", "without a key"), ("wrong_key_status", "with a wrong key")):
            if auth.get(field) != REFUSED:
                problems.append(f"/v1/chat/completions answered HTTP {auth.get(field)} {how}, not {REFUSED}: "
                                "the server does not check its API key")
    elif key_required:
        problems.append("checked without an API key, but the box's servers must require one")
    return problems


def verdict(plan: ServePlan, answers: Mapping[str, Any], run: RunResult | None, *,
            key_required: bool = False) -> Verdict:
    """Verified: the run that carried the checks finished, every planned server passed them, NCCL loaded
    where the plan uses it. ``answers`` is what ``results`` returned for the box."""
    problems = []
    if run is None:
        problems.append("the checks have not run")
    elif run.status != "successful":
        problems.append(f"{run.playbook} {run.status}")
    if not plan.services:
        problems.append("no service is planned")
    if any(service.nccl for service in plan.services) and not (answers.get("nccl") or {}).get("version"):
        problems.append("the plan all-reduces through NCCL, but NCCL was not seen to load")
    services = {service.name: check_service(service, answers.get(service.name) or {}, key_required=key_required)
                for service in plan.services}
    return Verdict(services, tuple(problems))


def report_fields(answers: Mapping[str, Any], outcome: Verdict, name: str) -> dict[str, Any]:
    """What the report says of one service's verification (fields of the report's JSON contract)."""
    checked = answers.get(name) or {}
    return {
        "verified": outcome.service(name).verified,
        "health": checked.get("health"),
        "served_ids": checked.get("served_ids", []),
        "openai": checked.get("openai"),
        "anthropic": checked.get("anthropic"),
        "auth": checked.get("auth"),  # {required, anonymous_status, wrong_key_status}
        # an on-demand router: each model's answers (its OpenAI turn's seconds include its load when it was not loaded)
        **({"models": checked["models"]} if checked.get("models") else {}),
    }
