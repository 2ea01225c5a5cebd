"""The gateway of a box: which model id goes to which planned service, on this box or others, and why.

Pure: the plans of the other boxes come in as arguments (``controller.actions.provision`` reads them from the
inventory). The router itself (HAProxy, see docs/gateway.md) is installed and configured by
roles/llm_gateway from the ``GatewayPlan`` this returns.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

from controller.errors import PlanError
from controller.model.fleet import Box
from controller.model.rules import STREAM_SILENCE_S, reachable_host
from controller.model.serveplan import GatewayPlan, GatewayRoute, ServePlan

# A request body is read up to this many bytes per planned context token to find its "model" field:
# a token is about 4 bytes of text, JSON escaping and tool schemas add to it. Clients put "model" first
# (Claude Code and the OpenAI SDKs do), so a longer body is still routed; the buffer only bounds where
# the field may sit.
BYTES_PER_TOKEN = 8
BUFFER_MIN = 1 << 20
BUFFER_MAX = 16 << 20
# Connecting to a planned service: loopback or a LAN answers in well under a millisecond, so a service
# that is down (refused) or a box that is off (no answer) is reported to the client within a second.
CONNECT_TIMEOUT_MS = 900


def _buffer(ctx: int) -> int:
    size = BUFFER_MIN
    while size < ctx * BYTES_PER_TOKEN and size < BUFFER_MAX:
        size <<= 1
    return size


def _remote_host(gateway_box: Box, box: Box) -> str:
    """The address the gateway reaches ``box``'s servers at; refuse servers that listen on loopback only."""
    bind = ipaddress.ip_address(box.bind)
    if bind.is_loopback:
        raise PlanError(f"box {gateway_box.name}: its gateway routes to box {box.name}, whose servers bind {box.bind} "
                        f"(that box only); set bind (e.g. 0.0.0.0) and allow_from (with {gateway_box.name}'s "
                        f"network) on {box.name}, provision it, then provision {gateway_box.name}")
    return box.address if bind.is_unspecified else reachable_host(box.bind)


def plan_gateway(box: Box, plan: ServePlan, others: Mapping[str, tuple[Box, ServePlan | None]]) -> GatewayPlan:
    """Routes for the gateway of ``box``: its own services, then those of each box in ``gateway.boxes``.

    ``others`` maps each of those boxes to its fleet entry and its rendered plan (None: never planned).
    """
    settings = box.gateway
    if settings is None:
        raise PlanError(f"box {box.name}: no gateway in the fleet file")
    if box.os != "linux":
        raise PlanError(f"box {box.name}: the gateway runs on Linux boxes only; put gateway: on a Linux box of the "
                        f"fleet and list {box.name} in its gateway.boxes")
    taken = {service.port: service.name for service in plan.services}
    for what, port in (("gateway.port", settings.port), ("gateway.metrics_port", settings.metrics_port)):
        if port in taken:
            raise PlanError(f"box {box.name}: {what} {port} is the port of {taken[port]}; pick a port outside "
                            f"{box.base_port}-{box.base_port + len(box.models) - 1}")
    if settings.port == settings.metrics_port:
        raise PlanError(f"box {box.name}: gateway.port and gateway.metrics_port are both {settings.port}; "
                        "give each its own")
    routes: dict[str, GatewayRoute] = {}
    hidden: list[str] = []
    contexts = []

    def add(name: str, service_plan: ServePlan, host: str) -> None:
        for service in (view for planned in service_plan.services for view in planned.per_model()):
            if service.model in routes:  # the first box that serves a model answers for it
                hidden.append(f"{service.model} on {name} (answered by {routes[service.model].box})")
                continue
            routes[service.model] = GatewayRoute(model=service.model, box=name, service=service.name, host=host,
                                                 port=service.port, local=name == box.name)
            contexts.append(service.ctx)

    add(box.name, plan, reachable_host(box.bind))
    for name in settings.boxes:
        if name == box.name:
            continue
        other, other_plan = others[name]
        if other_plan is None or not other_plan.services:
            raise PlanError(f"box {box.name}: its gateway routes to box {name}, which has no plan in the inventory "
                            f"yet; provision {name} first (controller provision {name}), then {box.name}")
        host = _remote_host(box, other)
        if other.api_key is None:
            raise PlanError(f"box {box.name}: its gateway routes to box {name}, which has no api_key in the fleet "
                            f"file; set api_key on {name} (the gateway sends it to {name}'s servers)")
        add(name, other_plan, host)
    buffer = _buffer(max(contexts, default=0))
    exposure = ("loopback only: clients on this box" if ipaddress.ip_address(box.bind).is_loopback else
                f"bind {box.bind} like the servers, reachable from allow_from ({', '.join(box.allow_from)}) only")
    reasons = [
        f"gateway on port {settings.port} ({exposure}); it asks every client for its own key (gateway.api_key), "
        f"never the servers' key, and sends each server its box's key itself",
        f"routes by the model name in the request body: {', '.join(sorted(routes))}",
        f"reads up to {buffer} bytes of a request body to find its model name: {BYTES_PER_TOKEN} bytes per token "
        f"of the largest planned context ({max(contexts, default=0)}), at least {BUFFER_MIN}",
        f"connect timeout {CONNECT_TIMEOUT_MS} ms and health checks every second: a request for a model whose "
        f"service is down gets an error naming the model and its box within a second",
        f"no total or first-byte timeout on a request ({STREAM_SILENCE_S} s of silence at most, as long as the "
        f"clients `controller clients` wires wait): a long prefill is never cut by the gateway",
        f"metrics (Prometheus) on 127.0.0.1:{settings.metrics_port}, this box only",
    ]
    if hidden:
        reasons.append("a model id routes to the first box that serves it (this box, then gateway.boxes in order); "
                       f"not routed: {'; '.join(hidden)}")
    return GatewayPlan(
        bind=box.bind, port=settings.port, metrics_port=settings.metrics_port, allow_from=list(box.allow_from),
        buffer_bytes=buffer, connect_timeout_ms=CONNECT_TIMEOUT_MS, idle_timeout_s=STREAM_SILENCE_S,
        routes=[routes[model] for model in sorted(routes)],
        reasons=reasons,
    )
