"""The gateway end to end: `controller provision` of a box with two models and a gateway (roles/llm_gateway,
HAProxy from Debian's packages, its own systemd unit) on the systemd target, then through the gateway: routing
by model name on both APIs, streams byte for byte as the server sent them, a ~500 KB body, unknown models,
wrong and missing keys (never logged), only the documented endpoints reaching a server, clients that stall
(keyless ones refused before their body, one address holding at most its share of the connections, stalled
requests timed out), a stopped service (an error naming model and box within a second), and the real Claude
Code CLI completing a turn. A route to a box with no plan, or to one nothing answers at, stops
provisioning with a line naming that box.

HAProxy comes from Debian 12's packages, fetched once on the host (cached under
~/.cache/v100-llm-box/debs/haproxy) and installed into the target before the run, like the firewall test's
nftables; the role's package task then finds it present.
"""

from __future__ import annotations

import json
import os
import re
import resource
import selectors
import shutil
import socket
import subprocess
import time
from functools import partial
from pathlib import Path

import httpx
import pytest
import yaml

from controller.model.clients import max_output_tokens
from lab import haproxy
from lab.claude_code import claude_binary, claude_env
from lab.fileserver import FileServer
from lab.site import PACK_NAME, LabModel, build_site
from lab.target import free_port
from tests.cli import run_controller

pytestmark = [pytest.mark.podman, pytest.mark.engine, pytest.mark.slow]

API_KEY = "sk-gw-box-key-never-logged-7373"
GATEWAY_KEY = "sk-gw-gateway-key-never-logged-9191"
WRONG_KEY = "sk-gw-wrong-key-never-logged-5151"
# Trained (in their headers) for a context Claude Code fits in; build_site writes them from these recipes. Scripted
# (as the demo box's model): Claude Code's turn ends with the model's answer. A random model ends its replies where
# sampling happens to stop: the same turn took 15 s in one full run and 105 s in the next.
MODELS = (LabModel("tiny-gw-a", "tiny-gw-a-q8_0.gguf", "llama", n_ctx_train=65536, scripted=True),
          LabModel("tiny-gw-b", "tiny-gw-b-q8_0.gguf", "llama", n_ctx_train=65536, scripted=True))
CTX = 32768  # Claude Code's system prompt and tools are ~15k tokens

controller = partial(run_controller, timeout=900)
DEFAULTS = yaml.safe_load((Path(__file__).resolve().parents[2] / "ansible_collections/v100box/llm/roles/llm_gateway/defaults/main.yml").read_text())


@pytest.fixture(scope="module")
def box(systemd_target):
    folder = haproxy.debs()
    subprocess.run(["podman", "cp", str(folder), f"{systemd_target.name}:/root/haproxy-debs"], check=True)
    systemd_target.exec("DEBIAN_FRONTEND=noninteractive dpkg --install /root/haproxy-debs/*.deb", timeout=300)
    return systemd_target


@pytest.fixture(scope="module")
def site(lab_site, tmp_path_factory):
    """The lab's engine pack and two generated models trained for a context Claude Code fits in."""
    lab_root, _catalog = lab_site
    root = tmp_path_factory.mktemp("gw-site")
    (root / "engines").mkdir()
    shutil.copy(lab_root / "engines" / PACK_NAME, root / "engines" / PACK_NAME)
    catalog = build_site(root, MODELS)
    with FileServer(root) as server:
        yield server, catalog


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, site, box):
    server, catalog = site
    folder = tmp_path_factory.mktemp("gw-fleet")
    for name, key in (("api_key", API_KEY), ("gateway_key", GATEWAY_KEY), ("far_key", "sk-far-box-key-0123456789")):
        (folder / name).write_text(key)
    gateway = {"port": free_port(), "metrics_port": free_port(), "api_key": {"file": str(folder / "gateway_key")}}
    boxes = {
        "gw": {
            "address": box.host, "port": box.ssh_port, "user": "root", "key": str(box.key),
            "models": [{"id": model.id, "ctx": CTX} for model in MODELS], "base_port": free_port(),
            "api_key": {"file": str(folder / "api_key")},
            "mirror": {"engines": f"{server.url}/engines", "models": server.url},
            "gateway": {**gateway, "boxes": ["far"]},
        },
        # Another box of the fleet the gateway routes to; it binds beyond loopback, nothing answers there.
        "far": {"address": "127.0.0.1", "port": free_port(), "key": str(box.key), "bind": "0.0.0.0",
                "allow_from": ["127.0.0.0/8"], "api_key": {"file": str(folder / "far_key")},
                "models": [{"id": "tiny-far"}]},
    }
    with_far = folder / "fleet-far.yml"
    with_far.write_text(yaml.safe_dump({"catalogs": [str(catalog)], "boxes": boxes}))
    boxes["gw"]["gateway"] = gateway
    plain = folder / "fleet.yml"
    plain.write_text(yaml.safe_dump({"catalogs": [str(catalog)], "boxes": boxes}))
    return {"plain": plain, "far": with_far, "inventory": folder / "inventory", "gateway": gateway}


