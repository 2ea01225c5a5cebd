#!/usr/bin/python
from __future__ import annotations

DOCUMENTATION = r"""
---
module: llama_api_check
short_description: Check that a llama-server answers both chat APIs as the expected model
description:
  - Calls C(/health), C(/v1/models), one C(/v1/chat/completions) (OpenAI API) and one C(/v1/messages)
    (Anthropic API) on a llama-server, in one module run, and reports what each answered.
  - Fails when the server is unhealthy, does not list I(model) among its ids, or either API does not
    answer with a reply.
  - With I(api_key) set, also sends one chat request without a key and one with a wrong key, and fails
    unless the server refuses both with HTTP 401. The chat endpoints are probed because ik_llama.cpp
    leaves C(/health) and C(/v1/models) open even with a key.
  - Read-only for the host; chat requests only generate a few tokens.
options:
  base_url:
    description: Address of the server, e.g. C(http://127.0.0.1:8001).
    type: str
    required: true
  model:
    description: Model id the server must answer to (its C(--alias)).
    type: str
    required: true
  api_key:
    description:
      - Key sent as C(Authorization: Bearer) and C(x-api-key) when the server requires one.
      - When set, requests without it and with a wrong key must be refused with HTTP 401.
    type: str
    default: ""
  api_key_file:
    description:
      - A file on the host whose first line is the key, read when I(api_key) is empty (the server's own key file,
        so the key never leaves the host).
    type: str
    default: ""
  prompt:
    description: User message sent through each API.
    type: str
    default: Say hello in five words.
  max_tokens:
    description: Tokens to ask for.
    type: int
    default: 16
  timeout:
    description: Seconds to wait for each reply.
    type: int
    default: 120
  chat:
    description:
      - Whether to send the chat turns (and the key probes). C(false) checks only C(/health) and C(/v1/models)
        with the key, which is what C(controller status) asks of every server on every run.
    type: bool
    default: true
author: v100-llm-box
"""

EXAMPLES = r"""
- name: Check the Gemma server
  llama_api_check:
    base_url: http://127.0.0.1:8011
    model: gemma4-26b-a4b-qat-q4_0
    api_key: "{{ llama_service_api_key }}"
"""

RETURN = r"""
# plugins/windows_modules/llama_api_check.ps1 (the Windows twin) returns the same fields; a test compares the lists.
health:
  description: The C(status) field of C(/health); C(unreachable) when a request got no usable answer.
  type: str
  returned: always
served_ids:
  description: Model ids listed by C(/v1/models).
  type: list
  elements: str
  returned: when the server is healthy
openai:
  description: What the OpenAI API (C(/v1/chat/completions)) answered.
  type: dict
  returned: when the server is healthy and I(chat) is true
  contains:
    object:
      description: The reply's C(object), C(chat.completion) when it answered.
      type: str
    completion_tokens:
      description: Tokens generated.
      type: int
    tokens_per_second:
      description: Decode speed the server reported (C(timings.predicted_per_second)).
      type: float
    text:
      description: The start of the reply (200 characters).
      type: str
anthropic:
  description: What the Anthropic API (C(/v1/messages)) answered.
  type: dict
  returned: when the server is healthy and I(chat) is true
  contains:
    type:
      description: The reply's C(type), C(message) when it answered.
      type: str
    output_tokens:
      description: Tokens generated.
      type: int
    stop_reason:
      description: Why generation stopped.
      type: str
    text:
      description: The start of the reply's text blocks (200 characters).
      type: str
auth:
  description: Whether the server checks its API key.
  type: dict
  returned: when the server is healthy and I(chat) is true
  sample: {required: true, anonymous_status: 401, wrong_key_status: 401}
  contains:
    required:
      description: Whether a key was set (and so had to be checked).
      type: bool
    anonymous_status:
      description: HTTP status of a chat request without the key (must be 401); only when required.
      type: int
    wrong_key_status:
      description: HTTP status of a chat request with a wrong key (must be 401); only when required.
      type: int
"""

import json
import secrets

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.six.moves.urllib.error import HTTPError, URLError
from ansible.module_utils.urls import open_url

TEXT_KEPT = 200


def call(base_url, path, headers, timeout, body=None):
    """One JSON request; returns the decoded body or raises RuntimeError with a short reason."""
    data = None if body is None else json.dumps(body).encode()
    all_headers = dict(headers, **({"Content-Type": "application/json"} if body is not None else {}))
    try:
        response = open_url(base_url.rstrip("/") + path, data=data, headers=all_headers,
                            method="GET" if body is None else "POST", timeout=timeout)
        return json.loads(response.read() or b"{}")
    except HTTPError as exc:
        raise RuntimeError(f"{path} answered HTTP {exc.code}") from None
    except (URLError, OSError) as exc:
        raise RuntimeError(f"{path}: {getattr(exc, 'reason', exc)}") from None
    except ValueError:
        raise RuntimeError(f"{path} did not answer JSON") from None


