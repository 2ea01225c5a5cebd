"""The preflights of agent_clients, box_seal, lan_cache, llm_gateway and thermal_guard, run by ansible-playbook on
this machine (connection local): each refusal a hand-written inventory can meet stops the role with one line naming
what to fix, before anything changes. What the box holds is this machine's: its accounts, its listening ports (the
test opens them), key files in a temporary folder and the lab's stand-in nvidia-smi (lab/standin_smi.py) for the
cards' power ranges.

Each role's cases run as hosts of one inventory in one ansible-playbook run (every host is this machine with its own
variables), so a case costs no start of its own; a good case of each role proves the preflight lets right settings
through.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from lab import standin_smi
from tests.preflight import expect, run_preflights

pytestmark = pytest.mark.slow  # one ansible-playbook run per role: seconds

KEY = "preflight-key-0123456789"
def listening() -> Iterator[socket.socket]:
    while True:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---------------------------------------------------------------------------------------------------- agent_clients


def service(model: str = "tiny", key: str = "box1") -> dict:
    return {"name": "llama-tiny", "box": "box1", "model": model, "key": key, "env": {"ANTHROPIC_MODEL": model},
            "openclaw_provider_id": "box1", "openclaw_provider": {"baseUrl": "http://127.0.0.1:8011/v1"}}


AGENT_CASES = {
    "good_keys": ({"agent_clients_services": [service()], "agent_clients_keys": {"box1": KEY}}, None),
    "good_key_dir": ({"agent_clients_services": [service(key="llama-tiny")]}, None),
    "windows_workstation": ({"pf_windows": True, "agent_clients_services": [service()]},
                            ["writes per-account launch scripts on Linux only"]),
    "key_name_a_path": ({"agent_clients_services": [service(key="../../etc/shadow")], "agent_clients_keys": {}},
                        ["names the key ../../etc/shadow: give each service's key as its box or server name"]),
    "one_script_twice": ({"agent_clients_services": [service(), {**service(), "name": "llama-other", "key": "box2"}],
                          "agent_clients_keys": {"box1": KEY, "box2": KEY}},
                         ["would both get the launch script claude-tiny"]),
    "no_accounts": ({"agent_clients_services": [service()], "agent_clients_keys": {"box1": KEY},
                     "agent_clients_users": []}, ["agent_clients_users is empty: name one or more accounts"]),
    "account_not_a_name": ({"agent_clients_services": [service()], "agent_clients_keys": {"box1": KEY},
                            "agent_clients_users": ["root; rm"]}, ["agent_clients_users is root; rm: name one or more"]),
    "openclaw_outside_home": ({"agent_clients_services": [service()], "agent_clients_keys": {"box1": KEY},
                               "agent_clients_openclaw_config": "../other/.openclaw/openclaw.json"},
                              ["agent_clients_openclaw_config is ../other/.openclaw/openclaw.json: give a path relative"]),
    "key_with_a_space": ({"agent_clients_services": [service()], "agent_clients_keys": {"box1": "a key with spaces 0123"}},
                         ["agent_clients_keys box1: use 16 to 256 printable ASCII characters"]),
    "missing_account": ({"agent_clients_services": [service()], "agent_clients_keys": {"box1": KEY},
                         "agent_clients_users": ["no-such-account-v100"]},
                        ["agent_clients_users names no-such-account-v100, which has no account on missing_account"]),
    "no_key_at_all": ({"agent_clients_services": [service()]}, ["no API key for box1: hand it in as agent_clients_keys"]),
    "key_file_missing": ({"agent_clients_services": [service(key="llama-gone")]},
                         ["no API key for llama-gone", "has none"]),
    "key_file_empty": ({"agent_clients_services": [service(key="llama-empty")]}, ["no API key for llama-empty"]),
}


def test_agent_clients_preflight(tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "llama-tiny.key").write_text(KEY + "\n")
    (keys / "llama-empty.key").write_text("")
    cases = {name: ({**variables, "agent_clients_key_dir": str(keys)}
                    if name in ("good_key_dir", "key_file_missing", "key_file_empty") else variables)
             for name, (variables, _) in AGENT_CASES.items()}
    outcome = run_preflights(tmp_path, "agent_clients", cases)
    for name, (_, texts) in AGENT_CASES.items():
        if texts is None:
            assert outcome[name] is None, f"{name}: {outcome[name]}"
        else:
            expect(outcome, name, *texts)


# ---------------------------------------------------------------------------------------------------- box_seal

INSTANCE = {"name": "llama-a", "model": "tiny", "port": 18011}
BUYER_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIG0q buyer@laptop"
SEAL_CASES = {
    "windows": ({"pf_windows": True}, ["box_seal hands over Linux boxes only"]),
    "instance_without_port": ({"box_seal_instances": [{"name": "llama-a", "model": "tiny"}],
                               "box_seal_api_keys": {"llama-a": KEY}},
                              ["box_seal_instances entries llama-a: give each server's name, model and port"]),
    "no_new_key": ({"box_seal_api_keys": {}}, ["no new API key for llama-a"]),
    "key_for_a_stranger": ({"box_seal_api_keys": {"llama-a": KEY, "llama-b": KEY}},
                           ["box_seal_api_keys names llama-b, which is not a server of this box (its servers: llama-a)"]),
    "short_key": ({"box_seal_api_keys": {"llama-a": "short"}},
                  ["box_seal_api_keys for llama-a: use 16 to 256 printable ASCII characters"]),
    "comment_key": ({"box_seal_api_keys": {"llama-a": "#" + KEY}}, ["box_seal_api_keys for llama-a"]),
    "buyer_key_not_a_key": ({"box_seal_buyer_authorized_keys": ["AAAAC3Nza buyer"]},
                            ["box_seal_buyer_authorized_keys holds AAAAC3Nza buyer, not an SSH public key line"]),
    "buyer_account_not_a_name": ({"box_seal_buyer_authorized_keys": [BUYER_KEY], "box_seal_buyer_account": "Buyer One"},
                                 ["box_seal_buyer_account Buyer One: give an account name"]),
    "buyer_account_without_keys": ({"box_seal_buyer_account": "buyer"},
                                   ["box_seal_buyer_account buyer needs box_seal_buyer_authorized_keys"]),
    "key_file_missing": ({"box_seal_key_dir": "/nonexistent-v100box-keys"},
                         ["llama-a run without an API key file in /nonexistent-v100box-keys"]),
}


def test_box_seal_preflight(tmp_path):
    """Every refusal before the last check (box_hand_over in check mode, which reads this machine's sshd): the good
    case runs in the role's molecule scenario on the lab's target."""
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "llama-a.key").write_text(KEY + "\n")
    base = {"box_seal_instances": [INSTANCE], "box_seal_api_keys": {"llama-a": "new-" + KEY},
            "box_seal_key_dir": str(keys)}
    outcome = run_preflights(tmp_path, "box_seal", {name: {**base, **variables}
                                                    for name, (variables, _) in SEAL_CASES.items()})
    for name, (_, texts) in SEAL_CASES.items():
        expect(outcome, name, *texts)


# ---------------------------------------------------------------------------------------------------- lan_cache

CACHE_BASE = {"lan_cache_serve": True, "lan_cache_bind": "127.0.0.1",
              "lan_cache_upstreams": {"models": "http://127.0.0.1:9/models", "engines": "https://mirror.invalid/packs"}}
CACHE_CASES = {
    "good": ({}, None),
    "windows": ({"pf_windows": True}, ["lan_cache runs nginx on a Linux box only"]),
    "no_upstream": ({"lan_cache_upstreams": {}}, ["lan_cache_upstreams must map models and/or engines"]),
    "unknown_prefix": ({"lan_cache_upstreams": {"weights": "http://127.0.0.1:9/"}}, ["lan_cache_upstreams must map"]),
    "ftp_upstream": ({"lan_cache_upstreams": {"models": "ftp://127.0.0.1/"}}, ["lan_cache_upstreams must map"]),
    "exposed": ({"lan_cache_bind": "0.0.0.0"}, ["lan_cache_bind is 0.0.0.0, which other machines can reach"]),
    "bind_a_name": ({"lan_cache_bind": "cache.lan", "lan_cache_allow_from": ["10.0.0.0/8"]},
                    ["lan_cache_bind is cache.lan: give the IP address nginx listens on"]),
    "network_not_cidr": ({"lan_cache_allow_from": ["10.0.0.0/8; deny"]},
                         ["lan_cache_allow_from names 10.0.0.0/8; deny: give networks as address/prefix"]),
    "port_out_of_range": ({"lan_cache_port": 70000}, ["lan_cache_port is 70000: give a port from 1 to 65535"]),
    "dir_root": ({"lan_cache_dir": "/"}, ["lan_cache_dir is /: give an absolute folder other than /"]),
    "dir_relative": ({"lan_cache_dir": "cache"}, ["lan_cache_dir is cache"]),
    "size_in_words": ({"lan_cache_max_size": "500 GB"}, ["lan_cache_max_size is 500 GB: give an nginx size"]),
    "slice_zero": ({"lan_cache_slice": "0"}, ["lan_cache_slice is 0: give an nginx size such as 16m"]),
    "inactive_forever": ({"lan_cache_inactive": "forever"}, ["lan_cache_inactive is forever: give an nginx time"]),
    "port_taken": ({}, ["is taken on port_taken by", "not by lan-cache.service: stop it or give the cache another port"]),
}


def test_lan_cache_preflight(tmp_path):
    ports = listening()
    taken = next(ports)
    try:
        cases = {name: {**CACHE_BASE, "lan_cache_port": free_port(), **variables}
                 for name, (variables, _) in CACHE_CASES.items()}
        cases["port_taken"]["lan_cache_port"] = taken.getsockname()[1]
        outcome = run_preflights(tmp_path, "lan_cache", cases)
    finally:
        taken.close()
    for name, (_, texts) in CACHE_CASES.items():
        if texts is None:
            assert outcome[name] is None, f"{name}: {outcome[name]}"
        else:
            expect(outcome, name, *texts)
    expect(outcome, "port_taken", f"lan_cache_port {cases['port_taken']['lan_cache_port']} is taken")


# ---------------------------------------------------------------------------------------------------- llm_gateway

GATEWAY_CASES = {
    "good": ({}, None),
    "windows": ({"pf_windows": True}, ["llm_gateway runs on Linux boxes only"]),
    "route_without_box": ({"llm_gateway_routes": "no_box"},
                          ["llm_gateway_routes entry tiny: give model (letters, digits, . _ : / + -), box, service"]),
    "model_twice": ({"llm_gateway_routes": "twice"}, ["Two llm_gateway_routes entries name the same model"]),
    "ports_equal": ({"llm_gateway_metrics_port": "same"}, ["llm_gateway_port equals llm_gateway_metrics_port"]),
    "per_source_zero": ({"llm_gateway_maxconn_per_source": 0}, ["llm_gateway_maxconn_per_source is 0"]),
    "short_key": ({"llm_gateway_api_key": "short"}, ["llm_gateway_api_key has 5 characters"]),
    "bind_a_name": ({"llm_gateway_bind": "gw.lan", "llm_gateway_allow_from": ["10.0.0.0/8"]},
                    ["llm_gateway_bind is gw.lan: give the IP address the gateway binds"]),
    "network_not_cidr": ({"llm_gateway_allow_from": ["everyone"]},
                         ["llm_gateway_allow_from names everyone: give networks as address/prefix"]),
    "port_zero": ({"llm_gateway_port": 0}, ["give ports from 1 to 65535"]),
    "exposed": ({"llm_gateway_bind": "0.0.0.0"}, ["llm_gateway_bind is 0.0.0.0, which other machines can reach"]),
    "port_taken": ({"llm_gateway_port": "taken"},
                   ["is taken on port_taken by", "not by llm-gateway.service: stop it or give the gateway other ports"]),
    "metrics_port_taken": ({"llm_gateway_metrics_port": "taken"}, ["is taken on metrics_port_taken by"]),
    "route_not_answering": ({"llm_gateway_routes": "dead"},
                            ["gateway route tiny -> box b1 (127.0.0.1:", "nothing accepts connections there"]),
}


def route(port: int, **changes: object) -> dict:
    return {"model": "tiny", "box": "b1", "service": "llama-tiny", "host": "127.0.0.1", "port": port, "local": True,
            **changes}


def test_llm_gateway_preflight(tmp_path):
    ports = listening()
    server, taken, metrics_taken = next(ports), next(ports), next(ports)
    served = server.getsockname()[1]
    try:
        routes = {"no_box": [route(served, box="")], "twice": [route(served), route(served, box="b2")],
                  "dead": [route(free_port())]}
        cases = {}
        for name, (variables, _) in GATEWAY_CASES.items():
            case = {"llm_gateway_routes": [route(served)], "llm_gateway_api_key": KEY, "llm_gateway_port": free_port(),
                    "llm_gateway_metrics_port": free_port(), "llm_gateway_route_wait_s": 1, **variables}
            if isinstance(case["llm_gateway_routes"], str):
                case["llm_gateway_routes"] = routes[case["llm_gateway_routes"]]
            if case["llm_gateway_port"] == "taken":
                case["llm_gateway_port"] = taken.getsockname()[1]
            if case["llm_gateway_metrics_port"] == "taken":
                case["llm_gateway_metrics_port"] = metrics_taken.getsockname()[1]
            if case["llm_gateway_metrics_port"] == "same":
                case["llm_gateway_metrics_port"] = case["llm_gateway_port"]
            cases[name] = case
        outcome = run_preflights(tmp_path, "llm_gateway", cases)
    finally:
        for listener in (server, taken, metrics_taken):
            listener.close()
    for name, (_, texts) in GATEWAY_CASES.items():
        if texts is None:
            assert outcome[name] is None, f"{name}: {outcome[name]}"
        else:
            expect(outcome, name, *texts)
    expect(outcome, "port_taken", f"llm_gateway_port {cases['port_taken']['llm_gateway_port']} is taken")
    expect(outcome, "metrics_port_taken",
           f"llm_gateway_metrics_port {cases['metrics_port_taken']['llm_gateway_metrics_port']} is taken")


# ---------------------------------------------------------------------------------------------------- thermal_guard

GUARD_BASE = {"thermal_guard_enabled": True, "thermal_guard_services": ["llama-a.service"]}
GUARD_CASES = {
    "good": ({"thermal_guard_power_limit_w": 150}, None),
    "good_per_gpu": ({"thermal_guard_power_limit_w": {0: 120, 1: 300}}, None),
    "stop_too_hot": ({"thermal_guard_stop_c": 120}, ["thermal guard stop_c 120 out of range"]),
    "resume_too_cold": ({"thermal_guard_resume_c": 20}, ["thermal guard resume_c 20 out of range"]),
    "interval_zero": ({"thermal_guard_interval_s": 0}, ["thermal guard interval_s 0 out of range"]),
    "restarts_many": ({"thermal_guard_max_restarts": 101}, ["thermal guard max_restarts 101 out of range"]),
    "out_of_order": ({"thermal_guard_warn_c": 85, "thermal_guard_stop_c": 85},
                     ["thermal guard thresholds out of order: warn 85 °C, stop 85 °C"]),
    "service_not_a_unit": ({"thermal_guard_services": ["llama a; reboot"]}, ["thermal_guard_services: give service names"]),
    "limit_not_watts": ({"thermal_guard_power_limit_w": "150W"}, ["thermal_guard_power_limit_w value 150W (for all GPUs)"]),
    "limit_too_high": ({"thermal_guard_power_limit_w": 2000}, ["value 2000 (for all GPUs): give whole watts from 1 to 1000"]),
    "limit_for_a_name": ({"thermal_guard_power_limit_w": {"first": 150}}, ["names first, which is not a GPU index"]),
    "windows_limit": ({"pf_windows": True, "thermal_guard_power_limit_w": 150},
                      ["power_limit_w is applied by a Linux boot unit; this Windows box gets none"]),
    "no_nvidia_smi": ({"thermal_guard_power_limit_w": 150, "pf_nvidia_smi": "/nonexistent/nvidia-smi"},
                      ["power_limit_w is set, but nvidia-smi does not answer on this box"]),
    "gpu_missing": ({"thermal_guard_power_limit_w": {3: 150}},
                    ["power_limit_w names GPU 3, which this box does not have (GPUs: 0, 1)"]),
    "outside_card_range": ({"thermal_guard_power_limit_w": {1: 350}},
                           ["power_limit_w 350 for GPU 1 is outside what the card allows (100-300 W)"]),
    "no_card_range": ({"thermal_guard_power_limit_w": {2: 150}, "pf_no_range": True},
                      ["power_limit_w 150 for GPU 2: the card reports no power range"]),
}


def test_thermal_guard_preflight(tmp_path):
    """The card's power range comes from the lab's stand-in nvidia-smi: two V100 PCIe cards (100-300 W); the
    no_card_range case gets a third card that reports none."""
    cards = [{"index": i, "power.min_limit": "100.00", "power.max_limit": "300.00", "power.default_limit": "250.00"}
             for i in (0, 1)]
    smi = {}
    for kind, rows in (("cards", cards), ("no_range", [*cards, {"index": 2}])):
        folder = tmp_path / kind
        folder.mkdir()
        (folder / standin_smi.POWER_FILE).write_text(standin_smi.power_csv(rows))
        smi[kind] = folder / "nvidia-smi"
        smi[kind].write_text(standin_smi.standin_script(capture_dir=str(folder), call_log=str(folder / "calls")))
        smi[kind].chmod(0o755)
    cases = {name: {**GUARD_BASE, "pf_nvidia_smi": str(smi["no_range" if variables.get("pf_no_range") else "cards"]),
                    **variables} for name, (variables, _) in GUARD_CASES.items()}
    outcome = run_preflights(tmp_path, "thermal_guard", cases,
                             task_vars={"_thermal_guard_nvidia_smi": "{{ pf_nvidia_smi }}"})
    for name, (_, texts) in GUARD_CASES.items():
        if texts is None:
            assert outcome[name] is None, f"{name}: {outcome[name]}"
        else:
            expect(outcome, name, *texts)