def _provision(fleet_file: Path, inventory: Path) -> subprocess.CompletedProcess[str]:
    return controller("provision", "gw", "--fleet", str(fleet_file), "--inventory", str(inventory), "--json")


def _summary(done: subprocess.CompletedProcess[str]) -> dict:
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return next((line for line in lines if line.get("type") == "summary"), {})


def test_route_to_a_box_without_a_plan_names_it(fleet):
    done = _provision(fleet["far"], fleet["inventory"])
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]
    assert "gateway routes to box far, which has no plan" in done.stderr
    assert "Traceback" not in done.stderr


def test_route_to_an_unreachable_box_stops_provisioning_naming_it(fleet):
    from controller.model.serveplan import ServePlan, Service

    port = free_port()  # nothing listens there
    plan = ServePlan(fits=True, services=[Service(name="llama-tiny-far", model="tiny-far", model_file="x.gguf",
                                                  engine="cpu-0c1e570", ctx=2048, port=port, host="0.0.0.0")])
    plans = fleet["inventory"] / "plans"
    plans.mkdir(parents=True, exist_ok=True)
    (plans / "far.json").write_text(plan.model_dump_json())
    done = _provision(fleet["far"], fleet["inventory"])
    assert done.returncode == 5, done.stdout[-2000:] + done.stderr[-2000:]
    output = done.stdout + done.stderr
    assert f"gateway route tiny-far -> box far (127.0.0.1:{port}): nothing accepts connections" in output, output[-3000:]


