"""Each fact the product encodes is defined once, in controller/model/rules.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from controller.model import rules

PACKAGE = Path(rules.__file__).resolve().parent

# The literals of each fact; only controller/model/rules.py may spell them.
RESTATED = re.compile(
    r"573\.96|/var/lib/llama/models|C:\\\\llama\\\\|/etc/llama/templates|\bR5[78]0\b"
    r"|\b(?:570|580|589) *(?:<=|<|>|>=|,|\))|'V100'|\"V100\""
)


@pytest.mark.parametrize("bind, host", [
    ("0.0.0.0", "127.0.0.1"), ("::", "[::1]"), ("127.0.0.1", "127.0.0.1"), ("192.168.1.5", "192.168.1.5"),
    ("::1", "[::1]"), ("fe80::1", "[fe80::1]"), ("[2001:db8::7]", "[2001:db8::7]"), ("box3.lan", "box3.lan"),
])
def test_reachable_host_brackets_ipv6_and_maps_wildcards_to_loopback(bind, host):
    assert rules.reachable_host(bind) == host


def test_the_window_and_its_label_agree():
    window = rules.driver_window()
    assert window["first_major"] == rules.DRIVER_BRANCHES[0] <= rules.DRIVER_DEFAULT_BRANCH <= rules.DRIVER_BRANCHES[-1]
    assert window["last_major"] < rules.DRIVER_BRANCHES[-1] + 10 and window["label"] == "R570-R580"
    assert rules.is_v100("Tesla V100-SXM2-16GB") and rules.is_v100("tesla v100s-pcie-32gb")
    assert not rules.is_v100("NVIDIA GeForce RTX 3090")


def test_no_module_of_the_package_restates_a_fact():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "rules.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if RESTATED.search(line):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not offenders, "take these from controller.model.rules:\n" + "\n".join(offenders)
