"""llama_api_check proves a keyed server refuses requests without its key, against the real CPU
llama-server reading the key the way the role hands it over: --api-key-file."""

from __future__ import annotations

import json

import pytest

from lab import tinymodels
from lab.llama_server import serve
from tests.unit.plugins.test_llama_api_check import run_module

pytestmark = pytest.mark.engine

# Characters systemd's environment-file parsing rewrites: with a key file they arrive verbatim.
ODD_KEY = 'odd\\key"with\'quotes$and%percent'


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tinymodels.write_model(tmp_path_factory.mktemp("m") / "tiny.gguf", "llama", file_type="q8_0")


def test_a_keyed_server_refuses_requests_without_the_key(llama_server, model, tmp_path):
    key_file = tmp_path / "api-key"
    key_file.write_text(ODD_KEY + "\n")
    with serve(llama_server, model, ["--alias", "tiny", "--api-key-file", str(key_file), "-c", "512", "-np", "1"]) as srv:
        result = run_module(tmp_path, base_url=srv.url, model="tiny", api_key=ODD_KEY, max_tokens=2)
    assert not result.get("failed"), result
    assert result["auth"] == {"required": True, "anonymous_status": 401, "wrong_key_status": 401}
    assert ODD_KEY not in json.dumps(result)


def test_a_server_that_ignores_its_key_fails_verification(llama_server, model, tmp_path):
    # What an ik_llama.cpp server given only LLAMA_API_KEY does: it serves everyone. Sending the right key
    # alone passed before; the anonymous request must catch it.
    with serve(llama_server, model, ["--alias", "tiny", "-c", "512", "-np", "1"]) as srv:
        result = run_module(tmp_path, base_url=srv.url, model="tiny", api_key="expected-key-0123456789", max_tokens=2)
    assert result["failed"]
    assert "answered HTTP 200 without a key, not 401: the server does not check its API key" in result["msg"]
    assert result["auth"]["anonymous_status"] == 200 and result["auth"]["wrong_key_status"] == 200


def test_a_server_without_a_key_reports_it(llama_server, model, tmp_path):
    with serve(llama_server, model, ["--alias", "tiny", "-c", "512", "-np", "1"]) as srv:
        result = run_module(tmp_path, base_url=srv.url, model="tiny", max_tokens=2)
    assert not result.get("failed"), result
    assert result["auth"] == {"required": False}


def test_the_key_file_is_read_on_the_host_and_an_optional_one_may_be_absent(llama_server, model, tmp_path):
    # What roles/llama_verify hands the module: the server's own key file, read where the module runs.
    key_file = tmp_path / "tiny.key"
    key_file.write_text(ODD_KEY + "\n")
    missing = str(tmp_path / "none.key")
    with serve(llama_server, model, ["--alias", "tiny", "--api-key-file", str(key_file), "-c", "512", "-np", "1"]) as srv:
        keyed = run_module(tmp_path, base_url=srv.url, model="tiny", api_key_file=str(key_file),
                           api_key_file_optional=True, max_tokens=2)
        # A keyed server whose key file is gone: no key is sent, and the server refusing it fails the check.
        lost = run_module(tmp_path, base_url=srv.url, model="tiny", api_key_file=missing, api_key_file_optional=True,
                          max_tokens=2)
    assert not keyed.get("failed"), keyed
    assert keyed["auth"] == {"required": True, "anonymous_status": 401, "wrong_key_status": 401}
    assert ODD_KEY not in json.dumps(keyed)
    assert lost["failed"] and "answered HTTP 401" in lost["msg"], lost
    with serve(llama_server, model, ["--alias", "tiny", "-c", "512", "-np", "1"]) as srv:
        open_server = run_module(tmp_path, base_url=srv.url, model="tiny", api_key_file=missing,
                                 api_key_file_optional=True, max_tokens=2)
        strict = run_module(tmp_path, base_url=srv.url, model="tiny", api_key_file=missing, max_tokens=2)
    assert not open_server.get("failed"), open_server
    assert open_server["auth"] == {"required": False}
    assert strict["failed"] and strict["msg"] == f"cannot read the key file {missing}: No such file or directory"
