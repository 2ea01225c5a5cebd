#!/usr/bin/python
from __future__ import annotations

DOCUMENTATION = r"""
---
module: llama_burn_in
short_description: Load a box's llama servers for a while and watch its GPUs, services and boot
description:
  - For I(duration_s) seconds keeps I(concurrency) streaming chat requests in flight to every service, each
    worker alternating the OpenAI API (C(/v1/chat/completions)) and the Anthropic API (C(/v1/messages)), and
    records every finished request's generation speed (tokens after the first over the time between the first
    and the last streamed token, the same measure on both APIs).
  - Every I(sample_interval_s) samples every GPU with C(nvidia-smi --query-gpu) (core and memory temperature,
    power and its limit, clocks, the active clock throttle reasons). A box without C(nvidia-smi) is burnt in
    without GPU samples (C(gpu_sampled) false); that is not a problem.
  - Reads the kernel's boot id and each service's C(NRestarts) and C(InvocationID) before and after.
  - Returns the measurements and C(problems), one sentence each for thermal or power throttling, a reboot, a
    service restart and request errors. It does not fail on problems (the caller judges them); it fails only
    on bad options.
  - Sends load only and changes nothing, so it never reports changed; in check mode it sends nothing and returns
    the empty shape (see C(empty_result)).
  - Writes nothing to stdout before it finishes, so it runs under C(async)/C(poll) for long durations. A
    request still streaming at the end of the duration is allowed to finish (at most I(max_tokens) tokens).
  - Linux only (systemd, C(/proc)).
options:
  services:
    description: The llama servers to load.
    type: list
    elements: dict
    default: []
    suboptions:
      name:
        description: The service's name, without C(.service); also the key of C(series), C(requests), C(restarts).
        type: str
        required: true
      port:
        description: Its port on I(bind); not needed with I(base_url).
        type: int
      model:
        description: The model id it answers to (its C(--alias)).
        type: str
        required: true
      api_key:
        description: Its API key, sent as C(Authorization) (bearer) and C(x-api-key).
        type: str
        default: ""
      api_key_file:
        description: A file on the box whose first line is the key, read when I(api_key) is empty.
        type: str
        default: ""
      base_url:
        description: Its address, e.g. C(http://127.0.0.1:8001); default C(http://<bind>:<port>).
        type: str
        default: ""
  bind:
    description: The host the services listen on; a wildcard (C(0.0.0.0), C(::)) is reached on loopback.
    type: str
    default: 127.0.0.1
  duration_s:
    description: Seconds of load (above 0).
    type: float
    required: true
  concurrency:
    description: Streaming requests kept in flight per service (1 to 8).
    type: int
    default: 2
  max_tokens:
    description: Tokens asked for per request.
    type: int
    default: 64
  sample_interval_s:
    description: Seconds between GPU samples (above 0).
    type: float
    default: 5
  nvidia_smi:
    description: The absolute path of C(nvidia-smi) (the module runs as root and never looks it up on C(PATH)).
    type: path
    default: /usr/bin/nvidia-smi
  timeout:
    description: Seconds a request may wait for its next streamed line.
    type: int
    default: 120
  tolerated_throttle:
    description:
      - Throttle reasons that are not problems, e.g. C(sw_power_cap) on a box whose fleet sets a GPU power
        limit on purpose. They are still listed in the samples.
    type: list
    elements: str
    default: []
    choices: [sw_power_cap, hw_slowdown, sw_thermal, hw_thermal, hw_power_brake]
  boot_id_before:
    description:
      - A boot id read earlier (e.g. before provisioning); when set it is C(boot_id.before), so a reboot since
        then is caught. A reboot during the module would end the module itself.
    type: str
    default: ""
author: v100box maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Burn the box in for 25 minutes
  v100box.llm.llama_burn_in:
    services:
      - {name: llama-gemma, port: 8011, model: gemma4-26b-a4b-qat-q4_0, api_key_file: /etc/llama/gemma.key}
    duration_s: 1500
    concurrency: 2
  async: 1800
  poll: 15
  register: burn_in
"""

