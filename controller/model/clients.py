"""What an agent client needs to use a planned service: Claude Code's environment, an OpenClaw provider.

Pure: from a box of the fleet, its plan and (for ``client_config``) its API key. ``client_config`` is the JSON
contract of ``controller clients BOX --fleet FILE --json`` (controller/actions/clients.py); extend it, never
rename::

    {box, services: [{model, base_url, ctx, warnings: [sentence],
                      claude_code: {env: {NAME: value}, settings: {...}}, openclaw: {provider: {...}}}]}

``role_services`` is the same values without the key: what render hands the ``agent_clients`` role for a box's
accounts and a workstation's (launch scripts, the merged OpenClaw config).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from controller.model.fleet import Box
from controller.model.rules import AGENT_CLIENT_CTX, STREAM_SILENCE_S, reachable_host
from controller.model.serveplan import ServePlan, Service

CLIENTS = tuple(AGENT_CLIENT_CTX)  # "claude-code", "openclaw"
MAX_OUTPUT_TOKENS = 32000  # Claude Code's own default cap; a smaller context gets a quarter of it
# Claude Code's model variables: every one names the served model, so whatever slot Claude Code picks
# (main, the small/fast model for titles and summaries, each default) reaches this server, and the
# model reports its real identity.
CLAUDE_MODEL_VARIABLES = ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                          "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_SMALL_FAST_MODEL")
# What a client does with less context than it needs (AGENT_CLIENT_CTX).
SHORT_CONTEXT = {"claude-code": "its first turn fails with \"Prompt is too long\" (its system prompt and tools come first)",
                 "openclaw": "its first request (~23k tokens of system prompt and tools) fails, and it drops replies"}
# OpenClaw's documented settings for a custom provider in front of llama-server: tools on, and tool schemas cleaned
# of what llama.cpp's grammar compiler refuses (long pattern/maxLength values).
OPENCLAW_COMPAT = {"supportsTools": True, "toolSchemaProfile": "llamacpp"}


def max_output_tokens(ctx: int) -> int:
    """A reply budget that leaves the prompt most of the context: a quarter of it, at most Claude Code's cap."""
    return min(MAX_OUTPUT_TOKENS, ctx // 4)


def base_url(box: Box, service: Service) -> str:
    """Where a client reaches the service: the box's address when it listens everywhere, else its bind."""
    bind = ipaddress.ip_address(box.bind)
    host = box.address if bind.is_unspecified else reachable_host(box.bind)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{service.port}"


def provider_id(box: Box) -> str:
    """The OpenClaw provider name of a box: one provider per box, one model per service."""
    return "v100-" + re.sub(r"[^a-z0-9-]+", "-", box.name.lower())


def claude_code(service: Service, url: str, api_key: str) -> dict[str, Any]:
    env = {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_AUTH_TOKEN": api_key,
        **{name: service.model for name in CLAUDE_MODEL_VARIABLES},
        # Claude Code compacts the conversation before it reaches the server's context, which it would refuse.
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(service.ctx),
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(service.ctx),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens(service.ctx)),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no telemetry, error reports or update checks
        # A long prefill sends nothing for minutes: wait as long as the gateway does rather than give up.
        "API_TIMEOUT_MS": str(STREAM_SILENCE_S * 1000),
        "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": str(STREAM_SILENCE_S * 1000),
    }
    # settings.json carries everything but the secret; the token comes from the environment (a launch script).
    settings = {"model": service.model,
                "env": {name: value for name, value in env.items() if name != "ANTHROPIC_AUTH_TOKEN"}}
    return {"env": env, "settings": settings}


def openclaw(box: Box, service: Service, url: str, api_key: str) -> dict[str, Any]:
    model = {
        "id": service.model,
        "name": f"{service.model} on {box.name}",
        "reasoning": False,
        "input": ["text"],
        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
        "contextWindow": service.ctx,
        "maxTokens": max_output_tokens(service.ctx),
        "compat": dict(OPENCLAW_COMPAT),
    }
    provider = {"baseUrl": f"{url}/v1", "apiKey": api_key, "api": "openai-completions", "models": [model]}
    return {"provider_id": provider_id(box), "model_ref": f"{provider_id(box)}/{service.model}",
            "provider": provider}


def context_warnings(service: Service, only: str | None = None) -> list[str]:
    """One sentence, with the numbers, per client (``only``: that one) whose minimum context (AGENT_CLIENT_CTX, what
    the planner gives a model that names the client) the service's planned context is below."""
    warnings = []
    for client in (only,) if only else CLIENTS:
        least, prefer = AGENT_CLIENT_CTX[client]
        if service.ctx < least:
            warnings.append(f"{service.model} has {service.ctx} tokens of context; {client} needs at least {least} "
                            f"(prefers {prefer}): {SHORT_CONTEXT[client]}. Name the client in the fleet file "
                            f"(agents: [{client}] on the model or the box) and provision again: the planner then "
                            f"gives it the context or says why it cannot")
    return warnings


def client_config(box: Box, plan: ServePlan, api_key: str, only: str | None = None) -> dict[str, Any]:
    """For each planned service, what Claude Code and OpenClaw need (``only``: one of them), and a warning per
    client the service's context is too small for."""
    services = []
    for service in (view for planned in plan.services for view in planned.per_model()):
        url = base_url(box, service)
        entry: dict[str, Any] = {"model": service.model, "base_url": url, "ctx": service.ctx,
                                 "warnings": context_warnings(service, only)}
        if only in (None, "claude-code"):
            entry["claude_code"] = claude_code(service, url, api_key)
        if only in (None, "openclaw"):
            entry["openclaw"] = openclaw(box, service, url, api_key)
        services.append(entry)
    return {"box": box.name, "services": services}


def role_services(box: Box, plan: ServePlan, key: str | None = None) -> list[dict[str, Any]]:
    """roles/agent_clients' input: each service's client settings without the key, and the key's name.

    ``key`` None: each server's own key file on the box (``<instance>.key``); a workstation names the box, whose
    key the controller hands in.
    """
    services = []
    for service in (view for planned in plan.services for view in planned.per_model()):
        url = base_url(box, service)
        env = claude_code(service, url, "")["env"]
        del env["ANTHROPIC_AUTH_TOKEN"]
        entry = openclaw(box, service, url, "")
        del entry["provider"]["apiKey"]
        services.append({"name": service.name, "box": box.name, "model": service.model, "key": key or service.name,
                         "env": env,
                         "openclaw_provider_id": entry["provider_id"], "openclaw_provider": entry["provider"]})
    return services
