"""The fleet's LAN cache end to end on three systemd targets: roles/lan_cache runs nginx (installed from
Debian's packages by the role) on the cache host, and the download roles of site.yml (llama_engine,
gguf_model) fetch the engine pack and the model through it on all three boxes at once, with the inventory
the controller renders (probe, plan, render of each box). The upstream test server counts the body bytes it
sends: each file goes out once. A Range request through the cache is answered from it. With the cache down,
a box stops naming the cache host when the fleet allows no fallback, and fetches from upstream (its sha256
still checked, the run's data saying so) when it does. Last, the cache host is pointed at two more upstreams: a
request's query string never reaches upstream (one that answers a query with other bytes cannot fill the entry
of the plain path), and an https upstream whose certificate the distribution's bundle does not trust is refused.

The targets share the host's network, so the cache listens on a free loopback port that every target and
this test reach.
"""

from __future__ import annotations

import hashlib
import time

import httpx
import pytest
import yaml

from controller.actions.provision import prepare
from controller.model.fleet import load_fleet
from controller.reports.provision import cache_section
from controller.stages.render import read_rendered
from controller.stages.runner import run_playbook
from lab.fileserver import FileServer
from lab.site import MODEL_REPO, PACK_NAME, mirror
from lab.target import free_port, role_play, started

pytestmark = [pytest.mark.podman, pytest.mark.engine, pytest.mark.slow]

BOXES = ("c1", "c2", "c3")
PLAY = role_play("Fetch through the fleet's LAN cache with the roles and order of playbooks/site.yml",
                 ["lan_cache", "llama_engine", "gguf_model"])
CACHE_PLAY = role_play("Run the fleet's LAN cache", ["lan_cache"])