RETURN = r"""
duration_s:
  description: Seconds the load ran (until the last request finished).
  type: float
  returned: always
samples:
  description:
    - One entry per GPU sample; C(t) is seconds since the load started. A field nvidia-smi reports as
      C([N/A]) is null. C(throttle) names only the reasons that slow the clocks (sw_power_cap, hw_slowdown,
      sw_thermal, hw_thermal, hw_power_brake; an unknown bit as C(unknown_0x...)); idle, application clocks,
      sync boost and display clocks are not throttling.
  type: list
  elements: dict
  returned: always
  sample: [{t: 5.0, gpus: [{index: 0, temp_c: 71, memory_temp_c: 74, power_w: 98.4, power_limit_w: 100,
            sm_clock_mhz: 1380, mem_clock_mhz: 877, throttle: [sw_power_cap]}]}]
series:
  description: By service, each finished request's generation speed, in the order they finished.
  type: dict
  returned: always
  sample: {llama-gemma: [{t: 1.8, tok_s: 98.7}, {t: 2.1, tok_s: 97.9}]}
requests:
  description: By service, requests that finished with a reply and that failed, with the first few distinct failures.
  type: dict
  returned: always
  sample: {llama-gemma: {ok: 512, errors: 1, messages: ["/v1/messages: stream ended before message_stop"]}}
boot_id:
  description: The kernel's boot id before and after (C(/proc/sys/kernel/random/boot_id)); null if unreadable.
  type: dict
  returned: always
restarts:
  description: By service, systemd's C(NRestarts) before and after, and whether its C(InvocationID) changed.
  type: dict
  returned: always
  sample: {llama-gemma: {before: 0, after: 0, invocation_changed: false}}
problems:
  description: One sentence per problem seen; empty when the burn-in passed.
  type: list
  elements: str
  returned: always
gpu_sampled:
  description: Whether nvidia-smi answered at least one sample.
  type: bool
  returned: always
"""

import json
import os
import subprocess
import threading
import time
from urllib.error import HTTPError, URLError

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.v100box.llm.plugins.module_utils.fetch import open_url
from ansible_collections.v100box.llm.plugins.module_utils.hosts import reachable_host
from ansible_collections.v100box.llm.plugins.module_utils.llama_api import (
    error_text,
    http_error_text,
    read_key_file,
    sse_events,
)
from ansible_collections.v100box.llm.plugins.module_utils.systemd import show_properties

# The contract with lab/standin_smi.py and the thermal guard: these fields, in this order.
SAMPLE_QUERY = ("index,uuid,temperature.gpu,temperature.memory,power.draw,power.limit,clocks.sm,clocks.mem,"
                "clocks_throttle_reasons.active")
SAMPLE_FIELDS = ("index", None, "temp_c", "memory_temp_c", "power_w", "power_limit_w", "sm_clock_mhz",
                 "mem_clock_mhz")  # None: the uuid, asked so a row is whole, not returned
# NVML's nvmlClocksThrottleReasons bits (nvml.h), the value of clocks_throttle_reasons.active
THROTTLE_BITS = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal"),
    (0x40, "hw_thermal"),
    (0x80, "hw_power_brake"),
    (0x100, "display_clocks_setting"),
)
# Reasons that hold the clocks below what the load asks for; the others are settings or an idle card.
THROTTLING = ("sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")
MAX_CONCURRENCY = 8
MESSAGES_KEPT = 5
MESSAGE_CHARS = 300
BOOT_ID = "/proc/sys/kernel/random/boot_id"
PROMPT = ("Write a long, detailed story about a lighthouse keeper who repairs an old radio during a storm. "
          "Keep writing until you are stopped.")
APIS = ("openai", "anthropic")
PATHS = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages"}
DONE_MARK = {"openai": "[DONE]", "anthropic": "message_stop"}


def empty_result(service_names):
    """The module's answer before anything is measured: every field of the contract, per service where keyed."""
    return {
        "duration_s": 0.0,
        "samples": [],
        "series": {name: [] for name in service_names},
        "requests": {name: {"ok": 0, "errors": 0, "messages": []} for name in service_names},
        "boot_id": {"before": None, "after": None},
        "restarts": {name: {"before": None, "after": None, "invocation_changed": False} for name in service_names},
        "problems": [],
        "gpu_sampled": False,
    }


