"""The repository signing key is trusted only with its pinned fingerprint: the openpgp_fingerprint module, and
roles/nvidia_driver's key tasks run by ansible-playbook on this machine with keys served from file:// URLs."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from controller.model import rules
from tests.unit.windows.ansible_local import run_playbook

PROJECT = Path(__file__).resolve().parents[3]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
ED25519 = FIXTURES / "openpgp-ed25519.asc"
RSA = FIXTURES / "openpgp-rsa2048.gpg"
TWO_KEYS = FIXTURES / "openpgp-two-keys.asc"
# What `gpg --show-keys` printed for the fixtures (fixtures/README.md).
ED25519_FPR = "5F607FEB5B7AA4AC817DE03FBD13A788351413EE"
RSA_FPR = "CB55D58BBBFF9A9C27870B55366F42F4DD86BC76"


def _module() -> Any:
    spec = importlib.util.spec_from_file_location("openpgp_fingerprint", PROJECT / "ansible_collections/v100box/llm/plugins/modules/openpgp_fingerprint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mod = _module()


@pytest.mark.parametrize(("path", "expected"), [(ED25519, [ED25519_FPR]), (RSA, [RSA_FPR]),
                                                (TWO_KEYS, [ED25519_FPR, RSA_FPR])])
def test_fingerprints_agree_with_gpg(path, expected):
    assert mod.primary_fingerprints(path.read_bytes()) == expected


def test_armor_headers_are_skipped():
    text = ED25519.read_text().replace("-----BEGIN PGP PUBLIC KEY BLOCK-----\n",
                                       "-----BEGIN PGP PUBLIC KEY BLOCK-----\nComment: served by a mirror\n")
    assert mod.primary_fingerprints(text.encode()) == [ED25519_FPR]


@pytest.mark.parametrize("data", [b"", b"<html>404 Not Found</html>", b"-----BEGIN PGP MESSAGE-----\n\nabc\n",
                                  RSA.read_bytes()[:100]])
def test_what_is_not_a_key_is_refused(data):
    with pytest.raises(mod.NotAKey):
        mod.primary_fingerprints(data)


def _run_key_tasks(tmp_path: Path, key: Path, fingerprint: str):
    keyring = tmp_path / "keyrings" / "nvidia-cuda"
    plays = [{
        "name": "Download, check and trust a repository key",
        "hosts": "localhost",
        "gather_facts": True,
        "gather_subset": ["!all", "!min", "distribution"],
        "tasks": [{
            "name": "Run the role's key tasks",
            "ansible.builtin.include_role": {"name": "v100box.llm.nvidia_driver", "tasks_from": "linux-repo-key"},
            "vars": {
                "__nvidia_driver_key_dest": str(keyring),
                "__nvidia_driver_repo_key_url": key.as_uri(),
                "__nvidia_driver_repo_key_fingerprint": fingerprint,
                "__nvidia_driver_repo_url": "http://mirror.test/cuda/debian12/x86_64/",
            },
        }],
    }]
    return run_playbook(tmp_path, plays, windows=False), keyring


def _changed(stdout: str) -> int:
    return int(re.search(r"localhost\s*:.*changed=(\d+)", stdout).group(1))



@pytest.mark.slow
def test_a_key_with_the_pinned_fingerprint_is_trusted_once(tmp_path):
    result, keyring = _run_key_tasks(tmp_path, ED25519, "5F60 7FEB 5B7A A4AC 817D  E03F BD13 A788 3514 13EE")
    assert result.returncode == 0, result.stdout + result.stderr
    assert Path(f"{keyring}.asc").read_bytes() == ED25519.read_bytes()
    again, _ = _run_key_tasks(tmp_path, ED25519, ED25519_FPR)
    assert again.returncode == 0 and _changed(again.stdout) == 0, again.stdout


@pytest.mark.slow
def test_a_binary_key_is_kept_under_the_name_apt_reads_as_binary(tmp_path):
    result, keyring = _run_key_tasks(tmp_path, RSA, RSA_FPR.lower())
    assert result.returncode == 0, result.stdout + result.stderr
    assert Path(f"{keyring}.gpg").read_bytes() == RSA.read_bytes() and not Path(f"{keyring}.asc").exists()


@pytest.mark.slow
@pytest.mark.parametrize(("key", "found"), [(RSA, RSA_FPR), (TWO_KEYS, f"{ED25519_FPR}, {RSA_FPR}")],
                         ids=["another-key", "pinned-key-plus-another"])
def test_any_other_key_is_refused_and_nothing_is_trusted(tmp_path, key, found):
    result, keyring = _run_key_tasks(tmp_path, key, ED25519_FPR)
    assert result.returncode == 2
    assert f"has fingerprint {found}, not the pinned {ED25519_FPR}" in result.stdout
    assert "mirror.test/cuda/debian12" in result.stdout
    assert not Path(f"{keyring}.asc").exists() and not Path(f"{keyring}.gpg").exists()


@pytest.mark.slow
def test_a_mirror_key_without_a_fingerprint_is_refused_before_anything_changes(tmp_path):
    plays = [{
        "name": "Preflight of a box whose driver mirror names a key but no fingerprint",
        "hosts": "localhost",
        "gather_facts": False,
        "tasks": [{
            "name": "Run the role's preflight",
            "ansible.builtin.include_role": {"name": "v100box.llm.nvidia_driver", "tasks_from": "preflight"},
            "vars": {
                "nvidia_driver_gpus": [{"index": 0, "name": "Tesla V100-PCIE-32GB", "pci_bus_id": "0000:04:00.0",
                                        "is_v100": True}],
                "nvidia_driver_window": rules.driver_window(),
                "nvidia_driver_repo_url": "http://mirror.test/cuda/",
                "nvidia_driver_repo_key_url": "http://mirror.test/cuda/key.asc",
            },
        }],
    }]
    result = run_playbook(tmp_path, plays, windows=False)
    assert result.returncode == 2
    assert "without a valid nvidia_driver_repo_key_fingerprint" in result.stdout
    assert "mirror.drivers_key_fingerprint" in result.stdout
