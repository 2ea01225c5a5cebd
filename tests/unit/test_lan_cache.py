"""The fleet's LAN cache: the fleet option, the URLs the planner gives each box (the cache as its mirror, the
upstream as fallback only when the fleet allows it), the role variables render writes, the report, and the nginx
configuration the role writes (rendered by Ansible's own template engine)."""

from __future__ import annotations

import re

import pytest
import yaml

from controller.errors import FleetError
from controller.model.catalog import load_catalog
from controller.model.fleet import parse_fleet
from controller.reports.provision import cache_section, markdown
from controller.stages.planner import plan_box
from controller.stages.render import host_vars
from controller.stages.runner import RunResult
from lab.site import PACK_NAME, pinned_engine
from tests.unit.tiny_box import CPU_PROFILE, tiny_catalog_file
from tests.unit.windows.ansible_local import ROLES, role_vars, run_playbook

SHA = "cd" * 32
UPSTREAM_MODELS = "https://hub.example"
UPSTREAM_ENGINES = "http://releases.example/packs"


def _fleet(tmp_path, **cache):
    boxes = {name: {"address": f"10.0.0.{i}", "models": [{"id": "tiny", "ctx": 2048}]}
             for i, name in enumerate(("c1", "c2", "c3"), 1)}
    return parse_fleet({"cache": {"host": "c1", "models": UPSTREAM_MODELS, "engines": UPSTREAM_ENGINES, **cache},
                        "boxes": boxes}, tmp_path / "fleet.yml")


@pytest.fixture
def catalog(tmp_path):
    pack = tmp_path / PACK_NAME
    pack.write_bytes(b"a pack")
    pins = tmp_path / "pins.yml"
    pins.write_text(yaml.safe_dump({"engines": pinned_engine(pack)}))
    return load_catalog([tiny_catalog_file(tmp_path, SHA), pins])


def _vars(fleet, name, catalog):
    box = fleet.box(name)
    return host_vars(box, CPU_PROFILE, plan_box(box, CPU_PROFILE, catalog))


def test_every_box_fetches_through_the_cache_host(tmp_path, catalog):
    fleet = _fleet(tmp_path, port=8123)

    for name in ("c1", "c2", "c3"):
        rendered = _vars(fleet, name, catalog)
        (model,) = rendered["gguf_model_files"]
        (pack,) = rendered["llama_engine_packs"]
        assert model["url"] == "http://10.0.0.1:8123/models/lab/r/resolve/main/t.gguf"
        assert pack["url"] == f"http://10.0.0.1:8123/engines/{PACK_NAME}"
        assert model["sha256"] == SHA and pack["sha256"]  # the roles check them whatever serves the bytes
        assert "fallback_url" not in model and "fallback_url" not in pack  # fallback is off by default
        check = {"host": "c1", "health_url": "http://10.0.0.1:8123/healthz"}
        assert rendered["gguf_model_cache"] == check and rendered["llama_engine_cache"] == check
        assert rendered.get("lan_cache_serve", False) is (name == "c1")


def test_the_cache_host_gets_the_server_and_serves_the_fleet_boxes(tmp_path, catalog):
    rendered = _vars(_fleet(tmp_path), "c1", catalog)

    assert rendered["lan_cache_port"] == 8090 and rendered["lan_cache_bind"] == "0.0.0.0"
    assert rendered["lan_cache_upstreams"] == {"models": UPSTREAM_MODELS, "engines": UPSTREAM_ENGINES}
    assert rendered["lan_cache_allow_from"] == ["10.0.0.1/32", "10.0.0.2/32", "10.0.0.3/32", "127.0.0.0/8"]


def test_fallback_gives_each_file_its_upstream_address(tmp_path, catalog):
    rendered = _vars(_fleet(tmp_path, fallback=True), "c2", catalog)

    (model,) = rendered["gguf_model_files"]
    (pack,) = rendered["llama_engine_packs"]
    assert model["fallback_url"] == f"{UPSTREAM_MODELS}/lab/r/resolve/main/t.gguf"
    assert pack["fallback_url"] == f"{UPSTREAM_ENGINES}/{PACK_NAME}"


def test_only_the_named_kind_is_cached(tmp_path, catalog):
    fleet = parse_fleet({"cache": {"host": "c1", "models": UPSTREAM_MODELS},
                         "boxes": {"c1": {"address": "10.0.0.1", "models": [{"id": "tiny", "ctx": 2048}],
                                          "mirror": {"engines": "http://mirror.lan/engines"}}}}, tmp_path / "f.yml")

    rendered = _vars(fleet, "c1", catalog)

    assert rendered["llama_engine_packs"][0]["url"] == f"http://mirror.lan/engines/{PACK_NAME}"
    assert "llama_engine_cache" not in rendered and rendered["lan_cache_upstreams"] == {"models": UPSTREAM_MODELS}


