"""A server's checks, shared by the modules that run them on a box: ``llama_api_check`` (one server) and
``box_manifest`` (the converged fast path checks every server of the box in the same run as its comparison, so a
converged box costs one module run). The Windows twin, ``win_llama_api_check.ps1``, does the same in PowerShell.
"""

from __future__ import annotations

import json
import secrets
import time
from statistics import median
from urllib.error import HTTPError, URLError

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


# The settings of a server's checks, in the argument specs of both modules that run them (llama_api_check and
# box_manifest on a converged box), so that both take, default and refuse them alike.
SETTINGS = {
    "api_key": {"type": "str", "default": "", "no_log": True},
    "prompt": {"type": "str", "default": "Say hello in five words."},
    "max_tokens": {"type": "int", "default": 16, "no_log": False},
    "timeout": {"type": "int", "default": 120},
    "certify": {"type": "bool", "default": False},
    "throughput_max_tokens": {"type": "int", "default": 64, "no_log": False},
    "throughput_runs": {"type": "int", "default": 3},
}


def settings_problem(params):
    """What is wrong with the checks' settings in a module's ``params`` (None: nothing)."""
    for name in ("throughput_max_tokens", "throughput_runs"):
        if params[name] < 1:
            return f"{name} must be at least 1, not {params[name]}"
    return None


def server_key(api_key, api_key_file, optional=False):
    """The key to send a server: ``api_key``, else the one in ``api_key_file`` on the box (none when the file is
    missing and ``optional``: a server served without a key has no key file); returns (key, problem or None)."""
    if api_key or not api_key_file:
        return api_key, None
    try:
        return read_key_file(api_key_file), None
    except FileNotFoundError as exc:
        return "", None if optional else f"cannot read the key file {api_key_file}: {exc.strerror}"
    except OSError as exc:
        return "", f"cannot read the key file {api_key_file}: {exc.strerror}"


def check(base_url, model, api_key, prompt, max_tokens, timeout, chat=True, certify_box=False,
          throughput_max_tokens=64, throughput_runs=3):
    """Run the four checks (the first two without ``chat``), and with ``certify_box`` the certification's;
    returns (result, list of problems). A request that gets no answer, or an error where JSON was due, ends the
    checks: the result is then health ``unreachable`` and the one problem says which request and why."""
    try:
        return _check(base_url, model, api_key, prompt, max_tokens, timeout, chat, certify_box,
                      throughput_max_tokens, throughput_runs)
    except RuntimeError as exc:
        return {"health": "unreachable"}, [str(exc)]


def _check(base_url, model, api_key, prompt, max_tokens, timeout, chat, certify_box, throughput_max_tokens,
           throughput_runs):
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