# ---- pure parts ------------------------------------------------------------------------------------------------

def _value(text):
    """A CSV cell of ``--format=csv,noheader,nounits``: a number, or None for [N/A], N/A, [Not Supported]..."""
    text = text.strip()
    try:
        number = float(text)
    except ValueError:
        return None
    return int(number) if number.is_integer() else number


def decode_throttle(mask):
    """The names of the bits set in clocks_throttle_reasons.active (``0x...``), lowest bit first; unknown bits
    as ``unknown_0x...``. None for a cell that is not a mask ([N/A])."""
    try:
        value = int(mask.strip(), 16)
    except ValueError:
        return None
    names = [name for bit, name in THROTTLE_BITS if value & bit]
    known = sum(bit for bit, _reason in THROTTLE_BITS)
    names += [f"unknown_{bit:#x}" for bit in (1 << n for n in range(64)) if value & bit and not bit & known]
    return names


def throttling(names):
    """The reasons among ``names`` that slow the clocks (unknown bits kept: nothing says they are harmless)."""
    return [name for name in names or [] if name in THROTTLING or name.startswith("unknown_")]


def parse_sample(text):
    """nvidia-smi's answer to SAMPLE_QUERY: one dict per GPU in the contract's fields (uuid dropped)."""
    gpus = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) < len(SAMPLE_FIELDS) + 1:
            continue
        gpu = {field: _value(cell) for field, cell in zip(SAMPLE_FIELDS, cells) if field}
        if gpu["index"] is None:
            continue
        gpu["throttle"] = throttling(decode_throttle(cells[len(SAMPLE_FIELDS)]))
        gpus.append(gpu)
    return gpus


def parse_show(text):
    """``systemctl show -p NRestarts -p InvocationID`` for one unit: (NRestarts or None, InvocationID)."""
    props = show_properties(text)[0]
    restarts = props.get("NRestarts", "").strip()
    return (int(restarts) if restarts.isdigit() else None), props.get("InvocationID", "").strip()


def generation_rate(tokens, first_at, last_at):
    """Tokens per second after the first token (its wait is prompt processing); None below two tokens."""
    if tokens is None or tokens < 2 or first_at is None or last_at is None or last_at <= first_at:
        return None
    return round((tokens - 1) / (last_at - first_at), 2)


def _list(names):
    return ", ".join(names)


def throttle_problems(samples, tolerated=()):
    """One sentence per GPU that throttled for a reason not tolerated: which reasons, in how many samples."""
    per_gpu = {}
    for sample in samples:
        for gpu in sample["gpus"]:
            seen = per_gpu.setdefault(gpu["index"], {"samples": 0, "throttled": 0, "reasons": [], "hottest": None,
                                                     "hottest_memory": None})
            seen["samples"] += 1
            for key, field in (("hottest", "temp_c"), ("hottest_memory", "memory_temp_c")):
                if gpu.get(field) is not None and (seen[key] is None or gpu[field] > seen[key]):
                    seen[key] = gpu[field]
            reasons = [name for name in gpu.get("throttle") or [] if name not in tolerated]
            if reasons:
                seen["throttled"] += 1
                seen["reasons"] += [name for name in reasons if name not in seen["reasons"]]
    problems = []
    for index, seen in sorted(per_gpu.items()):
        if not seen["throttled"]:
            continue
        heat = ""
        if seen["hottest"] is not None:
            heat = f"; hottest {seen['hottest']} °C"
            if seen["hottest_memory"] is not None:
                heat += f" (memory {seen['hottest_memory']} °C)"
        problems.append(f"GPU {index} throttled ({_list(seen['reasons'])}) in {seen['throttled']} of "
                        f"{seen['samples']} samples{heat}.")
    return problems