class _QueryAwareServer(FileServer):
    """An upstream that answers a path with a query with other bytes (as a versioned or signed URL may), and
    records every query it is sent."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.queries: list[str] = []

    async def _plain(self, request):
        path = request.match_info["path"]
        if request.query_string:
            self.queries.append(request.query_string)
            return self._file(f"{path}.query")
        return self._file(path)


@pytest.fixture(scope="module")
def targets(target_image):
    with started(target_image, BOXES) as boxes:
        yield boxes


@pytest.fixture(scope="module")
def lab(tmp_path_factory, lab_site, site_server, targets):
    (root, _), (server, catalog) = lab_site, site_server
    folder = tmp_path_factory.mktemp("lan-cache")
    cache = {"host": "c1", "address": "127.0.0.1", "bind": "127.0.0.1", "port": free_port(), **mirror(server.url)}
    boxes = {name: {**target.fleet_entry(), "models": [{"id": "tiny-llama", "ctx": 2048}]}
             for name, target in targets.items()}
    (folder / "play.yml").write_text(PLAY)
    model = yaml.safe_load(catalog.read_text())["models"]["tiny-llama"]["file"]
    return {"folder": folder, "cache": cache, "boxes": boxes, "catalog": catalog, "inventory": folder / "inventory",
            "model": root / MODEL_REPO / model, "pack": root / "engines" / PACK_NAME, "server": server}


def _render(lab, names, **cache):
    path = lab["folder"] / "fleet.yml"
    path.write_text(yaml.safe_dump({"catalogs": [str(lab["catalog"])], "cache": {**lab["cache"], **cache},
                                    "boxes": lab["boxes"]}))
    fleet = load_fleet(path)
    for name in names:
        prepare(fleet, name, lab["inventory"])
    return fleet


def _run(lab, limit=None):
    return run_playbook(str(lab["folder"] / "play.yml"), inventory=lab["inventory"], limit=limit, forks=3,
                        raise_on_failure=False)


def _sha256(target, path):
    return target.exec(["sha256sum", path]).split()[0]


def test_three_boxes_fetch_each_file_from_upstream_once(lab, targets):
    _render(lab, BOXES)
    lab["server"].reset_counters()
    started = time.monotonic()

    result = _run(lab)

    assert result.status == "successful", [f.message for f in result.failed]
    sent = lab["server"].bytes_sent
    model, pack = lab["model"], lab["pack"]
    assert sent == model.stat().st_size + pack.stat().st_size, (sent, model.stat().st_size, pack.stat().st_size)
    model_dir = read_rendered((lab["inventory"] / "host_vars" / "c2.yml").read_text())["gguf_model_dir"]
    want = hashlib.sha256(model.read_bytes()).hexdigest()
    for name, target in targets.items():
        assert _sha256(target, f"{model_dir}/{model.name}") == want, name
        assert target.exec(["test", "-x", "/opt/llama/cpu/current/bin/llama-server"]) == ""
        assert result.data["lan_cache"][name]["models"] == {"cache": "c1", "answered": True, "fallback": False}
    # Debian's own nginx unit stays disabled: only lan-cache.service runs.
    c1 = targets["c1"]
    assert c1.exec("systemctl is-active lan-cache.service").strip() == "active"
    assert c1.exec("systemctl is-enabled nginx.service || true").strip() == "disabled"
    print(f"3 boxes through the cache in {time.monotonic() - started:.1f} s; upstream sent {sent} bytes")

    lab["server"].reset_counters()
    again = _run(lab)  # converged: nothing changes, nothing is fetched

    assert again.status == "successful" and again.changed == 0, {h: vars(s) for h, s in again.stats.items()}
    assert lab["server"].bytes_sent == 0


def test_a_range_request_is_served_from_the_cache(lab):
    lab["server"].reset_counters()
    cache = lab["cache"]
    url = f"http://127.0.0.1:{cache['port']}/models/{MODEL_REPO}/resolve/main/{lab['model'].name}"

    answer = httpx.get(url, headers={"Range": "bytes=1000-1999"}, timeout=10)

    assert answer.status_code == 206 and answer.headers["content-range"].startswith("bytes 1000-1999/")
    assert answer.content == lab["model"].read_bytes()[1000:2000]
    assert answer.headers["x-cache-status"] == "HIT"
    assert lab["server"].bytes_sent == 0


def test_a_down_cache_stops_the_box_that_needs_a_file_naming_the_cache_host(lab, targets):
    model_dir = read_rendered((lab["inventory"] / "host_vars" / "c2.yml").read_text())["gguf_model_dir"]
    targets["c1"].exec("systemctl stop lan-cache.service")
    targets["c2"].exec(["rm", "-f", f"{model_dir}/{lab['model'].name}"])
    lab["server"].reset_counters()

    result = _run(lab, limit="c2")

    assert result.status == "failed"
    message = " ".join(f.message for f in result.failed)
    assert "the LAN cache on c1" in message and "cache.fallback: true" in message, message
    assert lab["server"].bytes_sent == 0


def test_a_down_cache_falls_back_to_upstream_when_the_fleet_allows_it(lab, targets):
    fleet = _render(lab, ["c2"], fallback=True)
    lab["server"].reset_counters()

    result = _run(lab, limit="c2")

    assert result.status == "successful", [f.message for f in result.failed]
    assert lab["server"].bytes_sent == lab["model"].stat().st_size  # the engine pack was already installed
    assert result.data["lan_cache"]["c2"]["models"] == {"cache": "c1", "answered": False, "fallback": True}
    section = cache_section(fleet.box("c2"), result)
    assert any("models came from upstream" in note for note in section["notes"])
    model_dir = read_rendered((lab["inventory"] / "host_vars" / "c2.yml").read_text())["gguf_model_dir"]
    assert _sha256(targets["c2"], f"{model_dir}/{lab['model'].name}") == hashlib.sha256(
        lab["model"].read_bytes()).hexdigest()


def test_a_query_never_reaches_upstream_and_an_untrusted_certificate_is_refused(lab, targets, tmp_path):
    plain, other = b"p" * 20_000, b"q" * 20_000  # the same length: only the bytes tell the two apart
    (tmp_path / "probe.bin").write_bytes(plain)
    (tmp_path / "probe.bin.query").write_bytes(other)
    _render(lab, ["c1"])
    (lab["folder"] / "cache.yml").write_text(CACHE_PLAY)
    base = f"http://127.0.0.1:{lab['cache']['port']}"
    since = targets["c1"].exec(["date", "+%Y-%m-%d %H:%M:%S"]).strip()

    with _QueryAwareServer(tmp_path) as upstream, FileServer(tmp_path, tls=True) as untrusted:
        result = run_playbook(str(lab["folder"] / "cache.yml"), inventory=lab["inventory"], limit="c1",
                              extravars={"lan_cache_upstreams": {"models": upstream.url, "engines": untrusted.url}},
                              raise_on_failure=False)
        assert result.status == "successful", [f.message for f in result.failed]

        first = httpx.get(f"{base}/models/probe.bin?x=1", timeout=10)
        second = httpx.get(f"{base}/models/probe.bin", timeout=10)
        refused = httpx.get(f"{base}/engines/probe.bin", timeout=10)

    assert first.status_code == 200 and first.content == plain, first.content[:40]
    assert second.status_code == 200 and second.headers["x-cache-status"] == "HIT"
    assert second.content == plain, second.content[:40]  # not what upstream answers for ?x=1
    assert upstream.queries == []
    assert refused.status_code == 502 and untrusted.requests == []  # no HTTP request after the TLS handshake
    journal = targets["c1"].exec(["journalctl", "--no-pager", "-u", "lan-cache.service", "--since", since])
    assert "upstream SSL certificate verify error" in journal, journal[-2000:]