@pytest.fixture(scope="module")
def gateway(fleet, box):
    done = _provision(fleet["plain"], fleet["inventory"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return f"http://127.0.0.1:{fleet['gateway']['port']}"


def _plan(fleet) -> dict:
    return json.loads((fleet["inventory"] / "plans" / "gw.json").read_text())


def _chat(model: str, **extra) -> dict:
    return {"model": model, "max_tokens": 6, "temperature": 0, "seed": 3,
            "messages": [{"role": "user", "content": "hello there"}], **extra}


def _stream(url: str, body: dict, key: str) -> bytes:
    with httpx.stream("POST", url, json=body, timeout=60, headers={"Authorization": f"Bearer {key}",
                                                                    "anthropic-version": "2023-06-01"}) as response:
        assert response.status_code == 200, response.read()
        return b"".join(response.iter_raw())


def _normalized(stream: bytes) -> bytes:
    """A stream without what differs from one request to the next (ids, timestamps, timings)."""
    return re.sub(rb'"(id|created|timings)":("[^"]*"|\d+|\{[^}]*\})', b"", stream)


def test_routes_both_apis_by_model_and_streams_untouched(gateway, fleet, box):
    plan = _plan(fleet)
    assert [route["model"] for route in plan["gateway"]["routes"]] == ["tiny-gw-a", "tiny-gw-b"]
    direct = {service["model"]: f"http://127.0.0.1:{service['port']}" for service in plan["services"]}
    headers = {"Authorization": f"Bearer {GATEWAY_KEY}"}
    for model in ("tiny-gw-a", "tiny-gw-b"):
        chat = httpx.post(f"{gateway}/v1/chat/completions", json=_chat(model), headers=headers, timeout=60)
        assert chat.status_code == 200 and chat.json()["model"] == model, chat.text
        message = httpx.post(f"{gateway}/v1/messages", json=_chat(model), timeout=60,
                             headers={"x-api-key": GATEWAY_KEY, "anthropic-version": "2023-06-01"})
        assert message.status_code == 200 and message.json()["model"] == model, message.text
        for path in ("/v1/chat/completions", "/v1/messages"):
            through = _stream(f"{gateway}{path}", _chat(model, stream=True), GATEWAY_KEY)
            straight = _stream(f"{direct[model]}{path}", _chat(model, stream=True), API_KEY)
            assert b"data: " in through and _normalized(through) == _normalized(straight), (through[:400], straight[:400])
    models = httpx.get(f"{gateway}/v1/models", headers=headers, timeout=10).json()
    assert [entry["id"] for entry in models["data"]] == ["tiny-gw-a", "tiny-gw-b"]
    assert httpx.get(f"{gateway}/health", timeout=10).status_code == 200
    metrics = httpx.get(f"http://127.0.0.1:{fleet['gateway']['metrics_port']}/metrics", timeout=10).text
    assert "haproxy_backend_http_responses_total" in metrics
    # Its own unit, run by a dynamic user; the keys at rest are root's alone.
    assert box.exec("systemctl is-active llm-gateway.service").strip() == "active"
    assert box.exec("stat -c '%U %a' /etc/llm-gateway/secrets /etc/llm-gateway/secrets/api-key "
                    "/etc/llm-gateway/secrets/server-keys.map").split("\n")[:3] == ["root 700", "root 600", "root 600"]


def test_a_500_kb_body_reaches_the_server_whole(gateway, fleet):
    service = next(s for s in _plan(fleet)["services"] if s["model"] == "tiny-gw-b")
    filler = "lorem ipsum " * 42_000
    # "model" after the long part: the gateway still finds it, and the server counts every token of it.
    body = {"messages": [{"role": "user", "content": filler}], "max_tokens": 1, "model": "tiny-gw-b"}
    assert 480_000 < len(json.dumps(body)) < 600_000
    through = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=120,
                         headers={"Authorization": f"Bearer {GATEWAY_KEY}"})
    straight = httpx.post(f"http://127.0.0.1:{service['port']}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert straight.status_code == 400 and "exceeds the available context size" in straight.text
    assert through.status_code == 400 and through.json()["error"]["n_prompt_tokens"] == \
        straight.json()["error"]["n_prompt_tokens"], through.text


def test_unknown_model_lists_the_served_ids(gateway):
    for path in ("/v1/chat/completions", "/v1/messages"):
        response = httpx.post(f"{gateway}{path}", json=_chat("no-such-model"), timeout=10,
                              headers={"x-api-key": GATEWAY_KEY})
        assert response.status_code == 404
        assert response.json()["error"]["message"] == (
            'gateway: model "no-such-model" is not served here; served models: tiny-gw-a, tiny-gw-b')


def test_wrong_or_missing_key_is_401_and_never_logged(gateway, box):
    for headers in ({}, {"x-api-key": WRONG_KEY}, {"Authorization": f"Bearer {WRONG_KEY}"},
                    {"Authorization": f"Bearer {API_KEY}"}):  # the servers' key is not the gateway's
        response = httpx.post(f"{gateway}/v1/messages", json=_chat("tiny-gw-a"), headers=headers, timeout=10)
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    journal = box.exec("journalctl -u llm-gateway.service --no-pager -o cat")
    assert "POST /v1/messages" in journal  # requests are logged ...
    for secret in (GATEWAY_KEY, WRONG_KEY, API_KEY):  # ... their keys never
        assert secret not in journal
    assert GATEWAY_KEY not in box.exec("cat /etc/llm-gateway/haproxy.cfg; ps -eo args")


def test_only_the_documented_endpoints_reach_a_server(gateway):
    headers = {"x-api-key": GATEWAY_KEY}
    # Each of these the server answers (with the server's key the gateway would add), each names a served model.
    for method, path, body in (("POST", "/tokenize", {"model": "tiny-gw-a", "content": "hello"}),
                               ("GET", "/props", None), ("POST", "/props", {"model": "tiny-gw-a"}),
                               ("GET", "/metrics", None), ("GET", "/slots", None),
                               ("POST", "/v1/embeddings", {"model": "tiny-gw-a", "input": "hello"}),
                               ("POST", "/v1/responses", {"model": "tiny-gw-a", "input": "hello"}),
                               ("GET", "/v1/chat/completions", {"model": "tiny-gw-a"})):
        response = httpx.request(method, f"{gateway}{path}", json=body, headers=headers, timeout=10)
        assert response.status_code == 404, (method, path, response.text)
        error = response.json()["error"]
        assert error["type"] == "not_found_error" and error["message"].startswith(
            f"gateway: no endpoint {method} {path} here; the gateway serves POST /v1/chat/completions"), error
    assert httpx.get(f"{gateway}/props", timeout=10).status_code == 401  # without the key: the key check first
    counted = httpx.post(f"{gateway}/v1/messages/count_tokens", json=_chat("tiny-gw-a"), headers=headers, timeout=10)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0, counted.text


def _answers(sockets: list[socket.socket], wait: float) -> list[tuple[bytes, float | None]]:
    """Per connection, what the gateway sent and after how many seconds it closed it (None: still open)."""
    started = time.monotonic()
    received: list[bytes] = [b""] * len(sockets)
    closed: list[float | None] = [None] * len(sockets)
    with selectors.DefaultSelector() as selector:
        for index, sock in enumerate(sockets):
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, index)
        while selector.get_map() and time.monotonic() < started + wait:
            for key, _events in selector.select(timeout=0.2):
                try:
                    data = key.fileobj.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                received[key.data] += data
                if not data:
                    closed[key.data] = time.monotonic() - started
                    selector.unregister(key.fileobj)
    return list(zip(received, closed))


def _keyed(gateway: str) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = httpx.post(f"{gateway}/v1/chat/completions", json=_chat("tiny-gw-a"), timeout=10,
                          headers={"x-api-key": GATEWAY_KEY})
    return response, time.monotonic() - started


def test_keyless_clients_that_never_send_their_body_hold_nothing(gateway, fleet):
    # More than the gateway's connections, from another address than the keyed client's.
    assert DEFAULTS["llm_gateway_maxconn"] < 1100
    descriptors = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert descriptors == resource.RLIM_INFINITY or descriptors >= 1100 + 256, (
        f"this process may open {descriptors} files; the test holds 1100 connections (raise `ulimit -n`)")
    head = b"POST /v1/messages HTTP/1.1\r\nHost: gw\r\ncontent-type: application/json\r\ncontent-length: 4096\r\n\r\n"
    slow = haproxy.stalled_clients(fleet["gateway"]["port"], 1100, "127.0.0.2", head + b'{"messages": [')
    try:
        response, elapsed = _keyed(gateway)
        assert response.status_code == 200 and elapsed < 3, (response.status_code, elapsed)
        answers = _answers(slow, wait=3)
        assert all(seconds is not None for _data, seconds in answers), "the gateway still waits on keyless clients"
        refused = [data for data, _seconds in answers if data]  # the others were closed as they arrived
        assert refused and all(data.startswith(b"HTTP/1.1 401") and b"authentication_error" in data
                               for data in refused), refused[:3]
    finally:
        for sock in slow:
            sock.close()


def test_one_address_holds_its_share_and_stalled_requests_time_out(gateway, fleet):
    share, limit_s = DEFAULTS["llm_gateway_maxconn_per_source"], DEFAULTS["llm_gateway_request_timeout_s"]
    port = fleet["gateway"]["port"]
    # Headers never finished, from one address: it gets its share of the connections, its next ones are closed.
    slow = haproxy.stalled_clients(port, share + 100, "127.0.0.3", b"POST /v1/messages HTTP/1.1\r\nHost: gw\r\n")
    closed_at_once = share + 100 - len(slow)
    # A keyed client whose body stalls before its model.
    head = (f"POST /v1/messages HTTP/1.1\r\nHost: gw\r\nx-api-key: {GATEWAY_KEY}\r\n"
            "content-type: application/json\r\ncontent-length: 4096\r\n\r\n").encode()
    stalled = haproxy.stalled_clients(port, 1, "127.0.0.1", head + b'{"messages": [')
    try:
        response, elapsed = _keyed(gateway)  # another address: not counted with 127.0.0.3's
        assert response.status_code == 200 and elapsed < 3, (response.status_code, elapsed)
        answers = _answers(slow + stalled, wait=limit_s + 5)
        held = [(data, seconds) for data, seconds in answers[:-1] if seconds is None or seconds > 1]
        assert len(held) == share and closed_at_once + len(answers) - 1 - len(held) == 100, (len(held), closed_at_once)
        assert all(seconds is not None and data.startswith(b"HTTP/1.1 408") for data, seconds in held), held[:3]
        data, seconds = answers[-1]
        assert seconds is not None and limit_s - 1 < seconds < limit_s + 3, seconds
        assert data.startswith(b"HTTP/1.1 408") and json.loads(data.split(b"\r\n\r\n", 1)[1])["error"] == {
            "type": "invalid_request_error", "message": f"gateway: the request did not arrive within {limit_s} s"}
    finally:
        for sock in slow + stalled:
            sock.close()


def test_a_stopped_service_is_an_error_naming_model_and_box_within_a_second(gateway, fleet, box):
    service = next(s for s in _plan(fleet)["services"] if s["model"] == "tiny-gw-b")
    box.exec(f"systemctl stop {service['name']}.service")
    try:
        started = time.monotonic()
        response = httpx.post(f"{gateway}/v1/chat/completions", json=_chat("tiny-gw-b"), timeout=30,
                              headers={"x-api-key": GATEWAY_KEY})
        elapsed = time.monotonic() - started
        assert response.status_code == 503, response.text
        assert "model tiny-gw-b on box gw" in response.json()["error"]["message"]
        assert elapsed < 1.0, elapsed
        # The other model is not affected.
        other = httpx.post(f"{gateway}/v1/chat/completions", json=_chat("tiny-gw-a"), timeout=60,
                           headers={"x-api-key": GATEWAY_KEY})
        assert other.status_code == 200
    finally:
        box.exec(f"systemctl start {service['name']}.service")
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{service['port']}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{service['name']} did not come back"
        time.sleep(0.5)


def test_claude_code_completes_a_turn_through_the_gateway(gateway, box, tmp_path):
    model = "tiny-gw-a"
    env = claude_env({
        "ANTHROPIC_BASE_URL": gateway, "ANTHROPIC_AUTH_TOKEN": GATEWAY_KEY, "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model, "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        # What `controller clients` gives a 32k service: a tiny random model ends its replies at a random
        # point, so a small cap (64 was tried) fails the turn with Claude Code's max_output_tokens error.
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens(32768)),
    }, home=tmp_path)
    since = box.exec("date '+%Y-%m-%d %H:%M:%S'").strip()
    done = subprocess.run([str(claude_binary()), "-p", "Say hello.", "--output-format", "json"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    result = json.loads(done.stdout)
    assert result["is_error"] is False and result["terminal_reason"] == "completed", done.stdout[-2000:]
    assert list(result["modelUsage"]) == [model]
    deadline = time.monotonic() + 15  # HAProxy logs to its stdout: journald may take a moment to have the line
    while True:
        journal = box.exec(f"journalctl -u llm-gateway.service --no-pager -o cat --since '{since}'")
        if re.search(r"route_1/gw .* 200 .*\"POST /v1/messages", journal) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert re.search(r"route_1/gw .* 200 .*\"POST /v1/messages", journal), journal[-2000:]


def test_a_second_run_changes_nothing(gateway, fleet):
    done = _provision(fleet["plain"], fleet["inventory"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    changed = [event["task"] for event in map(json.loads, (line for line in done.stdout.splitlines() if line.startswith("{")))
               if event.get("type") == "task" and event.get("status") == "changed"]
    assert changed == [] and _summary(done)["hosts"]["gw"]["changed"] == 0


def test_a_plan_without_the_gateway_removes_it(fleet, box, gateway):
    plain = yaml.safe_load(fleet["plain"].read_text())
    del plain["boxes"]["gw"]["gateway"]
    without = fleet["plain"].with_name("fleet-nogw.yml")
    without.write_text(yaml.safe_dump(plain))
    done = _provision(without, fleet["inventory"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    removal = [event["task"] for event in map(json.loads, (line for line in done.stdout.splitlines() if line.startswith("{")))
               if event.get("type") == "task" and event.get("status") == "changed"]
    assert box.run("systemctl cat llm-gateway.service").returncode != 0, removal
    assert box.run("ls -la /etc/llm-gateway").stdout == "", removal
    assert os.path.exists(fleet["inventory"] / "plans" / "gw.json")
