#!/usr/bin/python
# The documentation of win_llama_api_check.ps1, the Windows implementation of v100box.llm.llama_api_check.

DOCUMENTATION = r"""
---
module: win_llama_api_check
short_description: Check that a llama-server on a Windows box answers both chat APIs as the expected model
description:
  - The Windows implementation of M(v100box.llm.llama_api_check), with its options, checks, failures and results;
    see that module for what each means. Roles call M(v100box.llm.llama_api_check) on every box; its action plugin
    runs this module on a PowerShell host.
  - It has a name of its own so that a lookup of C(llama_api_check) by name alone (the mitogen strategy's) never
    takes it for the POSIX module.
extends_documentation_fragment: [v100box.llm.llama_api_check]
author: v100box maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Check the Gemma server on a Windows box (roles call v100box.llm.llama_api_check, which runs this there)
  v100box.llm.win_llama_api_check:
    base_url: http://127.0.0.1:8011
    model: gemma4-26b-a4b-qat-q4_0
    api_key_file: C:\ProgramData\llama\keys\gemma.key
"""

# The fields of llama_api_check's RETURN, each as it documents it (tests/unit/plugins/test_llama_api_check_contract.py
# compares the names).
RETURN = r"""
health:
  description: As M(v100box.llm.llama_api_check) returns it.
  type: str
  returned: always
loaded_ids:
  description: As M(v100box.llm.llama_api_check) returns it.
  type: list
  elements: str
  returned: when the server is healthy
served_ids:
  description: As M(v100box.llm.llama_api_check) returns it.
  type: list
  elements: str
  returned: when the server is healthy
openai:
  description: As M(v100box.llm.llama_api_check) returns it.
  type: dict
  returned: when the server is healthy and I(chat) is true
anthropic:
  description: As M(v100box.llm.llama_api_check) returns it.
  type: dict
  returned: when the server is healthy and I(chat) is true
auth:
  description: As M(v100box.llm.llama_api_check) returns it.
  type: dict
  returned: when the server is healthy and I(chat) is true
tool_call:
  description: As M(v100box.llm.llama_api_check) returns it.
  type: dict
  returned: when the server is healthy and I(certify) is true
streams:
  description: As M(v100box.llm.llama_api_check) returns it.
  type: dict
  returned: when the server is healthy and I(certify) is true
throughput:
  description: As M(v100box.llm.llama_api_check) returns it.
  type: dict
  returned: when the server is healthy and I(certify) is true
"""
