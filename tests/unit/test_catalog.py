import pytest
import yaml

from controller.errors import CatalogError
from controller.model.catalog import load_catalog
from controller.model.profile import Cpu, HardwareProfile, OsInfo
from tests.cli import run_controller
from tests.unit.clean_errors import assert_one_line_error

SEED_MODELS = {"gemma4-26b-a4b-qat-q4_0", "qwen3.6-35b-a3b-iq4_xs", "qwen3.6-35b-a3b-q6_k"}


def test_builtin_catalog_has_the_seed_models_and_pinned_engines():
    catalog = load_catalog()
    assert SEED_MODELS <= set(catalog.models)
    gemma = catalog.model("gemma4-26b-a4b-qat-q4_0")
    assert gemma.engine == "upstream" and gemma.sliding_window  # ik_llama.cpp lacks the SWA cache
    assert gemma.url() == f"{gemma.hub_url}/google/gemma-4-26B-A4B-it-qat-q4_0-gguf/resolve/main/gemma-4-26B_q4_0-it.gguf"
    assert catalog.model("qwen3.6-35b-a3b-iq4_xs").engine == "ik"
    assert catalog.engine("upstream-02182fc").load_flags["mlock"] == ["--no-mmap", "--mlock"]
    assert catalog.engine("cpu-0c1e570").load_flags["mlock"] == ["--load-mode", "mlock"]
    assert catalog.engine("ik-022bd00a").slot == "ik"


def test_extra_catalog_overrides_and_adds(tmp_path):
    extra = tmp_path / "extra.yml"
    extra.write_text(f"""
models:
  gemma4-26b-a4b-qat-q4_0:
    name: pinned
    repo: google/gemma-4-26B-A4B-it-qat-q4_0-gguf
    file: gemma-4-26B_q4_0-it.gguf
    sha256: {'ab' * 32}
    engine: upstream
  tiny: {{name: t, repo: lab/r, file: t.gguf, engine: upstream}}
""")
    catalog = load_catalog([extra])
    assert catalog.model("gemma4-26b-a4b-qat-q4_0").sha256 == "ab" * 32
    assert catalog.model("tiny").url("http://127.0.0.1:9/") == "http://127.0.0.1:9/lab/r/resolve/main/t.gguf"


def test_unknown_ids_and_bad_entries_are_named(tmp_path):
    with pytest.raises(CatalogError, match="unknown model id 'nope'.*gemma4"):
        load_catalog().model("nope")
    bad = tmp_path / "bad.yml"
    bad.write_text("models:\n  x: {name: x, repo: r, file: f, engine: upstream, sha256: short}\n")
    with pytest.raises(CatalogError, match="x.sha256"):
        load_catalog([bad])
    bad.write_text("modles: {}\n")
    with pytest.raises(CatalogError, match="unknown top-level keys"):
        load_catalog([bad])


GOOD_MODEL = {"name": "t", "repo": "lab/r", "file": "t.gguf", "engine": "upstream"}
GOOD_ENGINE = {"family": "upstream", "commit": "abc1234", "packs": {"linux-x86_64": {"file": "p.tar.gz"}}}


@pytest.mark.parametrize("section,entry_id,body,field", [
    ("models", "../../etc", GOOD_MODEL, "id"),
    ("models", "t", {**GOOD_MODEL, "file": "../../../etc/passwd"}, "file"),
    ("models", "t", {**GOOD_MODEL, "file": "sub/t.gguf"}, "file"),
    ("models", "t", {**GOOD_MODEL, "file": "C:\\t.gguf"}, "file"),
    ("models", "t", {**GOOD_MODEL, "file": "t.gguf\nExecStartPre=/bin/sh"}, "file"),
    ("models", "t", {**GOOD_MODEL, "file": "{{ lookup('pipe', 'id') }}"}, "file"),
    ("models", "t", {**GOOD_MODEL, "template": "../../../../etc/shadow"}, "template"),
    ("models", "t", {**GOOD_MODEL, "template": "/etc/shadow"}, "template"),
    ("models", "t", {**GOOD_MODEL, "repo": "lab/../../r"}, "repo"),
    ("models", "t", {**GOOD_MODEL, "name": "two\nlines"}, "name"),
    ("models", "t", {**GOOD_MODEL, "hub_url": "file:///etc"}, "hub_url"),
    ("engines", "up/../x", GOOD_ENGINE, "id"),
    ("engines", "up-abc1234", {**GOOD_ENGINE, "commit": "abc\n123"}, "commit"),
    ("engines", "up-abc1234", {**GOOD_ENGINE, "packs": {"linux-x86_64": {"file": "../p.tar.gz"}}}, "file"),
    ("engines", "up-abc1234", {**GOOD_ENGINE, "load_flags": {"mmap": ["--x\n--y"]}}, "load_flags"),
    ("downloads", "winsw-2.12.0", {"file": "..\\WinSW.exe"}, "file"),
])
def test_names_in_a_catalog_are_plain_names_never_paths(tmp_path, section, entry_id, body, field):
    path = tmp_path / "extra.yml"
    path.write_text(yaml.safe_dump({section: {entry_id: body}}))
    with pytest.raises(CatalogError) as err:
        load_catalog([path])
    message = str(err.value)
    assert message.startswith(f"{path}: entry {section}.") and field in message and "\n" not in message


def test_a_catalog_that_is_not_utf8_is_one_line_naming_it(tmp_path):
    catalog = tmp_path / "latin1.yml"
    catalog.write_bytes("models:\n  t: {name: caf\u00e9, repo: lab/r, file: t.gguf, engine: upstream}\n".encode("latin-1"))
    profile = tmp_path / "profile.json"
    profile.write_text(HardwareProfile(cpu=Cpu(model="x", cores=2, threads=4), memory_mib=8192,
                                       os=OsInfo(family="linux")).model_dump_json())
    result = run_controller("plan", "--profile", str(profile), "--model", "t", "--catalog", str(catalog), timeout=60)
    assert_one_line_error(result, 2, str(catalog), "not UTF-8", "save the catalog as UTF-8")
