"""The collection's Jinja filters (plugins/filter/v100box.py): in a bare Jinja environment, and through Ansible on a
control node where the controller package cannot be imported."""

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import jinja2
import pytest

from ansible_collections.v100box.llm.plugins.filter.v100box import FilterModule, systemd_command

ROOT = Path(__file__).resolve().parents[2]
FILTER_PLUGIN = ROOT / "ansible_collections/v100box/llm/plugins/filter/v100box.py"


def filters() -> dict:
    return FilterModule().filters()


def test_systemd_command_escapes_specifiers_variables_and_quotes():
    words = ["/opt/llama/cpu/current/bin/llama-server", "--alias", 'say "hi" 100%', "$HOME", "a\\b"]
    line = systemd_command(words)
    assert '"100%%"' not in line and "100%%" in line and "$$HOME" in line
    # After systemd undoes %% and $$, the line splits back into the same words (systemd follows
    # shell-like double-quote rules for these characters).
    assert shlex.split(line.replace("%%", "%").replace("$$", "$")) == words


def test_filters_work_in_a_bare_jinja_environment():
    env = jinja2.Environment()
    env.filters.update(filters())
    assert env.from_string("{{ ['a b', 'c'] | systemd_command }}").render() == '"a b" "c"'


def test_reachable_host_in_a_bare_jinja_environment():
    env = jinja2.Environment()
    env.filters.update(filters())
    url = env.from_string("http://{{ bind | reachable_host }}:{{ port }}/health")
    assert url.render(bind="0.0.0.0", port=8011) == "http://127.0.0.1:8011/health"
    assert url.render(bind="::", port=8011) == "http://[::1]:8011/health"
    assert url.render(bind="::1", port=1) == "http://[::1]:1/health"
    assert url.render(bind="192.168.1.5", port=1) == "http://192.168.1.5:1/health"
    assert url.render(bind="box.lan", port=1) == "http://box.lan:1/health"


def test_gpu_minors_of_an_instance_in_a_bare_jinja_environment():
    """Issue 20: a unit opens its cards by their device nodes' minor numbers, which need not be their indices."""
    env = jinja2.Environment()
    env.filters.update(filters())
    gpus = [{"index": 0, "uuid": "GPU-a", "minor_number": 1}, {"index": 1, "uuid": "GPU-b", "minor_number": 0},
            {"index": 2}]
    minors = env.from_string("{{ item | llama_gpu_minors(gpus) | join(',') }}")
    assert minors.render(item={"gpu_minors": [7]}, gpus=gpus) == "7"  # the plan's, as rendered
    assert minors.render(item={"gpu_minors": []}, gpus=gpus) == ""  # a CPU service: none
    assert minors.render(item={"env": {"CUDA_VISIBLE_DEVICES": "1"}}, gpus=gpus) == "0"
    assert minors.render(item={"env": {"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b"}}, gpus=gpus) == "1,0"
    assert minors.render(item={"env": {"CUDA_VISIBLE_DEVICES": "2,5"}}, gpus=gpus) == "2,5"  # unprobed: the index
    assert minors.render(item={"env": {"CUDA_VISIBLE_DEVICES": "-1"}}, gpus=gpus) == ""  # CUDA sees none
    assert minors.render(item={}, gpus=gpus) == "1,0,2"  # naming none: every card
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES names GPU-c, which llama_service_gpus does not list"):
        minors.render(item={"name": "llama-x", "env": {"CUDA_VISIBLE_DEVICES": "GPU-c"}}, gpus=gpus)


def test_every_filter_runs_through_ansible_without_the_controller(tmp_path):
    """Issue: a control node (a box running ansible-pull, an execution environment) has the collection, not the
    controller; every filter loads and runs there through Ansible's collection loader, by its full name."""
    (tmp_path / "play.yml").write_text(textwrap.dedent("""\
        - name: Use every filter
          hosts: localhost
          gather_facts: false
          vars:
            gpus: [{index: 0, uuid: GPU-b, minor_number: 3}]
            services: [{name: s, key: k, openclaw_provider_id: v100-b, openclaw_provider: {models: [{id: m}]}}]
          tasks:
            - name: Show what each filter makes
              ansible.builtin.debug:
                msg:
                  command: "{{ ['a b', '100%'] | v100box.llm.systemd_command }}"
                  quoted: "{{ '$HOME' | v100box.llm.systemd_quote }}"
                  host: "{{ '::' | v100box.llm.reachable_host }}"
                  minors: "{{ {'env': {'CUDA_VISIBLE_DEVICES': 'GPU-b'}} | v100box.llm.llama_gpu_minors(gpus) }}"
                  problem: "{{ '{ broken: ' | v100box.llm.openclaw_problem('f.json') }}"
                  merged: "{{ '{}' | v100box.llm.openclaw_merge(services, {'k': 'sk-1'}) | from_json }}"
        """))
    code = textwrap.dedent(f"""\
        import sys
        sys.modules["controller"] = None  # importing it, here or in a forked worker, raises ImportError
        from ansible.cli.playbook import main
        sys.argv = ["ansible-playbook", "-c", "local", "-i", "localhost,", {str(tmp_path / "play.yml")!r}]
        sys.exit(main())
        """)
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(ROOT), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"), "ANSIBLE_HOME": str(tmp_path / "home"),
           "ANSIBLE_PYTHON_INTERPRETER": sys.executable, "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1",
           "ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json"}
    env.pop("ANSIBLE_CONFIG", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    answer = json.loads(done.stdout)["plays"][0]["tasks"][0]["hosts"]["localhost"]["msg"]
    assert answer["command"] == '"a b" "100%%"' and answer["quoted"] == '"$$HOME"' and answer["host"] == "[::1]"
    assert answer["minors"] == [3]
    assert answer["problem"].startswith("f.json is not valid JSON5")
    assert answer["merged"]["models"]["providers"]["v100-b"] == {"models": [{"id": "m"}], "apiKey": "sk-1"}


def test_the_filter_plugin_never_imports_the_controller():
    """Nothing in the collection reaches into the controller package: the plugin's whole import graph (module_utils
    and plugin_utils included) loads with the controller blocked, in a fresh interpreter."""
    code = textwrap.dedent("""\
        import sys
        sys.modules["controller"] = None  # any import of it raises ImportError
        from ansible_collections.v100box.llm.plugins.filter import v100box
        assert v100box.FilterModule().filters()["openclaw_problem"]("{}") == ""
        """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