def boot_problem(boot_id):
    before, after = boot_id.get("before"), boot_id.get("after")
    if before and after and before != after:
        return [f"The box rebooted: its boot id changed from {before} to {after}."]
    return []


def restart_problems(restarts):
    problems = []
    for name, seen in sorted(restarts.items()):
        before, after = seen.get("before"), seen.get("after")
        if before is not None and after is not None and after > before:
            problems.append(f"Service {name} restarted during the burn-in (NRestarts {before} to {after}).")
        elif seen.get("invocation_changed"):
            problems.append(f"Service {name} was stopped or started again during the burn-in "
                            f"(its systemd invocation changed).")
    return problems


def request_problems(requests):
    problems = []
    for name, counts in sorted(requests.items()):
        total = counts["ok"] + counts["errors"]
        if counts["errors"]:
            first = counts["messages"][0] if counts["messages"] else "no message"
            problems.append(f"Service {name} failed {counts['errors']} of {total} requests (first: {first}).")
        elif not total:
            problems.append(f"Service {name} finished no request during the burn-in.")
    return problems


def smi_problem(failures, attempts):
    if not failures:
        return []
    return [f"nvidia-smi failed in {len(failures)} of {attempts} samples ({failures[0]})."]


def all_problems(result, tolerated=(), smi_failures=(), smi_attempts=0):
    """Every problem sentence for a finished result (see empty_result for its shape)."""
    return (throttle_problems(result["samples"], tolerated) + boot_problem(result["boot_id"])
            + restart_problems(result["restarts"]) + request_problems(result["requests"])
            + smi_problem(list(smi_failures), smi_attempts))


# ---- the box: boot id, units, nvidia-smi -----------------------------------------------------------------------

def _run(argv, timeout=30):
    """(rc, stdout, stderr) of a command, C locale; rc 127 when it is not there."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                              env=dict(os.environ, LC_ALL="C"))
    except FileNotFoundError:
        return 127, "", f"{argv[0]} not found"
    except subprocess.TimeoutExpired:
        return 124, "", f"{argv[0]} did not answer in {timeout} s"
    return done.returncode, done.stdout, done.stderr


def read_boot_id():
    try:
        with open(BOOT_ID, encoding="ascii") as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def read_unit(name):
    rc, out, _err = _run(["systemctl", "show", name + ".service", "-p", "NRestarts", "-p", "InvocationID"])
    return parse_show(out) if rc == 0 else (None, "")


def find_smi(path="/usr/bin/nvidia-smi"):
    # Where the driver installs it (or where the caller says); run as root, so never looked up on PATH.
    return path if os.access(path, os.X_OK) else None


def sample_gpus(smi):
    """(gpus, error): one nvidia-smi call."""
    rc, out, err = _run([smi, "--query-gpu=" + SAMPLE_QUERY, "--format=csv,noheader,nounits"])
    if rc != 0:
        return None, f"exit {rc}: " + " ".join((err or out).split())[:MESSAGE_CHARS]
    gpus = parse_sample(out)
    if not gpus and out.strip():
        return None, "unreadable answer: " + " ".join(out.split())[:MESSAGE_CHARS]
    return gpus, ""


# ---- the load --------------------------------------------------------------------------------------------------

class RequestFailed(Exception):
    pass


def read_stream(api, response, clock=time.monotonic):
    """Consume one streamed reply: (tokens, first token time, last token time); RequestFailed when it errs or
    ends before its done mark. Tokens are the server's own count (usage) when it sends one, else the chunks."""
    chunks, counted, first_at, last_at = 0, None, None, None
    for event, data in sse_events(response):
        if data == DONE_MARK["openai"] and api == "openai":
            break
        if not isinstance(data, dict):
            continue
        if event == "error" or data.get("type") == "error" or "error" in data:
            raise RequestFailed("error in the stream: " + (error_text(data) or json.dumps(data)[:MESSAGE_CHARS]))
        if api == "openai":
            delta = ((data.get("choices") or [{}])[0].get("delta") or {})
            text = delta.get("content") or delta.get("reasoning_content")
            counted = (data.get("usage") or {}).get("completion_tokens", counted)
        else:
            kind = data.get("type")
            delta = data.get("delta") or {}
            text = (delta.get("text") or delta.get("thinking") or delta.get("partial_json")
                    if kind == "content_block_delta" else None)
            if kind == "message_delta":
                counted = (data.get("usage") or {}).get("output_tokens", counted)
            if kind == "message_stop":
                break
        if text:
            chunks += 1
            last_at = clock()
            first_at = last_at if first_at is None else first_at
    else:
        raise RequestFailed(f"stream ended before {DONE_MARK[api]}")
    return (counted if counted else chunks), first_at, last_at


