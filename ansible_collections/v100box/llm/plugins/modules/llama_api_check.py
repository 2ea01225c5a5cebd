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
  - With I(certify), also makes a tool call round trip through C(/v1/messages) (a tool definition in with
    C(tool_choice) C(any), a C(tool_use) block out, its C(tool_result) back, a final message), streams one reply
    through each API to its end, and measures throughput with the server's own C(timings) for a fixed prompt.
    What these find is returned in C(tool_call), C(streams) and C(throughput), each with a C(detail) sentence;
    they do not fail the module (C(controller certify) judges them).
  - Read-only for the host; chat requests only generate a few tokens (the throughput request
    I(throughput_max_tokens)).
extends_documentation_fragment: [v100box.llm.llama_api_check]  # the options, shared with win_llama_api_check
author: v100box maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Check the Gemma server
  v100box.llm.llama_api_check:
    base_url: http://127.0.0.1:8011
    model: gemma4-26b-a4b-qat-q4_0
    api_key: "{{ llama_service_api_key }}"

- name: Certify the Gemma server (tool call, streams, throughput)
  v100box.llm.llama_api_check:
    base_url: http://127.0.0.1:8011
    model: gemma4-26b-a4b-qat-q4_0
    api_key_file: /etc/llama/keys/gemma.key
    certify: true
"""

RETURN = r"""
# plugins/modules/win_llama_api_check.ps1 (the Windows twin) returns the same fields; a test compares the lists.
health:
  description: The C(status) field of C(/health); C(unreachable) when a request got no usable answer.
  type: str
  returned: always
