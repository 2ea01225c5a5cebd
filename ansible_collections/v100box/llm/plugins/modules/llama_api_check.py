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

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.v100box.llm.plugins.module_utils.api_check import SETTINGS, check, server_key, settings_problem


def main():
    module = AnsibleModule(
        argument_spec=dict(
            base_url=dict(type="str", required=True),
            model=dict(type="str", required=True),
            api_key_file=dict(type="str", default=""),
            api_key_file_optional=dict(type="bool", default=False),
            chat=dict(type="bool", default=True),
            **{name: dict(spec) for name, spec in SETTINGS.items()},
        ),
        supports_check_mode=True,
    )
    params = module.params
    if params["certify"] and not params["chat"]:
        module.fail_json(msg="certify needs chat: true (the certification's checks are chat turns)", health="unknown")
    problem = settings_problem(params)
    if problem:
        module.fail_json(msg=problem, health="unknown")
    api_key, problem = server_key(params["api_key"], params["api_key_file"], params["api_key_file_optional"])
    if problem:
        module.fail_json(msg=problem, health="unknown")
    if api_key:
        module.no_log_values.add(api_key)
    result, problems = check(params["base_url"], params["model"], api_key, params["prompt"], params["max_tokens"],
                             params["timeout"], params["chat"], params["certify"], params["throughput_max_tokens"],
                             params["throughput_runs"])
    if problems:
        module.fail_json(msg=f"{params['base_url']}: {'; '.join(problems)}", **result)
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