def status(base_url, path, headers, timeout, body):
    """The HTTP status a POST answers with (the body is not read)."""
    try:
        response = open_url(base_url.rstrip("/") + path, data=json.dumps(body).encode(), method="POST",
                            headers=dict(headers, **{"Content-Type": "application/json"}), timeout=timeout)
        return response.getcode()
    except HTTPError as exc:
        return exc.code
    except (URLError, OSError) as exc:
        raise RuntimeError(f"{path}: {getattr(exc, 'reason', exc)}") from None


def check_auth(base_url, model, api_key, timeout):
    """Without a key and with a wrong one, a server that has a key must answer 401; returns (auth, problems)."""
    if not api_key:
        return {"required": False}, []
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    wrong = "wrong-" + secrets.token_hex(8)
    auth = {
        "required": True,
        "anonymous_status": status(base_url, "/v1/chat/completions", {}, timeout, body),
        "wrong_key_status": status(base_url, "/v1/chat/completions",
                                   {"Authorization": "Bearer " + wrong, "x-api-key": wrong}, timeout, body),
    }
    problems = []
    for field, how in (("anonymous_status", "without a key"), ("wrong_key_status", "with a wrong key")):
        if auth[field] != 401:
            problems.append(f"/v1/chat/completions answered HTTP {auth[field]} {how}, not 401: the server does not "
                            f"check its API key")
    return auth, problems


def check(base_url, model, api_key, prompt, max_tokens, timeout, chat=True):
    """Run the four checks (the first two without ``chat``); returns (result, list of problems)."""
    headers = {"Authorization": "Bearer " + api_key, "x-api-key": api_key} if api_key else {}
    result = {"health": call(base_url, "/health", {}, timeout).get("status", "unknown")}
    problems = [] if result["health"] == "ok" else [f"/health says {result['health']}"]
    listed = call(base_url, "/v1/models", headers, timeout)
    result["served_ids"] = [item.get("id") for item in listed.get("data", [])]
    if model not in result["served_ids"]:
        problems.append(f"serves {result['served_ids']}, not {model}")
    if not chat:
        return result, problems
    messages = [{"role": "user", "content": prompt}]
    openai = call(base_url, "/v1/chat/completions", headers, timeout,
                  {"model": model, "messages": messages, "max_tokens": max_tokens})
    choice = (openai.get("choices") or [{}])[0].get("message") or {}
    result["openai"] = {
        "object": openai.get("object", ""),
        "completion_tokens": (openai.get("usage") or {}).get("completion_tokens", 0),
        "tokens_per_second": round((openai.get("timings") or {}).get("predicted_per_second", 0), 2),
        "text": (choice.get("content") or "")[:TEXT_KEPT],
    }
    if result["openai"]["object"] != "chat.completion":
        problems.append(f"the OpenAI API answered {result['openai']['object']!r}, not a chat.completion")
    anthropic = call(base_url, "/v1/messages", dict(headers, **{"anthropic-version": "2023-06-01"}), timeout,
                     {"model": model, "messages": messages, "max_tokens": max_tokens})
    result["anthropic"] = {
        "type": anthropic.get("type", ""),
        "output_tokens": (anthropic.get("usage") or {}).get("output_tokens", 0),
        "stop_reason": anthropic.get("stop_reason") or "",
        "text": "".join(part.get("text", "") for part in anthropic.get("content") or []
                        if part.get("type") == "text")[:TEXT_KEPT],
    }
    if result["anthropic"]["type"] != "message":
        problems.append(f"the Anthropic API answered {result['anthropic']['type']!r}, not a message")
    result["auth"], auth_problems = check_auth(base_url, model, api_key, timeout)
    return result, problems + auth_problems


def main():
    module = AnsibleModule(
        argument_spec=dict(
            base_url=dict(type="str", required=True),
            model=dict(type="str", required=True),
            api_key=dict(type="str", default="", no_log=True),
            api_key_file=dict(type="str", default=""),
            prompt=dict(type="str", default="Say hello in five words."),
            max_tokens=dict(type="int", default=16),
            timeout=dict(type="int", default=120),
            chat=dict(type="bool", default=True),
        ),
        supports_check_mode=True,
    )
    params = module.params
    api_key = params["api_key"]
    if not api_key and params["api_key_file"]:
        try:
            with open(params["api_key_file"], encoding="utf-8") as handle:
                api_key = (handle.read().splitlines() or [""])[0].strip()
        except OSError as exc:
            module.fail_json(msg=f"cannot read the key file {params['api_key_file']}: {exc.strerror}",
                             health="unknown")
        if api_key:
            module.no_log_values.add(api_key)
    try:
        result, problems = check(params["base_url"], params["model"], api_key, params["prompt"],
                                 params["max_tokens"], params["timeout"], params["chat"])
    except RuntimeError as exc:
        module.fail_json(msg=f"{params['base_url']}: {exc}", health="unreachable")
    if problems:
        module.fail_json(msg=f"{params['base_url']}: {'; '.join(problems)}", **result)
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