def one_request(service, api, max_tokens, timeout):
    """Send one streaming request; (tokens, first token time, last token time) or RequestFailed."""
    path = PATHS[api]
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if service["api_key"]:
        headers.update({"Authorization": "Bearer " + service["api_key"], "x-api-key": service["api_key"]})
    body = {"model": service["model"], "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "user", "content": PROMPT}]}
    if api == "openai":
        body["stream_options"] = {"include_usage": True}
    else:
        headers["anthropic-version"] = "2023-06-01"
    try:
        response = open_url(service["base_url"].rstrip("/") + path, data=json.dumps(body).encode(), method="POST",
                            headers=headers, timeout=timeout)
        try:
            return read_stream(api, response)
        finally:
            response.close()
    except HTTPError as exc:
        detail = http_error_text(exc)
        raise RequestFailed(f"HTTP {exc.code}" + (f": {detail}" if detail else "")) from None
    except (URLError, OSError) as exc:
        raise RequestFailed(str(getattr(exc, "reason", exc))) from None


class BurnIn:
    """The workers and the GPU sampler of one burn-in; results go into ``result`` under one lock."""

    def __init__(self, services, duration_s, concurrency, max_tokens, sample_interval_s, timeout, smi):
        self.services, self.duration_s, self.concurrency = services, duration_s, concurrency
        self.max_tokens, self.interval, self.timeout, self.smi = max_tokens, sample_interval_s, timeout, smi
        self.result = empty_result([service["name"] for service in services])
        self.smi_failures, self.smi_attempts = [], 0
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.start = 0.0

    def elapsed(self):
        return round(time.monotonic() - self.start, 2)

    def work(self, service, first_api):
        name, api = service["name"], first_api
        deadline = self.start + self.duration_s
        while time.monotonic() < deadline:
            try:
                tokens, first_at, last_at = one_request(service, api, self.max_tokens, self.timeout)
            except RequestFailed as exc:
                with self.lock:
                    counts = self.result["requests"][name]
                    counts["errors"] += 1
                    message = f"{PATHS[api]}: {exc}"[:MESSAGE_CHARS]
                    if len(counts["messages"]) < MESSAGES_KEPT and message not in counts["messages"]:
                        counts["messages"].append(message)
                # a refused or dead server answers at once: do not spin on it
                time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))
            else:
                rate = generation_rate(tokens, first_at, last_at)
                with self.lock:
                    self.result["requests"][name]["ok"] += 1
                    if rate is not None:
                        self.result["series"][name].append({"t": self.elapsed(), "tok_s": rate})
            api = APIS[(APIS.index(api) + 1) % len(APIS)]

    def sample(self):
        while True:
            t = self.elapsed()
            gpus, error = sample_gpus(self.smi)
            with self.lock:
                self.smi_attempts += 1
                if gpus is None:
                    self.smi_failures.append(error)
                else:
                    self.result["samples"].append({"t": t, "gpus": gpus})
            if self.done.wait(self.interval):
                return

    def run(self):
        self.start = time.monotonic()
        workers = [threading.Thread(target=self.work, args=(service, APIS[slot % len(APIS)]), daemon=True)
                   for service in self.services for slot in range(self.concurrency)]
        sampler = threading.Thread(target=self.sample, daemon=True) if self.smi else None
        for thread in workers + ([sampler] if sampler else []):
            thread.start()
        for thread in workers:
            thread.join()
        if not workers:
            time.sleep(self.duration_s)
        self.result["duration_s"] = round(time.monotonic() - self.start, 1)
        self.done.set()
        if sampler:
            sampler.join()
        self.result["gpu_sampled"] = bool(self.result["samples"])
        for series in self.result["series"].values():
            series.sort(key=lambda point: point["t"])
        return self.result


