"""The collection's Jinja filters, called ``v100box.llm.<name>`` from the roles.

They run on the control node (the controller, an execution environment, or a box running ansible-pull on itself)
and need only ansible-core and this collection; ``openclaw_merge`` and ``openclaw_problem`` need json5 when they
run. Every forked worker imports this file, so it imports nothing heavy at load time.
"""

from __future__ import annotations

from collections.abc import Iterable

from ansible_collections.v100box.llm.plugins.module_utils.hosts import reachable_host
from ansible_collections.v100box.llm.plugins.plugin_utils.openclaw import OpenClawConfigError, merge_openclaw


def systemd_quote(word: str) -> str:
    """Quote one argument for a systemd ExecStart= line.

    systemd expands ``%`` specifiers and ``$VAR`` references and splits on whitespace, so every
    argument is double-quoted with ``\\``, ``"``, ``%`` and ``$`` escaped.
    """
    escaped = str(word).replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{escaped}"'


def systemd_command(words: Iterable[str]) -> str:
    """An argument list as one ExecStart= value that systemd splits back into the same list."""
    return " ".join(systemd_quote(word) for word in words)


def gpu_minors(instance: dict, gpus: list[dict]) -> list[int]:
    """The minor numbers of the device nodes (``/dev/nvidia<minor>``) a llama_service instance's unit opens.

    A rendered instance carries them (``gpu_minors``, decided by the planner; empty for a CPU service). A
    hand-written one names its cards in ``CUDA_VISIBLE_DEVICES``, by nvidia-smi index or UUID, each looked up in
    ``gpus`` (``llama_service_gpus``: index, uuid, minor_number; a card without minor_number is taken at its
    index), or, naming none, gets every card there.
    """
    if instance.get("gpu_minors") is not None:
        return [int(minor) for minor in instance["gpu_minors"]]

    def minor(gpu: dict) -> int:
        return int(gpu["index"] if gpu.get("minor_number") is None else gpu["minor_number"])

    visible = str((instance.get("env") or {}).get("CUDA_VISIBLE_DEVICES", "")).split(",")
    visible = [entry.strip() for entry in visible if entry.strip()]
    if not visible:
        return [minor(gpu) for gpu in gpus]
    minors = []
    for entry in visible:
        found = next((gpu for gpu in gpus if entry in (str(gpu.get("uuid")), str(gpu.get("index")))), None)
        if found is not None:
            minors.append(minor(found))
        elif entry.isdigit():
            minors.append(int(entry))
        elif entry.lstrip("-").isdigit():  # CUDA stops at an invalid ordinal: the cards after it are hidden
            break
        else:
            raise ValueError(f"llama_service_instances entry {instance.get('name', '?')}: CUDA_VISIBLE_DEVICES names "
                             f"{entry}, which llama_service_gpus does not list; give that card's uuid and "
                             f"minor_number there, or name the instance's gpu_minors")
    return minors


def openclaw_merge(text: str, services: list[dict], keys: dict[str, str], source: str = "the OpenClaw config") -> str:
    """An OpenClaw config (JSON5 text) with the box's services merged in as providers.

    ``services`` is the rendered ``agent_clients_services``; ``keys`` maps each service's ``key`` to its API key.
    """
    for service in services:
        provider = {**service["openclaw_provider"], "apiKey": keys[service.get("key", service["name"])]}
        text = merge_openclaw(text, service["openclaw_provider_id"], provider, source)
    return text


def openclaw_problem(text: str, source: str = "the OpenClaw config") -> str:
    """Why an OpenClaw config cannot take the box's providers (not JSON5, not an object), or "" when it can."""
    try:
        merge_openclaw(text, "check", {}, source)
    except OpenClawConfigError as exc:
        return str(exc)
    return ""


_ANSWER_FIELDS = ("health", "served_ids", "openai", "anthropic", "auth")
_CERTIFY_FIELDS = ("tool_call", "streams", "throughput")


def verify_results(answers: list[dict], check_key: str = "check") -> dict[str, dict]:
    """The servers' answers as ``llama_verify`` publishes them (``set_stats`` ``llama_verify``, read by the controller's
    verdict): by server name, its own model's answers with its model and port, and for an on-demand router each of its
    models' answers under ``models``.

    ``answers`` are ``llama_api_check`` results, each with the check it answers under ``check_key`` (``instance``,
    ``model``, ``first``): a loop's results (``roles/llama_verify/tasks/servers.yml``) or ``box_manifest``'s
    ``servers`` (the converged fast path of ``playbooks/site.yml``).
    """
    results = {}
    for answer in answers:
        checked = answer[check_key]
        if not checked["first"]:
            continue
        instance = checked["instance"]
        fields = {"model": instance["model"], "port": instance["port"],
                  **{name: answer.get(name) for name in _ANSWER_FIELDS},
                  **{name: answer[name] for name in _CERTIFY_FIELDS if name in answer}}
        if "models" in instance:
            fields["models"] = {each[check_key]["model"]: {name: each.get(name) for name in _ANSWER_FIELDS}
                                for each in answers if each[check_key]["instance"]["name"] == instance["name"]}
        results[instance["name"]] = fields
    return results


class FilterModule:
    """The filters by the names the roles use."""

    def filters(self):
        return {"systemd_quote": systemd_quote, "systemd_command": systemd_command, "reachable_host": reachable_host,
                "openclaw_merge": openclaw_merge, "openclaw_problem": openclaw_problem, "llama_gpu_minors": gpu_minors,
                "verify_results": verify_results}
