"""llama_service's preflight, run by ansible-playbook on this machine (it only asserts, so no target is
needed): hand-written inventories get the same exposure and key rules as the controller's.

Every case is a host of one inventory in one ansible-playbook run (tests/preflight.py); each test reads its cases'
outcomes."""

from __future__ import annotations

import pytest

from tests.preflight import Outcome, expect, run_preflights

pytestmark = pytest.mark.slow  # one ansible-playbook run: seconds

KEY = "preflight-key-0123456789"
EXPOSED = {"llama_service_bind": "0.0.0.0"}
# Keys a server would not match as written: refused, and never printed.
UNMATCHABLE_KEYS = {"trailing_space": "trailing-space-key-0123 ", "spaces": "a key with spaces 0123",
                    "comment": "#comment-key-0123456", "short": "shortkey1"}


def instance(*args: str, **extra: object) -> dict[str, object]:
    return {"name": "llama-a", "model": "tiny", "engine": "cpu", "port": 18011,
            "args": ["--model", "/m.gguf", "--port", "18011", *args], **extra}


CASES: dict[str, dict] = {
    "loopback_without_a_key": {"llama_service_instances": [instance("--host", "127.0.0.1")]},
    # The reproduced hole: the arguments bind everywhere while llama_service_bind says loopback.
    "host_arg": {"llama_service_instances": [instance("--host", "0.0.0.0")]},
    "host_equals": {"llama_service_instances": [instance("--host=0.0.0.0")]},
    "host_env": {"llama_service_instances": [instance(env={"LLAMA_ARG_HOST": "0.0.0.0"})]},
    "exposed_bare": {**EXPOSED, "llama_service_instances": [instance("--host", "0.0.0.0")]},
    "exposed_key_only": {**EXPOSED, "llama_service_instances": [instance("--host", "0.0.0.0")],
                         "llama_service_api_key": KEY},
    "exposed_networks_only": {**EXPOSED, "llama_service_instances": [instance("--host", "0.0.0.0")],
                              "llama_service_allow_from": ["10.0.0.0/8"]},
    "exposed_keyed_and_limited": {**EXPOSED, "llama_service_instances": [instance("--host", "0.0.0.0")],
                                  "llama_service_api_key": KEY, "llama_service_allow_from": ["10.0.0.0/8"]},
    "key_argument": {"llama_service_instances": [instance("--api-key", KEY)]},
    "key_file_argument": {"llama_service_instances": [instance("--api-key-file", "/k")]},
    "key_environment": {"llama_service_instances": [instance(env={"LLAMA_API_KEY": KEY})]},
    **{f"key_{name}": {"llama_service_api_key": key, "llama_service_instances": [instance()]}
       for name, key in UNMATCHABLE_KEYS.items()},
    "key_systemd_would_rewrite": {"llama_service_api_key": 'odd\\key"with\'quotes$%-0123',
                                  "llama_service_instances": [instance()]},
}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> Outcome:
    return run_preflights(tmp_path_factory.mktemp("preflight"), "llama_service", CASES)


def test_loopback_without_a_key_passes(outcome):
    assert outcome["loopback_without_a_key"] is None, outcome["loopback_without_a_key"]


@pytest.mark.parametrize("case", ["host_arg", "host_equals", "host_env"])
def test_arguments_that_bind_elsewhere_than_llama_service_bind_are_refused(outcome, case):
    expect(outcome, case, "llama_service_instances entry llama-a: its args bind", "but llama_service_bind is 127.0.0.1")


def test_binding_beyond_loopback_needs_a_key_and_allowed_networks(outcome):
    for case in ("exposed_bare", "exposed_key_only", "exposed_networks_only"):
        expect(outcome, case, "llama_service_bind is 0.0.0.0, which other machines can reach")
    assert outcome["exposed_keyed_and_limited"] is None, outcome["exposed_keyed_and_limited"]


def test_key_on_the_command_line_or_in_the_environment_is_refused(outcome):
    for case in ("key_argument", "key_file_argument", "key_environment"):
        expect(outcome, case, "never pass --api-key, --api-key-file")


@pytest.mark.parametrize("name", list(UNMATCHABLE_KEYS))
def test_keys_a_server_would_not_match_are_refused(outcome, name):
    expect(outcome, f"key_{name}", "use 16 to 256 printable ASCII characters with no spaces")
    assert UNMATCHABLE_KEYS[name].strip() not in outcome.output  # the whole run's report: no case prints its key


def test_keys_systemd_would_rewrite_are_accepted(outcome):
    assert outcome["key_systemd_would_rewrite"] is None, outcome["key_systemd_would_rewrite"]
