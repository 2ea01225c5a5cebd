"""The options of llama_api_check, documented once for its two implementations: plugins/modules/llama_api_check.py
(POSIX) and plugins/modules/win_llama_api_check.ps1 (Windows, documented by win_llama_api_check.py)."""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
---
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
      - Key sent as a bearer token in C(Authorization) and as C(x-api-key) when the server requires one.
      - When set, requests without it and with a wrong key must be refused with HTTP 401.
    type: str
    default: ""
  api_key_file:
    description:
      - A file on the host whose first line is the key, read when I(api_key) is empty (the server's own key file,
        so the key never leaves the host).
    type: str
    default: ""
  api_key_file_optional:
    description:
      - When true, a I(api_key_file) that does not exist means the server has no key (it is served without one), so
        no key is sent and no refusal is checked; any other error reading it still fails. When false, a missing file
        fails the module.
    type: bool
    default: false
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
  certify:
    description:
      - Also check a tool call round trip, streaming on both APIs and the throughput (C(controller certify)).
      - Needs I(chat).
    type: bool
    default: false
  throughput_max_tokens:
    description:
      - Tokens generated for the throughput measurement. The server is asked to ignore end-of-sequence
        (C(ignore_eos)), so it generates exactly this many where it supports that, at temperature 0, on a fixed
        prompt of 1,062 characters (about 240 tokens with usual tokenizers) that it may not take from its cache.
    type: int
    default: 64
  throughput_runs:
    description: Throughput requests made; the numbers returned are their medians.
    type: int
    default: 3
"""