loaded_ids:
  description:
    - Model ids of C(/v1/models) that are loaded now (a router lists each model with its status; an ordinary
      server's model is loaded whenever it answers).
  type: list
  elements: str
  returned: when the server is healthy
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
    seconds:
      description:
        - Seconds from the request to the whole reply; for an on-demand model that was not loaded, its load too.
      type: float
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
tool_call:
  description: The tool call round trip through C(/v1/messages) (Anthropic API).
  type: dict
  returned: when the server is healthy and I(certify) is true
  sample: {ok: true, tool_use: true, tool_name: get_time, stop_reason: tool_use, final_stop_reason: end_turn,
           detail: "get_time was called (stop_reason 'tool_use'); its tool_result came back and the model answered
           (stop_reason 'end_turn')"}
  contains:
    ok:
      description: Whether a C(tool_use) block came out and the reply to its C(tool_result) was a message.
      type: bool
    tool_use:
      description: Whether the first reply held a C(tool_use) block.
      type: bool
    tool_name:
      description: The tool that block called; null without one.
      type: str
    stop_reason:
      description: The first reply's C(stop_reason) (C(tool_use) when the model called the tool); null without one.
      type: str
    final_stop_reason:
      description: The C(stop_reason) of the reply to the C(tool_result); null without one.
      type: str
    detail:
      description: What happened, in a sentence.
      type: str
streams:
  description: One streamed reply through each API, read to its end.
  type: dict
  returned: when the server is healthy and I(certify) is true
  contains:
    openai:
      description:
        - C(/v1/chat/completions) with C(stream) true. C(ok) (chunks came, then the C([DONE]) event), C(chunks)
          (data events before it), C(done) (whether C([DONE]) came) and C(detail).
      type: dict
    anthropic:
      description:
        - C(/v1/messages) with C(stream) true. C(ok) (events came, the last a C(message_stop), no C(error)),
          C(events) (data events), C(message_stop) (whether it came) and C(detail).
      type: dict
throughput:
  description:
    - The server's own C(timings) for the fixed prompt (see I(throughput_max_tokens)) through C(/v1/chat/completions),
      the medians of I(throughput_runs) requests; the numbers are null when the server gave none.
  type: dict
  returned: when the server is healthy and I(certify) is true
  contains:
    prompt_tokens:
      description: Prompt tokens the server processed (C(timings.prompt_n)).
      type: int
    prompt_per_second:
      description: Prompt processing speed (C(timings.prompt_per_second)).
      type: float
    predicted_tokens:
      description: Tokens generated (C(timings.predicted_n)).
      type: int
    predicted_per_second:
      description: Generation speed (C(timings.predicted_per_second)).
      type: float
    detail:
      description: What was measured, or why nothing was, in a sentence.
      type: str
"""

import json
import secrets
import time
from statistics import median

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.six.moves.urllib.error import HTTPError, URLError

from ansible_collections.v100box.llm.plugins.module_utils.fetch import open_url
from ansible_collections.v100box.llm.plugins.module_utils.llama_api import (
    error_text,
    http_error_text,
    read_key_file,
    sse_events,
)

TEXT_KEPT = 200
ANTHROPIC_VERSION = "2023-06-01"

# The certification's tool: an enum keeps its one argument short even from a model that writes at random.
CERTIFY_TOOL = {
    "name": "get_time",
    "description": "The current time in a time zone.",
    "input_schema": {"type": "object", "properties": {"timezone": {"type": "string", "enum": ["UTC", "Europe/Berlin"]}},
                     "required": ["timezone"]},
}
CERTIFY_TOOL_PROMPT = "What time is it in UTC? Use the get_time tool."
CERTIFY_TOOL_RESULT = "12:00"
# Room for the call with its arguments, and for a model that thinks before it calls.
CERTIFY_TOOL_MAX_TOKENS = 256

# The throughput prompt. Never change it: the catalog's throughput bands were measured with it. About 240 tokens
# with usual tokenizers; the Windows module (win_llama_api_check.ps1) sends the same text, and a test compares them.
THROUGHPUT_PROMPT = (
    "Summarise the following maintenance note in one sentence. The workshop keeps four machines for its model "
    "servers. Each machine has two graphics cards joined by a bridge, a processor with sixteen cores, and enough "
    "memory to hold the largest model twice. Every morning the night shift checks the fans, reads the temperature "
    "log, and restarts any service that stopped during the night. When a card runs hotter than eighty degrees, the "
    "service on it is paused until the card cools again, and the pause is written into the log with the time and "
    "the temperature. Once a week the team runs a fixed benchmark on every machine and compares the speed with the "
    "figure recorded when the machine was delivered; a machine that is much slower than its figure is taken out of "
    "service and inspected. The most common causes so far were a fan clogged with dust, a power cable that was not "
    "fully seated, a card that had been moved into a slower slot, and a driver update that changed the power mode. "
    "Each cause was fixed within a day, and the speed returned to its delivered figure."
)


def _open(base_url, path, headers, timeout, body):
    data = None if body is None else json.dumps(body).encode()
    all_headers = dict(headers, **({"Content-Type": "application/json"} if body is not None else {}))
    try:
        return open_url(base_url.rstrip("/") + path, data=data, headers=all_headers,
                        method="GET" if body is None else "POST", timeout=timeout)
    except HTTPError as exc:
        message = http_error_text(exc)
        raise RuntimeError(f"{path} answered HTTP {exc.code}" + (f": {message[:TEXT_KEPT]}" if message else "")) from None
    except (URLError, OSError) as exc:
        raise RuntimeError(f"{path}: {getattr(exc, 'reason', exc)}") from None


def call(base_url, path, headers, timeout, body=None):
    """One JSON request; returns the decoded body or raises RuntimeError with a short reason."""
    response = _open(base_url, path, headers, timeout, body)
    try:
        return json.loads(response.read() or b"{}")
    except OSError as exc:
        raise RuntimeError(f"{path}: {exc}") from None
    except ValueError:
        raise RuntimeError(f"{path} did not answer JSON") from None


def stream_events(base_url, path, headers, timeout, body):
    """The ``data:`` payloads of a server-sent event stream, decoded where they are JSON (``[DONE]`` stays a
    string); raises RuntimeError when the stream cannot be opened or stalls past ``timeout`` seconds in all."""
    response = _open(base_url, path, headers, timeout, body)
    deadline = time.monotonic() + timeout
    try:
        for _name, data in sse_events(response):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{path} was still streaming after {timeout} s")
            yield data
    except OSError as exc:
        raise RuntimeError(f"{path} stopped streaming: {exc}") from None
    finally:
        response.close()


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


def check_tool_call(base_url, model, headers, timeout, max_tokens):
    """A tool definition in (tool_choice any: the server's grammar must produce a call), a tool_use block out, its
    tool_result back, and a final message."""
    result = {"ok": False, "tool_use": False, "tool_name": None, "stop_reason": None, "final_stop_reason": None}
    headers = dict(headers, **{"anthropic-version": ANTHROPIC_VERSION})
    asked = [{"role": "user", "content": CERTIFY_TOOL_PROMPT}]
    try:
        first = call(base_url, "/v1/messages", headers, timeout,
                     {"model": model, "messages": asked, "max_tokens": CERTIFY_TOOL_MAX_TOKENS, "temperature": 0,
                      "tools": [CERTIFY_TOOL], "tool_choice": {"type": "any"}})
    except RuntimeError as exc:
        return dict(result, detail=f"the request with a tool failed: {exc}")
    result["stop_reason"] = first.get("stop_reason")
    content = [part for part in first.get("content") or [] if isinstance(part, dict)]
    uses = [part for part in content if part.get("type") == "tool_use"]
    if first.get("type") != "message" or not uses:
        return dict(result, detail=f"the reply to a request with a tool (tool_choice any) had no tool_use block "
                                   f"(type {first.get('type')!r}, stop_reason {result['stop_reason']!r}): the model's "
                                   f"chat template may not support tool calls")
    use = uses[0]
    result.update(tool_use=True, tool_name=use.get("name"))
    if use.get("name") != CERTIFY_TOOL["name"]:
        return dict(result, detail=f"the model called {use.get('name')!r}, a tool it was not given")
    # The tools are not sent again: the reply to a tool_result is then read as plain content, which every chat
    # template allows (with tools, a template whose calls have no start marker cannot carry a plain answer).
    answered = asked + [{"role": "assistant", "content": content},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.get("id"),
                                                      "content": CERTIFY_TOOL_RESULT}]}]
    try:
        final = call(base_url, "/v1/messages", headers, timeout,
                     {"model": model, "messages": answered, "max_tokens": max_tokens, "temperature": 0})
    except RuntimeError as exc:
        return dict(result, detail=f"{use.get('name')} was called (stop_reason {result['stop_reason']!r}), but the "
                                   f"request with its tool_result failed: {exc}")
    result["final_stop_reason"] = final.get("stop_reason")
    if final.get("type") != "message":
        return dict(result, detail=f"the reply to the tool_result was {final.get('type')!r}, not a message")
    return dict(result, ok=True, detail=f"{use.get('name')} was called (stop_reason {result['stop_reason']!r}); its "
                                        f"tool_result came back and the model answered (stop_reason "
                                        f"{result['final_stop_reason']!r})")


def check_openai_stream(base_url, model, headers, timeout, max_tokens):
    result = {"ok": False, "chunks": 0, "done": False}
    body = {"model": model, "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": max_tokens,
            "stream": True}
    try:
        for event in stream_events(base_url, "/v1/chat/completions", headers, timeout, body):
            if event == "[DONE]":
                result["done"] = True
                break
            if isinstance(event, dict) and event.get("error"):
                return dict(result, detail=f"the stream carried an error after {result['chunks']} chunks: "
                                           f"{error_text(event)}")
            result["chunks"] += 1
    except RuntimeError as exc:
        return dict(result, detail=f"after {result['chunks']} chunks: {exc}")
    if not result["done"]:
        return dict(result, detail=f"the stream ended after {result['chunks']} chunks without data: [DONE]")
    if not result["chunks"]:
        return dict(result, detail="the stream sent data: [DONE] without a chunk before it")
    return dict(result, ok=True, detail=f"{result['chunks']} chunks, then data: [DONE]")


def check_anthropic_stream(base_url, model, headers, timeout, max_tokens):
    result = {"ok": False, "events": 0, "message_stop": False}
    body = {"model": model, "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": max_tokens,
            "stream": True}
    try:
        for event in stream_events(base_url, "/v1/messages", dict(headers, **{"anthropic-version": ANTHROPIC_VERSION}),
                                   timeout, body):
            result["events"] += 1
            kind = event.get("type") if isinstance(event, dict) else None
            if kind == "error" or (isinstance(event, dict) and "code" in event and "message" in event):
                return dict(result, detail=f"the stream carried an error after {result['events'] - 1} events: "
                                           f"{error_text(event)}")
            if kind == "message_stop":
                result["message_stop"] = True
                break
    except RuntimeError as exc:
        return dict(result, detail=f"after {result['events']} events: {exc}")
    if not result["message_stop"]:
        return dict(result, detail=f"the stream ended after {result['events']} events without message_stop")
    return dict(result, ok=True, detail=f"{result['events']} events, the last message_stop")


def check_throughput(base_url, model, headers, timeout, max_tokens, runs=3):
    """The server's own timings for the fixed prompt, the median of ``runs`` requests (one slow request on a busy
    machine does not decide): each processes the prompt afresh (no cache) at temperature 0 and generates
    ``max_tokens`` without stopping early where the server supports ignore_eos."""
    result = {"prompt_tokens": None, "prompt_per_second": None, "predicted_tokens": None, "predicted_per_second": None}
    body = {"model": model, "messages": [{"role": "user", "content": THROUGHPUT_PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    measured = []
    for run in range(1, runs + 1):
        try:
            answer = call(base_url, "/v1/chat/completions", headers, timeout, body)
        except RuntimeError as exc:
            return dict(result, detail=f"throughput request {run} of {runs} failed: {exc}")
        timings = answer.get("timings")
        if not isinstance(timings, dict) or "predicted_per_second" not in timings:
            return dict(result, detail="the server's reply has no timings (llama-server reports them with each reply)")
        measured.append(timings)
    result.update(
        prompt_tokens=int(median(t.get("prompt_n") or 0 for t in measured)),
        prompt_per_second=round(float(median(t.get("prompt_per_second") or 0 for t in measured)), 2),
        predicted_tokens=int(median(t.get("predicted_n") or 0 for t in measured)),
        predicted_per_second=round(float(median(t.get("predicted_per_second") or 0 for t in measured)), 2),
    )
    detail = (f"{result['prompt_tokens']} prompt tokens at {result['prompt_per_second']} tok/s, "
              f"{result['predicted_tokens']} generated at {result['predicted_per_second']} tok/s "
              f"(median of {runs} {'run' if runs == 1 else 'runs'})")
    if result["predicted_tokens"] != max_tokens:
        detail += f"; asked for {max_tokens}: the server stopped early, ignore_eos is not honoured"
    return dict(result, detail=detail)


def certify(base_url, model, headers, timeout, max_tokens, throughput_max_tokens, throughput_runs):
    """The certification's checks; each answers with its fields and a detail sentence, never an exception."""
    return {
        "tool_call": check_tool_call(base_url, model, headers, timeout, max_tokens),
        "streams": {"openai": check_openai_stream(base_url, model, headers, timeout, max_tokens),
                    "anthropic": check_anthropic_stream(base_url, model, headers, timeout, max_tokens)},
        "throughput": check_throughput(base_url, model, headers, timeout, throughput_max_tokens, throughput_runs),
    }


def check(base_url, model, api_key, prompt, max_tokens, timeout, chat=True, certify_box=False,
          throughput_max_tokens=64, throughput_runs=3):
    """Run the four checks (the first two without ``chat``), and with ``certify_box`` the certification's;
    returns (result, list of problems)."""
    headers = {"Authorization": "Bearer " + api_key, "x-api-key": api_key} if api_key else {}
    result = {"health": call(base_url, "/health", {}, timeout).get("status", "unknown")}
    problems = [] if result["health"] == "ok" else [f"/health says {result['health']}"]
    listed = call(base_url, "/v1/models", headers, timeout)
    result["served_ids"] = [item.get("id") for item in listed.get("data", [])]
    # a router lists each model with its status; an ordinary server's one model is always loaded
    result["loaded_ids"] = [item.get("id") for item in listed.get("data", [])
                            if (item.get("status") or {}).get("value", "loaded") == "loaded"]
    if model not in result["served_ids"]:
        problems.append(f"serves {result['served_ids']}, not {model}")
    if not chat:
        return result, problems
    messages = [{"role": "user", "content": prompt}]
    started = time.monotonic()
    openai = call(base_url, "/v1/chat/completions", headers, timeout,
                  {"model": model, "messages": messages, "max_tokens": max_tokens})
    choice = (openai.get("choices") or [{}])[0].get("message") or {}
    result["openai"] = {
        "seconds": round(time.monotonic() - started, 3),
        "object": openai.get("object", ""),
        "completion_tokens": (openai.get("usage") or {}).get("completion_tokens", 0),
        "tokens_per_second": round((openai.get("timings") or {}).get("predicted_per_second", 0), 2),
        "text": (choice.get("content") or "")[:TEXT_KEPT],
    }
    if result["openai"]["object"] != "chat.completion":
        problems.append(f"the OpenAI API answered {result['openai']['object']!r}, not a chat.completion")
    anthropic = call(base_url, "/v1/messages", dict(headers, **{"anthropic-version": ANTHROPIC_VERSION}), timeout,
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
    if certify_box:
        result.update(certify(base_url, model, headers, timeout, max_tokens, throughput_max_tokens, throughput_runs))
    return result, problems + auth_problems


def main():
    module = AnsibleModule(
        argument_spec=dict(
            base_url=dict(type="str", required=True),
            model=dict(type="str", required=True),
            api_key=dict(type="str", default="", no_log=True),
            api_key_file=dict(type="str", default=""),
            api_key_file_optional=dict(type="bool", default=False),
            prompt=dict(type="str", default="Say hello in five words."),
            max_tokens=dict(type="int", default=16, no_log=False),
            timeout=dict(type="int", default=120),
            chat=dict(type="bool", default=True),
            certify=dict(type="bool", default=False),
            throughput_max_tokens=dict(type="int", default=64, no_log=False),
            throughput_runs=dict(type="int", default=3),
        ),
        supports_check_mode=True,
    )
    params = module.params
    if params["certify"] and not params["chat"]:
        module.fail_json(msg="certify needs chat: true (the certification's checks are chat turns)", health="unknown")
    for name in ("throughput_max_tokens", "throughput_runs"):
        if params[name] < 1:
            module.fail_json(msg=f"{name} must be at least 1, not {params[name]}", health="unknown")
    api_key = params["api_key"]
    if not api_key and params["api_key_file"]:
        try:
            api_key = read_key_file(params["api_key_file"])
        except FileNotFoundError as exc:
            if not params["api_key_file_optional"]:
                module.fail_json(msg=f"cannot read the key file {params['api_key_file']}: {exc.strerror}",
                                 health="unknown")
        except OSError as exc:
            module.fail_json(msg=f"cannot read the key file {params['api_key_file']}: {exc.strerror}",
                             health="unknown")
        if api_key:
            module.no_log_values.add(api_key)
    try:
        result, problems = check(params["base_url"], params["model"], api_key, params["prompt"],
                                 params["max_tokens"], params["timeout"], params["chat"], params["certify"],
                                 params["throughput_max_tokens"], params["throughput_runs"])
    except RuntimeError as exc:
        module.fail_json(msg=f"{params['base_url']}: {exc}", health="unreachable")
    if problems:
        module.fail_json(msg=f"{params['base_url']}: {'; '.join(problems)}", **result)
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