def test_the_plan_names_the_cache_host(tmp_path, catalog):
    box = _fleet(tmp_path, fallback=True).box("c3")
    plan = plan_box(box, CPU_PROFILE, catalog)

    assert plan.models[0].cache == "c1" and plan.engines[0].download.cache == "c1"
    assert plan.engines[0].download.what == "cache.engines"


@pytest.mark.parametrize(("cache", "boxes", "wanted"), [
    ({"host": "nobody", "models": UPSTREAM_MODELS}, {}, "cache.host names 'nobody', which is not a box"),
    ({"host": "c1"}, {}, "give the upstream it fills from"),
    ({"host": "c1", "models": "ftp://x"}, {}, "not an http(s) address"),
    ({"host": "c1", "models": UPSTREAM_MODELS}, {"c1": {"address": "10.0.0.1", "os": "windows",
                                                        "transport": "winrm"}}, "Windows box"),
    ({"host": "c1", "models": UPSTREAM_MODELS}, {"c1": {"address": "10.0.0.1", "mirror": {"models": "http://m"}}},
     "remove mirror.models"),
    ({"host": "c1", "models": UPSTREAM_MODELS}, {"c1": {"address": "gpu1.lan"}}, "cache.allow_from"),
])
def test_a_bad_cache_is_refused_in_one_line(tmp_path, cache, boxes, wanted):
    with pytest.raises(FleetError) as refused:
        parse_fleet({"cache": cache, "boxes": boxes or {"c1": {"address": "10.0.0.1"}}}, tmp_path / "fleet.yml")

    assert wanted in str(refused.value) and "\n" not in str(refused.value)


def test_the_controller_host_serves_as_a_local_box(tmp_path):
    boxes = {"here": {"address": "localhost", "transport": "local"}, "b": {"address": "gpu1.lan"}}
    cache = {"host": "here", "models": UPSTREAM_MODELS, "allow_from": ["192.168.1.0/24"]}
    with pytest.raises(FleetError, match="give the address the other boxes reach it at"):
        parse_fleet({"cache": cache, "boxes": boxes}, tmp_path / "fleet.yml")

    fleet = parse_fleet({"cache": {**cache, "address": "192.168.1.5"}, "boxes": boxes}, tmp_path / "fleet.yml")

    assert fleet.box("b").mirror.cache.url == "http://192.168.1.5:8090"
    assert fleet.box("here").mirror.cache.serve is not None and fleet.box("b").mirror.cache.serve is None
    assert fleet.cache_allow_from() == ["192.168.1.0/24"]


def _run(data):
    return RunResult(playbook="site.yml", status="successful", rc=0, elapsed=1.0, data=data)


def test_the_report_says_when_a_box_fell_back_to_upstream(tmp_path):
    box = _fleet(tmp_path, fallback=True).box("c2")
    run = _run({"lan_cache": {"c2": {"models": {"cache": "c1", "answered": False, "fallback": True},
                                     "engines": {"cache": "c1", "answered": True, "fallback": False}}}})

    section = cache_section(box, run)

    assert section["host"] == "c1" and section["fallback_allowed"] is True
    assert section["models"]["fallback"] is True
    (note,) = section["notes"]
    assert "the LAN cache on c1" in note and "models came from upstream" in note


def test_a_box_without_a_cache_has_no_cache_section(tmp_path):
    fleet = parse_fleet({"boxes": {"b": {"address": "10.0.0.9"}}}, tmp_path / "fleet.yml")

    assert cache_section(fleet.box("b"), _run({})) is None


def test_the_markdown_report_has_the_cache_notes(tmp_path):
    box = _fleet(tmp_path, fallback=True).box("c2")
    section = cache_section(box, _run({"lan_cache": {"c2": {"models": {"answered": False, "fallback": True}}}}))
    report = {"box": "c2", "address": "10.0.0.2", "generated": "now", "verified": True, "services": [],
              "unplaced": [], "run": None, "cache": section,
              "hardware": {"gpus": [], "driver": None, "cpu": "x", "cores": 1, "memory_mib": 1, "os": "", "warnings": []}}

    text = markdown(report)

    assert "## LAN cache" in text and "models came from upstream" in text


def test_an_unpinned_pack_is_refused_through_the_plain_http_cache(tmp_path):
    from controller.errors import CatalogError

    with pytest.raises(CatalogError, match=r"and cache\.engines \(http://10\.0\.0\.1:8090/engines\) is plain HTTP"):
        _vars(_fleet(tmp_path), "c2", load_catalog([tiny_catalog_file(tmp_path, SHA)]))


# ---------------------------------------------------------------- the role's nginx configuration