def burn_in(services, duration_s, concurrency, max_tokens, sample_interval_s, timeout, tolerated=(),
            boot_id_before="", nvidia_smi="/usr/bin/nvidia-smi"):
    """Read the box, load it, read it again; the module's whole answer."""
    before = {service["name"]: read_unit(service["name"]) for service in services}
    boot_before = boot_id_before or read_boot_id()
    run = BurnIn(services, duration_s, concurrency, max_tokens, sample_interval_s, timeout, find_smi(nvidia_smi))
    result = run.run()
    result["boot_id"] = {"before": boot_before, "after": read_boot_id()}
    for service in services:
        name = service["name"]
        (restarts_before, invocation_before), (restarts_after, invocation_after) = before[name], read_unit(name)
        result["restarts"][name] = {"before": restarts_before, "after": restarts_after,
                                    "invocation_changed": invocation_before != invocation_after}
    result["problems"] = all_problems(result, tolerated, run.smi_failures, run.smi_attempts)
    return result


def main():
    module = AnsibleModule(
        argument_spec=dict(
            services=dict(type="list", elements="dict", default=[], options=dict(
                name=dict(type="str", required=True),
                port=dict(type="int"),
                model=dict(type="str", required=True),
                api_key=dict(type="str", default="", no_log=True),
                api_key_file=dict(type="str", default=""),
                base_url=dict(type="str", default=""),
            )),
            bind=dict(type="str", default="127.0.0.1"),
            duration_s=dict(type="float", required=True),
            concurrency=dict(type="int", default=2),
            max_tokens=dict(type="int", default=64, no_log=False),
            sample_interval_s=dict(type="float", default=5),
            timeout=dict(type="int", default=120),
            tolerated_throttle=dict(type="list", elements="str", default=[], choices=list(THROTTLING)),
            boot_id_before=dict(type="str", default=""),
            nvidia_smi=dict(type="path", default="/usr/bin/nvidia-smi"),
        ),
        supports_check_mode=True,
    )
    params = module.params
    if params["duration_s"] <= 0:
        module.fail_json(msg=f"duration_s is {params['duration_s']}: give the burn-in's length in seconds, above 0")
    if not 1 <= params["concurrency"] <= MAX_CONCURRENCY:
        module.fail_json(msg=f"concurrency is {params['concurrency']}: give 1 to {MAX_CONCURRENCY} requests per "
                             f"service")
    for field in ("max_tokens", "sample_interval_s", "timeout"):
        if params[field] <= 0:
            module.fail_json(msg=f"{field} is {params[field]}: give a number above 0")
    services, names = [], set()
    for entry in params["services"]:
        if entry["name"] in names:
            module.fail_json(msg=f"service {entry['name']} is listed twice: name each service once")
        names.add(entry["name"])
        if not entry["base_url"] and not entry["port"]:
            module.fail_json(msg=f"service {entry['name']} has neither port nor base_url: give one")
        key = entry["api_key"]
        if not key and entry["api_key_file"]:
            try:
                key = read_key_file(entry["api_key_file"])
            except OSError as exc:
                module.fail_json(msg=f"cannot read the key file {entry['api_key_file']} of service "
                                     f"{entry['name']}: {exc.strerror}")
            if key:
                module.no_log_values.add(key)
        services.append({"name": entry["name"], "model": entry["model"], "api_key": key,
                         "base_url": entry["base_url"] or f"http://{reachable_host(params['bind'])}:{entry['port']}"})
    if module.check_mode:
        module.exit_json(changed=False, msg="check mode: no load sent", **empty_result(sorted(names)))
    result = burn_in(services, params["duration_s"], params["concurrency"], params["max_tokens"],
                     params["sample_interval_s"], params["timeout"], params["tolerated_throttle"],
                     params["boot_id_before"], params["nvidia_smi"])
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