CA_BUNDLES = {"Debian": "/etc/ssl/certs/ca-certificates.crt", "RedHat": "/etc/pki/tls/certs/ca-bundle.crt"}


@pytest.fixture(scope="module")
def nginx_conf(tmp_path_factory) -> dict[str, str]:
    """The role's nginx.conf for a Debian and an EL cache host, with one https and one http upstream."""
    folder = tmp_path_factory.mktemp("lan-cache-conf")
    tasks = []
    for family in CA_BUNDLES:
        tasks += [{"name": f"Look like a {family} box", "ansible.builtin.set_fact": {"ansible_os_family": family,
                                                                                    "cacheable": True}},
                  {"name": f"Render the {family} configuration", "ansible.builtin.template": {
                      "src": str(ROLES / "lan_cache" / "templates" / "nginx.conf.j2"),
                      "dest": str(folder / f"{family}.conf"), "mode": "0644"}}]
    play = {"name": "Render the LAN cache's configuration", "hosts": "localhost", "gather_facts": False,
            "vars_files": role_vars("lan_cache"), "tasks": tasks}
    done = run_playbook(folder, [play], windows=False, extra_vars={
        "lan_cache_upstreams": {"models": UPSTREAM_MODELS, "engines": UPSTREAM_ENGINES},
        "lan_cache_allow_from": ["10.0.0.0/24"]})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return {family: (folder / f"{family}.conf").read_text() for family in CA_BUNDLES}


def _nginx_blocks(text: str) -> dict:
    """nginx configuration as nested blocks: {"": [(name, args)], ...} with a block's children under "blocks"."""
    tokens = re.findall(r'"[^"]*"|[{};]|[^\s{};"]+', re.sub(r"#[^\n]*", "", text))
    root: dict = {"directives": [], "blocks": []}
    stack, words = [root], []
    for token in tokens:
        if token == ";":
            stack[-1]["directives"].append((words[0], words[1:]))
            words = []
        elif token == "{":
            block = {"name": words[0], "args": words[1:], "directives": [], "blocks": []}
            stack[-1]["blocks"].append(block)
            stack.append(block)
            words = []
        elif token == "}":
            stack.pop()
        else:
            words.append(token)
    assert len(stack) == 1 and not words
    return root


def _proxied_locations(text: str) -> dict[str, list[dict]]:
    """Each proxied location, as the chain of blocks whose directives it inherits (location, server, http)."""
    (http,) = [block for block in _nginx_blocks(text)["blocks"] if block["name"] == "http"]
    return {location["args"][0]: [location, server, http]
            for server in http["blocks"] if server["name"] == "server"
            for location in server["blocks"] if location["name"] == "location"
            and any(name == "proxy_pass" for name, _ in location["directives"])}


def _effective(chain: list[dict], name: str) -> list[str] | None:
    """A directive's arguments where nginx takes them from: the innermost block that sets it."""
    for block in chain:
        for directive, args in block["directives"]:
            if directive == name:
                return args
    return None


@pytest.mark.slow  # ansible-playbook on localhost: seconds
@pytest.mark.parametrize("family", sorted(CA_BUNDLES))
def test_the_cache_verifies_an_https_upstreams_certificate_against_the_distributions_bundle(nginx_conf, family):
    locations = _proxied_locations(nginx_conf[family])

    assert set(locations) == {"/models/", "/engines/"}
    assert _effective(locations["/models/"], "proxy_pass") == [f"{UPSTREAM_MODELS}/"]
    for chain in locations.values():
        assert _effective(chain, "proxy_ssl_verify") == ["on"]
        assert _effective(chain, "proxy_ssl_trusted_certificate") == [CA_BUNDLES[family]]
        assert _effective(chain, "proxy_ssl_server_name") == ["on"]  # SNI: the hub's name, checked against it too
        assert int(_effective(chain, "proxy_ssl_verify_depth")[0]) >= 2  # a leaf under an intermediate CA


@pytest.mark.slow
def test_a_query_string_never_reaches_upstream_under_a_key_that_leaves_it_out(nginx_conf):
    for location, chain in _proxied_locations(nginx_conf["Debian"]).items():
        (key,) = _effective(chain, "proxy_cache_key")
        kept = "$args" in key or "$query_string" in key or "$request_uri" in key
        dropped = ["set", ["$args", '""']] in [[name, args] for name, args in chain[0]["directives"]]
        assert kept or dropped, f"{location}: the upstream gets the query, the cache key {key} leaves it out"
        # Nor does the encoding a client asks for: upstream always sends the bytes as they are.
        headers = {args[0].lower(): args[1] for name, args in chain[0]["directives"] if name == "proxy_set_header"}
        assert headers.get("accept-encoding") == '""', location
